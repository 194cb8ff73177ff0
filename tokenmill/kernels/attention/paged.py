"""Launches of the paged-attention kernels: the structure of a step's attention, its grids,
key splits and arguments (tile tables in ``launch.py``; kernels in ``decode.py``,
``prefill.py``, ``cache_write.py``).

- **Decode** (``query_len == 1``) is memory-bound: each token reads its whole context once,
  about 4 FLOP per byte with GQA 4. One program per (request, KV head) is far too few to
  fill the chip at small batch, so each context is split over ``num_splits`` programs
  (Flash-Decoding, Dao, Haziza, Massa, Sizov 2023), merged by their log-sum-exp by the last
  split to finish (an atomic counter per (request, KV head)) or, where no counters exist
  yet, by ``decode_reduce_kernel``. The M dimension of its dot products is the GQA group
  padded to 16. Its key tile and warps are those whose single wave of resident programs
  holds the grid (``launch.decode_tile_config``).
- **Prompt chunks** (fresh prompts, chunks after cached context, stray one-token queries)
  are compute-bound: a tile of ``BLOCK_Q`` query tokens x the ``GROUP`` heads of one KV
  head (128 rows) reuses each K/V tile 128 times. Tiles are dealt over the flat token range
  (``num_tokens // BLOCK_Q + num_seqs`` programs), so no program is empty. A short chunk
  after a long context splits its keys over up to ``VARLEN_MAX_SPLITS`` programs, merged
  by ``varlen_reduce_kernel``.
- **Cascade attention** (Juravsky et al., "Hydragen", 2024): when the decodes hold the
  same first blocks (``common_prefix_len``), ``shared_prefix_kernel`` reads those keys once
  for all of them and the decode kernel only the keys after them; the merge takes both
  kernels' partials. Local layers (windows, chunks) keep the plain path.

The varlen kernel alone is correct for every batch; the decode kernel is the fast path for
the leading decodes (a decode token fills only ``GROUP`` of a 128-row prompt tile, and
split-K only pays for decode).

Host reads: no device tensor is read on the host, so every launch can be captured in a
CUDA graph. The decode grid is ``num_decodes * num_splits * Hkv`` programs (the request
slowest), with ``num_splits`` from the decode count, ``Hkv``, ``max_seq_len`` and the SM
count; splits are dealt from the device ``seq_lens``, so a graph captured for
``max_seq_len = max_model_len`` replays correctly for any shorter contexts. The varlen grid
comes from ``query_start_loc_cpu`` and ``seq_lens_cpu`` of the prompt requests. With uniform
grids (whole-step graphs of mixed batches) only ``num_reqs``, ``num_actual_tokens`` and
``max_seq_len`` are read: the decode kernel runs over every request and skips those whose
query is not one token; the varlen kernel takes the requests after the leading decodes
from the device ``prefill_range``, with one key split. Padding requests (context 0, slot
-1) produce zeros; requests with no query token are not touched.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import pdl
from tokenmill.kernels.attention import decode as decode_kernels
from tokenmill.kernels.attention import prefill as prefill_kernels
from tokenmill.kernels.attention.batch_split import BatchSplit, Launches, PagedBatch
from tokenmill.kernels.attention.launch import (
    MAX_SPLITS,
    MERGE_COUNTER_SLOTS,
    MIN_SPLIT_TOKENS,
    VARLEN_MAX_SPLITS,
    decode_tile_config,
    merge_splits_per_load,
    num_decode_splits,
    num_prefix_splits,
    num_varlen_splits,
    varlen_tile_config,
)
from tokenmill.kernels.device import DeviceCounters, num_sms
from tokenmill.kernels.rotary import rotary_half
from tokenmill.math_utils import cdiv, next_power_of_2

# The rotation a decode launch applies itself: (cos | sin table float32 [max_pos,
# rotary_dim], rotary_dim, NeoX halves), with the new key's and value's row strides.
Rope = tuple[int, int, torch.Tensor, int, bool]


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    # NOTE: fp32 inputs would otherwise run through TF32 (10-bit mantissa) on the GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def _rope_args(rope: Rope | None) -> dict:
    """The decode kernel's rotary arguments other than its tensors (zeros without ROPE)."""
    if rope is None:
        return {"stride_kt": 0, "stride_vt": 0, "stride_cos": 0, "ROPE": False, "HALF": 1,
                "NEOX": True}  # fmt: skip
    stride_k, stride_v, cos_sin_cache, rotary_dim, is_neox_style = rope
    return {
        "stride_kt": stride_k, "stride_vt": stride_v, "stride_cos": cos_sin_cache.stride(0),
        "ROPE": True, "HALF": rotary_half(rotary_dim), "NEOX": is_neox_style,
    }  # fmt: skip


# The decode splits' merge counters, one per (decode, KV head) (``device.DeviceCounters``);
# a step planned while a graph is captured before they exist launches the reduction.
_MERGE_COUNTERS = DeviceCounters()


def _split_strides(part_out: torch.Tensor, part_lse: torch.Tensor) -> dict[str, int]:
    """Row and head strides of a split workspace (or of ``out`` standing in for one)."""
    return {
        "stride_pr": part_out.stride(0), "stride_ph": part_out.stride(1),
        "stride_lr": part_lse.stride(0), "stride_lh": part_lse.stride(1),
    }  # fmt: skip


def _operand_strides(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    workspace: tuple[torch.Tensor, torch.Tensor],
) -> dict[str, int]:
    """The strides every attention kernel takes: query rows, block table rows, the cache's
    block/slot/head, and the split workspace's."""
    k_cache = kv_cache[0]
    return {
        "stride_qt": query.stride(0), "stride_bt": batch.block_table.stride(0),
        "stride_cb": k_cache.stride(0), "stride_cs": k_cache.stride(1),
        "stride_ch": k_cache.stride(2), **_split_strides(*workspace),
    }  # fmt: skip


class PagedAttention:
    """The paged-attention launches of one layer shape (see the module docstring).

    Works for any head size (powers of two run unmasked along the head dimension), any
    ``block_size``, GQA groups of any size, sliding windows, chunked local attention, logit
    soft-capping and attention sinks; fp16/bf16 on the GPU, any float dtype in the Triton
    interpreter.

    Args:
        num_heads: query heads.
        head_dim: size of each head.
        scale: softmax scale.
        num_kv_heads: key/value heads (``num_heads`` is a multiple of it).
        sliding_window: a query at position p sees keys at positions > p - window; None:
            every earlier key.
        logits_soft_cap: scores become ``cap * tanh(scores / cap)``; None: no cap.
        attention_chunk_size: a query at position p sees keys from ``p // chunk * chunk``
            on; None: no chunks. Not together with ``sliding_window``.
        sinks: ``[num_heads]`` sink logits joining each row's softmax denominator (any float
            dtype, on the kernels' device); None: no sinks.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        attention_chunk_size: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.attention_chunk_size = attention_chunk_size
        self.sinks = sinks
        # Window or chunk: the kernels take either as their ``window`` (``CHUNKED`` says which).
        self.local_span = sliding_window if sliding_window is not None else attention_chunk_size
        # Layers with equal keys launch the same kernels for the same batch (the sinks
        # tensor is passed at each launch, not kept in the shared arguments).
        self.launch_key = (
            num_heads, num_kv_heads, head_dim, scale, sliding_window, logits_soft_cap,
            attention_chunk_size, sinks is not None,
        )  # fmt: skip

    def set_scale(self, scale: float) -> None:
        """A new softmax scale (an FP8 cache's key scale folded in)."""
        self.scale = scale
        self.launch_key = (
            self.num_heads, self.num_kv_heads, self.head_dim, scale, self.sliding_window,
            self.logits_soft_cap,
        )  # fmt: skip

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: PagedBatch,
        split: BatchSplit,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of every query token over the cache as it is.

        Args:
            query: ``[T, num_heads * head_dim]``, rows may be strided.
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, last
                dimension contiguous.
            batch: the step's layout.
            split: ``batch_split(batch)``, shared by the step's layers.
            out: ``[T, num_heads * head_dim]`` of query's dtype, rows contiguous; a new
                tensor when None.

        Returns:
            ``out``; rows past ``batch.num_actual_tokens`` are unspecified.

        Raises:
            ValueError: layouts the kernels cannot address.
        """
        if query.stride(-1) != 1:
            query = query.contiguous()
        if kv_cache.stride(-1) != 1:
            raise ValueError("kv_cache must be contiguous in its last dimension")
        out = self._output(query, out)
        if split.num_decodes:
            self._decode(out, query, kv_cache, batch, split)
        if split.num_prefills:
            self._varlen(out, query, kv_cache, batch, split)
        return out

    def attend_decode_rotary(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: PagedBatch,
        split: BatchSplit,
        cos_sin_cache: torch.Tensor,
        rotary_dim: int,
        is_neox_style: bool,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotate, write this step's K/V and attend, for a batch of decodes only, in the
        decode kernel's launch: ``query`` and ``key`` arrive unrotated, each token at
        position ``seq_len - 1``.

        Args:
            query: ``[num_reqs, num_heads * head_dim]``, unrotated (left as it is).
            key, value: ``[num_reqs, num_kv_heads * head_dim]``, unrotated.
            kv_cache, batch, split, out: as for ``attend``; a decode-only batch
                (``max_query_len == 1``) without a shared prefix, uniform grids or
                ``reads_step_kv`` (a row would read a slot another row's program writes
                in the same launch); padding rows have slot -1 and context length 0.
            cos_sin_cache: float32 ``[max_pos, rotary_dim]``, ``cos | sin`` per position.
            rotary_dim: dimensions rotated (the first of each head); ``rotary_dim / 2`` a
                power of two.
            is_neox_style: rotate the two halves (else adjacent pairs).

        Raises:
            ValueError: a batch that is not decode-only, or layouts the kernel cannot
                address.
        """
        if (
            batch.max_query_len != 1
            or batch.common_prefix_len
            or batch.uniform_grids
            or batch.reads_step_kv
        ):
            raise ValueError(
                "attend_decode_rotary takes decode-only batches without cascade, uniform "
                "grids or reads of KV written in the step"
            )
        for name, x in (("query", query), ("key", key), ("value", value), ("kv_cache", kv_cache)):
            if x.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension")
        if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(1) != 1:
            raise ValueError("the rotary table must be float32, contiguous along its rows")
        out = self._output(query, out)
        if split.num_decodes:
            new_kv = (key, value, cos_sin_cache, rotary_dim, is_neox_style)
            self._decode(out, query, kv_cache, batch, split, new_kv)
        return out

    def _output(self, query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``out``, checked, or a new ``[T, num_heads * head_dim]`` tensor of query's dtype."""
        width = self.num_heads * self.head_dim
        if out is None:
            return torch.empty(query.shape[0], width, dtype=query.dtype, device=query.device)
        if out.shape != (query.shape[0], width) or out.stride(-1) != 1:
            raise ValueError(f"out must be [{query.shape[0]}, {width}], rows contiguous")
        return out

    def _common_args(self, query: torch.Tensor, kv_cache: torch.Tensor) -> dict:
        group = self.num_heads // self.num_kv_heads
        return {
            "sm_scale": float(self.scale),
            "soft_cap": float(self.logits_soft_cap or 0.0),
            "window": int(self.local_span or 0),
            "GROUP": group,
            "HEAD_DIM": self.head_dim,
            "D_P": _pow2(self.head_dim, 16),
            "BLOCK_SIZE": kv_cache.shape[2],
            "USE_WINDOW": self.local_span is not None,
            "USE_SOFTCAP": self.logits_soft_cap is not None,
            "DOT_PRECISION": _dot_precision(query.dtype),
            "CHUNKED": self.attention_chunk_size is not None,
            "USE_SINKS": self.sinks is not None,
        }

    def _sinks_arg(self, query: torch.Tensor) -> torch.Tensor:
        """The sinks tensor for a launch; without sinks, any tensor of a fixed dtype (not
        read; no other variant compiles)."""
        return self.sinks if self.sinks is not None else query

    def _workspace(
        self, split: BatchSplit, rows: int, num_splits: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Partial outputs ``[rows, H, S, D]`` and log2-sum-exps ``[rows, H, S]`` (fp32) for
        ``rows`` decodes or prompt tokens, shared by all layers of the step (layers run one
        after another on one stream); None for one split, whose kernel writes ``out``
        directly. A decode and a prompt workspace of one shape may be the same tensor: the
        decode reduction has consumed it before the prompt kernel writes it."""
        if num_splits <= 1:
            return None
        key = (rows, self.num_heads, self.head_dim, num_splits, device)
        if key not in split.workspaces:
            shape = (rows, self.num_heads, num_splits)
            split.workspaces[key] = (
                torch.empty(*shape, self.head_dim, dtype=torch.float32, device=device),
                torch.empty(*shape, dtype=torch.float32, device=device),
            )
        return split.workspaces[key]

    def _reduce_args(
        self,
        out: torch.Tensor,
        workspace: tuple[torch.Tensor, torch.Tensor],
        num_splits: int,
        max_splits: int,
    ) -> dict:
        """Arguments of a split reduction (``decode_reduce_kernel``, ``varlen_reduce_kernel``)
        other than its tensors and its first row."""
        return {
            "num_splits": num_splits, "stride_ot": out.stride(0),
            **_split_strides(*workspace),
            "HEAD_DIM": self.head_dim, "D_P": _pow2(self.head_dim, 16),
            "S_P": _pow2(max_splits), "num_warps": 4,
        }  # fmt: skip

    def _decode(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: PagedBatch,
        split: BatchSplit,
        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool] | None = None,
    ) -> None:
        if new_kv is None:
            launch = self._launches("decode", out, query, kv_cache, batch, split)
            # Not read without ROPE: any tensors of a fixed dtype (no other variant compiles).
            key = value = table = query
        else:
            key, value, table, rotary_dim, is_neox_style = new_kv
            launch = self._launches(
                "decode", out, query, kv_cache, batch, split,
                rope=(key.stride(0), value.stride(0), table, rotary_dim, is_neox_style),
            )  # fmt: skip
        part_out, part_lse = launch.workspace or (out, out)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if launch.prefix_grid:
            prefill_kernels.shared_prefix_kernel[launch.prefix_grid](
                part_out, part_lse, query, k_cache, v_cache, batch.block_table,
                batch.query_start_loc, **launch.prefix_kwargs,
            )  # fmt: skip
        decode_kernels.decode_attention_kernel[launch.grid](
            out, part_out, part_lse, query, k_cache, v_cache, batch.block_table,
            batch.seq_lens, batch.query_start_loc, k_new_ptr=key, v_new_ptr=value,
            cos_sin_ptr=table, slot_ptr=batch.slot_mapping, sinks_ptr=self._sinks_arg(query),
            **launch.kwargs,
        )  # fmt: skip
        if launch.reduce_grid:
            decode_kernels.decode_reduce_kernel[launch.reduce_grid](
                out, part_out, part_lse, batch.query_start_loc, **launch.reduce_kwargs
            )

    def _launches(
        self,
        path: str,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: PagedBatch,
        split: BatchSplit,
        rope: Rope | None = None,
    ) -> Launches:
        """``path``'s launches for this step, worked out by its first layer of this shape.

        Every layer of a step with the same shapes launches the same grids with the same
        scalars; working them out takes tens of microseconds of Python per layer, while
        the GPU waits for the launches. ``rope``: a decode launch that rotates and writes the
        new K/V itself (``Rope``)."""
        rope_key = None if rope is None else (rope[0], rope[1], rope[2].stride(0), *rope[3:])
        key = (
            path, self.launch_key, query.dtype, query.stride(0), out.stride(0), kv_cache.shape,
            rope_key,
        )  # fmt: skip
        launch = split.launches.get(key)
        if launch is None:
            if path == "decode":
                launch = self._decode_launches(out, query, kv_cache, batch, split, rope)
            else:
                launch = self._varlen_launches(out, query, kv_cache, batch, split)
            split.launches[key] = launch
        return launch

    def _decode_launches(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: PagedBatch,
        split: BatchSplit,
        rope: Rope | None = None,
    ) -> Launches:
        """The decode path's grids, split counts and kernel arguments for this step."""
        args = self._common_args(query, kv_cache)
        sms = num_sms(query.device)
        # Cascade attention: the decodes' shared prefix is read once by
        # ``shared_prefix_kernel``; the decode kernel reads only the keys after it. Windows
        # and chunks would hide part of the prefix from some requests, so they keep the
        # plain path. (Sinks join the decode kernel's first split, once per row.)
        prefix_len = batch.common_prefix_len
        # (attend_decode_rotary refuses batches with a shared prefix.)
        if self.local_span is not None or split.uniform or rope is not None:
            prefix_len = 0
        prefix_splits = block_q = 0
        pcfg = varlen_tile_config(args["D_P"], query.dtype)
        if prefix_len and split.num_decodes > 1:
            block_q = max(1, pcfg.block_m // _pow2(args["GROUP"]))
            prefix_splits = num_prefix_splits(
                split.num_decodes, block_q, self.num_kv_heads, prefix_len, sms
            )
        else:
            prefix_len = 0
        num_splits = num_decode_splits(
            split.num_decodes, self.num_kv_heads, batch.max_seq_len - prefix_len, sms,
            MAX_SPLITS - prefix_splits,
        )  # fmt: skip
        total_splits = num_splits + prefix_splits
        cfg = decode_tile_config(
            args["D_P"], query.dtype, split.num_decodes * num_splits * self.num_kv_heads,
            sms, split.uniform, rope is not None, _pow2(args["GROUP"], 16), num_splits,
        )  # fmt: skip
        workspace = self._workspace(split, split.num_decodes, total_splits, query.device)
        strides = _operand_strides(query, kv_cache, batch, workspace or (out, out))
        # With one decode split the decode kernel merges the prefix partials itself (the
        # prefix kernel runs first) and no reduction is launched; with several, the last
        # split of each (request, KV head) merges them all, or a reduction does. One
        # kernel variant for every split count: the merging one wherever it can run.
        counters = None
        if split.num_decodes * self.num_kv_heads <= MERGE_COUNTER_SLOTS:
            counters = _MERGE_COUNTERS.get_or_create(query.device, MERGE_COUNTER_SLOTS)
        merge_g = _pow2(args["GROUP"])
        merge_s = merge_splits_per_load(merge_g, args["D_P"]) if counters is not None else 0
        merge_splits = prefix_splits if num_splits == 1 or merge_s else 0
        launch = Launches(
            workspace=workspace,
            grid=(split.num_decodes * num_splits * self.num_kv_heads, 1, 1),
            kwargs={
                "req_offset": 0, "kv_start": prefix_len, "merge_splits": merge_splits,
                "num_splits": num_splits, "stride_ot": out.stride(0),
                "NUM_KV_HEADS": self.num_kv_heads, "GROUP_P": _pow2(args["GROUP"], 16),
                "BLOCK_N": cfg.block_n, "EARLY_LOADS": not batch.reads_step_kv,
                "counter_ptr": counters if counters is not None else out,
                "MERGE_S": merge_s, "MERGE_G": merge_g,
                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **strides, **args,
                **_rope_args(rope), **pdl.launch_options(query.device),
            },  # fmt: skip
        )
        if prefix_len:
            blocks = cdiv(split.num_decodes, block_q)
            launch.prefix_grid = (blocks, self.num_kv_heads, prefix_splits)
            local_args = ("window", "USE_WINDOW", "CHUNKED", "USE_SINKS")
            prefix_args = {k: v for k, v in args.items() if k not in local_args}
            launch.prefix_kwargs = {
                "req_offset": 0, "num_decodes": split.num_decodes, "prefix_len": prefix_len,
                "split_base": num_splits, "num_splits": prefix_splits,
                "GROUP_P": _pow2(args["GROUP"]), "BLOCK_Q": block_q, "BLOCK_N": pcfg.block_n,
                "num_warps": pcfg.num_warps, "num_stages": pcfg.num_stages,
                **strides, **prefix_args,
            }  # fmt: skip
        if num_splits > 1 and not merge_s:
            launch.reduce_grid = (split.num_decodes * self.num_heads,)
            launch.reduce_kwargs = {
                "req_offset": 0, "NUM_HEADS": self.num_heads,
                **self._reduce_args(out, workspace, total_splits, MAX_SPLITS),
                **pdl.launch_options(query.device),
            }  # fmt: skip
        return launch

    def _varlen(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: PagedBatch,
        split: BatchSplit,
    ) -> None:
        launch = self._launches("varlen", out, query, kv_cache, batch, split)
        part_out, part_lse = launch.workspace or (out, out)
        key_limits = batch.last_key_pos
        prefill_range = batch.prefill_range if split.uniform else batch.query_start_loc
        prefill_kernels.varlen_attention_kernel[launch.grid](
            out, part_out, part_lse, query, kv_cache[0], kv_cache[1], batch.block_table,
            batch.seq_lens, batch.query_start_loc, prefill_range,
            sinks_ptr=self._sinks_arg(query),
            last_key_pos_ptr=batch.seq_lens if key_limits is None else key_limits,
            KEY_LIMITS=key_limits is not None, **launch.kwargs,
        )  # fmt: skip
        if launch.reduce_grid:
            prefill_kernels.varlen_reduce_kernel[launch.reduce_grid](
                out, part_out, part_lse, **launch.reduce_kwargs
            )

    def _varlen_launches(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: PagedBatch,
        split: BatchSplit,
    ) -> Launches:
        """The prompt path's grid, key splits and kernel arguments for this step."""
        args = self._common_args(query, kv_cache)
        uniform_tokens = split.prefill_tokens if split.uniform else None
        cfg = varlen_tile_config(args["D_P"], query.dtype, uniform_tokens)
        group_p = _pow2(args["GROUP"])
        block_q = max(1, cfg.block_m // group_p)
        # Uniform grids know no context lengths: one split (measured on Llama-3.1-8B: a
        # 206-token chunk after 512 cached tokens is as fast as with its split keys).
        num_splits = 1 if split.uniform else num_varlen_splits(
            split.prefill_tokens, split.num_prefills, block_q, self.num_kv_heads,
            split.prefill_max_seq_len, num_sms(query.device),
        )  # fmt: skip
        workspace = self._workspace(split, split.prefill_tokens, num_splits, query.device)
        programs = split.prefill_tokens // block_q + split.num_prefills  # see _find_seq
        launch = Launches(
            workspace=workspace,
            grid=(
                (programs * num_splits * self.num_kv_heads, 1, 1)
                if split.uniform else (programs, self.num_kv_heads, num_splits)
            ),
            kwargs={
                "req_offset": 0 if split.uniform else split.num_decodes,
                "num_seqs": split.num_prefills, "UNIFORM": split.uniform,
                "num_splits": num_splits, "stride_ot": out.stride(0),
                **_operand_strides(query, kv_cache, batch, workspace or (out, out)),
                "NUM_KV_HEADS": self.num_kv_heads, "GROUP_P": group_p, "BLOCK_Q": block_q,
                "BLOCK_N": cfg.block_n,
                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **args,
            },  # fmt: skip
        )
        if num_splits > 1:
            launch.reduce_grid = (split.prefill_tokens, self.num_heads)
            launch.reduce_kwargs = {
                "row_offset": split.prefill_start,
                **self._reduce_args(out, workspace, num_splits, VARLEN_MAX_SPLITS),
            }
        return launch


def decode_warm_up_cases(
    num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, max_decodes: int,
    max_context: int, device: torch.device,
) -> list[tuple[int, int]]:  # fmt: skip
    """(decode count, context tokens) pairs whose eager decode steps (no whole-step graph,
    no shared prefix, no rotary in the kernel) launch every variant of the decode kernel
    that such steps of up to ``max_decodes`` requests of up to ``max_context`` tokens
    reach: one per tile (``decode_tile_config``), per whether the keys split (several
    splits pass float32 partial buffers where one split passes the output: another
    argument signature, so another compile), and per whether the splits merge in the kernel
    (``MERGE_S``). The smallest decode count, then the shortest context, of each; sorted.
    ``group``: query heads per KV head."""
    sms = num_sms(device)
    head_dim_p, group_p = _pow2(head_dim, 16), _pow2(group, 16)
    first: dict[tuple, tuple[int, int]] = {}
    for n in range(1, max_decodes + 1):
        in_kernel_merge = n * num_kv_heads <= MERGE_COUNTER_SLOTS
        for splits in range(1, num_decode_splits(n, num_kv_heads, max_context, sms) + 1):
            tile = decode_tile_config(
                head_dim_p, dtype, n * splits * num_kv_heads, sms, False, False, group_p, splits
            )  # fmt: skip
            key = (tile, splits == 1, in_kernel_merge)
            # (splits - 1) * MIN_SPLIT_TOKENS + 1 keys are the fewest that split this far
            first.setdefault(key, (n, (splits - 1) * MIN_SPLIT_TOKENS + 1))
    return sorted(first.values())

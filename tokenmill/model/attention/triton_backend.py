"""Paged attention on CUDA with Triton kernels (``triton_decode.py``, ``triton_kernels.py``;
tile shapes and key-split counts in ``triton_launch.py``).

Kernel structure, and why (H200: 132 SMs, 60 MB L2; ceilings seen through PyTorch on the lent
machines: ~4.3 TB/s device copy, ~790 TFLOP/s dense bf16. Llama-3.1-8B: 32 query heads, 8 KV
heads, head_dim 128):

- **Decode** (``query_len == 1``) is memory-bound: each token reads its whole context once
  (``2 * seq_len * Hkv * D`` elements) for ``4 * seq_len * H * D`` FLOPs, about 4 FLOP per
  byte with GQA 4 against the chip's ~190. One program per (request, KV head) gives only
  ``num_reqs * Hkv`` programs: 8 at batch 1, far too few to keep 132 SMs' loads in flight.
  Flash-Decoding (Dao, Haziza, Massa, Sizov 2023) splits each context over ``num_splits``
  programs, each streaming a contiguous
  run of key tiles, and the last split of each (request, KV head) to finish, found with an
  atomic counter, merges the partials by their log-sum-exp (``decode_reduce_kernel``, a
  second launch, with ``TOKENMILL_DECODE_SPLIT_SELF_MERGE=0``); the extra traffic is
  ``num_reqs * H * num_splits * D * 4`` bytes, negligible beside the KV reads. A captured
  graph plans its splits for the longest context it may see, so at short contexts most
  splits are empty: they write nothing and the merge reads only the others. With enough
  (request, KV head) pairs the split count drops to 1 and the kernel writes the output
  directly. The M dimension of the dot products is the
  GQA group padded to 16 (``tl.dot``'s minimum), so no rows go to absent query tokens.
  Its time is the waves of resident programs it takes, so its key tile and warps are
  those whose single wave holds the grid (``triton_launch.decode_tile_config``).
- **Prompt chunks** (any mix of fresh prompts, chunks after cached context, and stray
  ``query_len == 1`` requests) are compute-bound: a tile of ``BLOCK_Q`` query tokens x the
  ``GROUP`` heads of one KV head (128 rows for head_dim <= 128) reuses each K/V tile 128
  times. Tiles are handed out over the flat token range (``num_tokens // BLOCK_Q +
  num_seqs`` programs, sequence found by binary search on ``query_start_loc``) so a batch of
  one long prompt and many short ones launches no empty programs. Causal/window masks cost
  elementwise work only on the diagonal and window-edge tiles. A short chunk after a long
  context (a new conversation turn, a suffix after a cached prefix) makes few programs that
  each walk the whole context: its keys are then split over up to ``VARLEN_MAX_SPLITS``
  programs and merged by ``varlen_reduce_kernel``, as flash-decoding does for decodes.

- **Cascade attention** (Juravsky et al., "Hydragen", 2024): when the model runner finds
  that the decode requests hold the same first blocks (``metadata.common_prefix_len``, a
  prompt prefix found by prefix caching), ``shared_prefix_kernel`` reads those keys once
  for all of them, ``BLOCK_Q`` decode tokens x ``GROUP`` heads per ``tl.dot`` as in the
  varlen kernel, and the decode kernel reads only each request's keys after the prefix;
  the decode kernel's merge (or the reduction) takes both kernels' partials by their
  log-sum-exp. 64 requests after a shared 2,000-token prefix otherwise read its keys 64
  times per step (through L2 at best). So a cascade layer costs one launch more than a
  plain one.
  Layers with a sliding window keep the plain path.

The varlen kernel alone is correct for every batch; the decode kernel is the fast path for the
leading decode requests (the model runner puts them first and says how many in
``metadata.num_decodes``). Two kernels rather than one unified kernel because a decode token
in a 128-row query tile fills only ``GROUP`` of its rows (4 of 128 for Llama-3.1-8B), holding
registers and shared memory for the rest and so cutting occupancy, and split-K only pays for
decode.

Host-side reads (no device tensor is ever read on the host, so every launch is CUDA-graph
capturable):

- ``reshape_and_cache``: ``num_actual_tokens`` (grid).
- decode path: ``num_reqs``, ``num_decodes`` (else ``max_query_len``, and
  ``query_start_loc_cpu`` when a batch mixes decodes and prompts), ``max_seq_len`` (split
  count only) and ``common_prefix_len`` (cascade: grids and split counts; such steps are
  never captured whole). Device: ``query_start_loc``, ``seq_lens``, ``block_table``. The
  grid is ``(num_decodes * num_splits * Hkv,)`` programs, the request slowest, with
  ``num_splits`` from ``(num_decodes, Hkv, max_seq_len, SM count)``; splits are dealt from
  the device ``seq_lens``, so a captured graph replays correctly for any lengths that fit
  the block table, whatever its split count.
  Capture with ``max_seq_len = max_model_len`` so that long contexts get enough splits.
  Padding requests (``seq_len == 0``, slot -1) produce zeros; requests with ``query_len == 0``
  are not touched.
- varlen path: ``query_start_loc_cpu[num_decodes]`` and ``[num_reqs]`` (token count, grid),
  and ``seq_lens_cpu`` of the prompt requests (split count).
- uniform grids (``metadata.uniform_grids``, whole-step graphs of mixed batches):
  ``num_reqs``, ``num_actual_tokens`` and ``max_seq_len`` only. The decode kernel runs over
  every request and skips those whose query is not one token; the varlen kernel takes the
  requests after the leading decodes from the device ``prefill_range``, with one key split
  and ``num_actual_tokens // BLOCK_Q + UNIFORM_MAX_PREFILLS`` programs per KV head, and
  skips one-token queries. (Over every request, its early-exiting programs cost more than
  the graph saves: they hold the prompt kernel's shared memory, so they run in waves.)
"""

from __future__ import annotations

import torch

from tokenmill import envs
from tokenmill.kernels import pdl
from tokenmill.kernels.attention import decode as triton_decode
from tokenmill.kernels.attention import prefill as kernels
from tokenmill.kernels.attention.batch_split import Launches, StepPlan, step_plan
from tokenmill.kernels.attention.cache_write import reshape_and_cache
from tokenmill.kernels.attention.launch import (  # noqa: F401 (patched and read here)
    DEFAULT_NUM_SMS,
    MAX_SPLITS,
    MERGE_COUNTER_SLOTS,
    MIN_SPLIT_TOKENS,
    UNIFORM_MAX_PREFILLS,
    VARLEN_MAX_SPLITS,
    TileConfig,
    decode_tile_config,
    device_num_sms,
    merge_splits_per_load,
    num_decode_splits,
    num_prefix_splits,
    num_varlen_splits,
    varlen_tile_config,
)
from tokenmill.kernels.device import DeviceCounters
from tokenmill.kernels.rotary import rotary_half
from tokenmill.math_utils import cdiv, next_power_of_2
from tokenmill.model.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    DecodeRotary,
)


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    # NOTE: fp32 inputs would otherwise run through TF32 (10-bit mantissa) on the GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def _rope_args(rope: tuple[int, int, DecodeRotary] | None) -> dict:
    """The decode kernel's rotary arguments other than its tensors (zeros without ROPE)."""
    if rope is None:
        return {"stride_kt": 0, "stride_vt": 0, "stride_cos": 0, "ROPE": False, "HALF": 1,
                "NEOX": True}  # fmt: skip
    stride_k, stride_v, rotary = rope
    half = rotary_half(rotary.rotary_dim)
    return {
        "stride_kt": stride_k, "stride_vt": stride_v,
        "stride_cos": rotary.cos_sin_cache.stride(0), "ROPE": True, "HALF": half,
        "NEOX": rotary.is_neox_style,
    }  # fmt: skip


# The decode splits' merge counters, one per (decode, KV head) (``device_counters.py``);
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
    metadata: AttentionMetadata,
    workspace: tuple[torch.Tensor, torch.Tensor],
) -> dict[str, int]:
    """The strides every attention kernel takes: query rows, block table rows, the cache's
    block/slot/head, and the split workspace's."""
    k_cache = kv_cache[0]
    return {
        "stride_qt": query.stride(0), "stride_bt": metadata.block_table.stride(0),
        "stride_cb": k_cache.stride(0), "stride_cs": k_cache.stride(1),
        "stride_ch": k_cache.stride(2), **_split_strides(*workspace),
    }  # fmt: skip


class TritonAttentionImpl(AttentionImpl):
    """Paged attention with Triton kernels (see the module docstring for the structure).

    Same arguments and semantics as ``AttentionImpl``. Works for any head size (powers of two
    run unmasked along the head dimension), any ``block_size``, GQA groups of any size,
    sliding windows and logit soft-capping; fp16/bf16 on the GPU, any float dtype in the
    Triton interpreter.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Layers with equal keys launch the same decode kernels for the same batch.
        self.launch_key = (
            self.num_heads, self.num_kv_heads, self.head_dim, self.scale,
            self.sliding_window, self.logits_soft_cap,
        )  # fmt: skip

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
    ) -> None:
        reshape_and_cache(key, value, kv_cache, slot_mapping, num_tokens)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See ``AttentionImpl.attend``; ``out`` must be contiguous in its last dimension."""
        if query.stride(-1) != 1:
            query = query.contiguous()
        if kv_cache.stride(-1) != 1:
            raise ValueError("kv_cache must be contiguous in its last dimension")
        out = self._output(query, out)
        plan = step_plan(metadata)
        if plan.num_decodes:
            self._decode(out, query, kv_cache, metadata, plan)
        if plan.num_prefills:
            self._varlen(out, query, kv_cache, metadata, plan)
        return out

    def _output(self, query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``out``, checked, or a new ``[T, num_heads * head_dim]`` tensor of query's dtype."""
        width = self.num_heads * self.head_dim
        if out is None:
            return torch.empty(query.shape[0], width, dtype=query.dtype, device=query.device)
        if out.shape != (query.shape[0], width) or out.stride(-1) != 1:
            raise ValueError(f"out must be [{query.shape[0]}, {width}], rows contiguous")
        return out

    def attend_decode_rotary(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rotary: DecodeRotary,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotate, write this step's K/V and attend, for a batch of decodes only, in the
        decode kernel's launch (no separate rotary/KV-write kernel): ``query`` and ``key``
        arrive unrotated, each token at position ``seq_len - 1``.

        Args:
            query: ``[num_reqs, num_heads * head_dim]``, unrotated (left as it is).
            key, value: ``[num_reqs, num_kv_heads * head_dim]``, unrotated.
            kv_cache, out: as for ``attend``.
            metadata: a decode-only batch (``max_query_len == 1``) without a shared prefix,
                uniform grids or ``reads_step_kv`` (a row would read a slot another row's
                program writes in the same launch); padding rows have slot -1 and context
                length 0.
            rotary: the rotary table and layout.

        Raises:
            ValueError: a batch that is not decode-only, or layouts the kernel cannot
                address.
        """
        if (
            metadata.max_query_len != 1
            or metadata.common_prefix_len
            or metadata.uniform_grids
            or metadata.reads_step_kv
        ):
            raise ValueError(
                "attend_decode_rotary takes decode-only batches without cascade, uniform "
                "grids or reads of KV written in the step"
            )
        for name, x in (("query", query), ("key", key), ("value", value), ("kv_cache", kv_cache)):
            if x.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension")
        if rotary.cos_sin_cache.dtype != torch.float32 or rotary.cos_sin_cache.stride(1) != 1:
            raise ValueError("the rotary table must be float32, contiguous along its rows")
        out = self._output(query, out)
        plan = step_plan(metadata)
        if plan.num_decodes:
            self._decode(out, query, kv_cache, metadata, plan, (key, value, rotary))
        return out

    def _common_args(self, query: torch.Tensor, kv_cache: torch.Tensor) -> dict:
        group = self.num_heads // self.num_kv_heads
        return {
            "sm_scale": float(self.scale),
            "soft_cap": float(self.logits_soft_cap or 0.0),
            "window": int(self.sliding_window or 0),
            "GROUP": group,
            "HEAD_DIM": self.head_dim,
            "D_P": _pow2(self.head_dim, 16),
            "BLOCK_SIZE": kv_cache.shape[2],
            "USE_WINDOW": self.sliding_window is not None,
            "USE_SOFTCAP": self.logits_soft_cap is not None,
            "DOT_PRECISION": _dot_precision(query.dtype),
        }

    def _workspace(
        self, plan: StepPlan, rows: int, num_splits: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Partial outputs ``[rows, H, S, D]`` and log2-sum-exps ``[rows, H, S]`` (fp32) for
        ``rows`` decodes or prompt tokens, shared by all layers of the step (layers run one
        after another on one stream); None for one split, whose kernel writes ``out``
        directly. A decode and a prompt workspace of one shape may be the same tensor: the
        decode reduction has consumed it before the prompt kernel writes it."""
        if num_splits <= 1:
            return None
        key = (rows, self.num_heads, self.head_dim, num_splits, device)
        if key not in plan.workspaces:
            shape = (rows, self.num_heads, num_splits)
            plan.workspaces[key] = (
                torch.empty(*shape, self.head_dim, dtype=torch.float32, device=device),
                torch.empty(*shape, dtype=torch.float32, device=device),
            )
        return plan.workspaces[key]

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
        metadata: AttentionMetadata,
        plan: StepPlan,
        new_kv: tuple[torch.Tensor, torch.Tensor, DecodeRotary] | None = None,
    ) -> None:
        if new_kv is None:
            launch = self._launches("decode", out, query, kv_cache, metadata, plan)
            # Not read without ROPE: any tensors of a fixed dtype (no other variant compiles).
            key = value = table = query
        else:
            key, value, rotary = new_kv
            table = rotary.cos_sin_cache
            launch = self._launches(
                "decode", out, query, kv_cache, metadata, plan,
                rope=(key.stride(0), value.stride(0), rotary),
            )  # fmt: skip
        part_out, part_lse = launch.workspace or (out, out)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if launch.prefix_grid:
            kernels.shared_prefix_kernel[launch.prefix_grid](
                part_out, part_lse, query, k_cache, v_cache, metadata.block_table,
                metadata.query_start_loc, **launch.prefix_kwargs,
            )  # fmt: skip
        triton_decode.decode_attention_kernel[launch.grid](
            out, part_out, part_lse, query, k_cache, v_cache, metadata.block_table,
            metadata.seq_lens, metadata.query_start_loc, k_new_ptr=key, v_new_ptr=value,
            cos_sin_ptr=table, slot_ptr=metadata.slot_mapping, **launch.kwargs,
        )  # fmt: skip
        if launch.reduce_grid:
            triton_decode.decode_reduce_kernel[launch.reduce_grid](
                out, part_out, part_lse, metadata.query_start_loc, **launch.reduce_kwargs
            )

    def _launches(
        self,
        path: str,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: StepPlan,
        rope: tuple[int, int, DecodeRotary] | None = None,
    ) -> Launches:
        """``path``'s launches for this step, worked out by its first layer of this shape.

        Every layer of a step with the same shapes launches the same grids with the same
        scalars; working them out takes tens of microseconds of Python per layer, while
        the GPU waits for the launches. ``rope``: (key row stride, value row stride, the
        rotary layout) of a decode launch that rotates and writes the new K/V itself."""
        rope_key = None if rope is None else (rope[0], rope[1], rope[2].layout_key())
        key = (
            path, self.launch_key, query.dtype, query.stride(0), out.stride(0), kv_cache.shape,
            rope_key,
        )  # fmt: skip
        launch = plan.launches.get(key)
        if launch is None:
            if path == "decode":
                launch = self._decode_launches(out, query, kv_cache, metadata, plan, rope)
            else:
                launch = self._varlen_launches(out, query, kv_cache, metadata, plan)
            plan.launches[key] = launch
        return launch

    def _decode_launches(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: StepPlan,
        rope: tuple[int, int, DecodeRotary] | None = None,
    ) -> Launches:
        """The decode path's grids, split counts and kernel arguments for this step."""
        args = self._common_args(query, kv_cache)
        num_sms = device_num_sms(query.device)
        # Cascade attention: the decodes' shared prefix is read once by
        # ``shared_prefix_kernel``; the decode kernel reads only the keys after it. Windows
        # would hide part of the prefix from some requests, so they keep the plain path.
        prefix_len = metadata.common_prefix_len
        # (attend_decode_rotary refuses batches with a shared prefix.)
        if self.sliding_window is not None or plan.uniform or rope is not None:
            prefix_len = 0
        prefix_splits = block_q = 0
        pcfg = varlen_tile_config(args["D_P"], query.dtype)
        if prefix_len and plan.num_decodes > 1:
            block_q = max(1, pcfg.block_m // _pow2(args["GROUP"]))
            prefix_splits = num_prefix_splits(
                plan.num_decodes, block_q, self.num_kv_heads, prefix_len, num_sms
            )
        else:
            prefix_len = 0
        num_splits = num_decode_splits(
            plan.num_decodes, self.num_kv_heads, metadata.max_seq_len - prefix_len, num_sms,
            MAX_SPLITS - prefix_splits,
        )  # fmt: skip
        total_splits = num_splits + prefix_splits
        cfg = decode_tile_config(
            args["D_P"], query.dtype, plan.num_decodes * num_splits * self.num_kv_heads,
            num_sms, plan.uniform, rope is not None, _pow2(args["GROUP"], 16), num_splits,
        )  # fmt: skip
        workspace = self._workspace(plan, plan.num_decodes, total_splits, query.device)
        strides = _operand_strides(query, kv_cache, metadata, workspace or (out, out))
        # With one decode split the decode kernel merges the prefix partials itself (the
        # prefix kernel runs first) and no reduction is launched; with several, the last
        # split of each (request, KV head) merges them all, or a reduction does. One
        # kernel variant for every split count: the merging one wherever it can run.
        counters = None
        if (
            plan.num_decodes * self.num_kv_heads <= MERGE_COUNTER_SLOTS
            and envs.decode_split_self_merge()
        ):
            counters = _MERGE_COUNTERS.get_or_create(query.device, MERGE_COUNTER_SLOTS)
        merge_g = _pow2(args["GROUP"])
        merge_s = merge_splits_per_load(merge_g, args["D_P"]) if counters is not None else 0
        merge_splits = prefix_splits if num_splits == 1 or merge_s else 0
        launch = Launches(
            workspace=workspace,
            grid=(plan.num_decodes * num_splits * self.num_kv_heads, 1, 1),
            kwargs={
                "req_offset": 0, "kv_start": prefix_len, "merge_splits": merge_splits,
                "num_splits": num_splits, "stride_ot": out.stride(0),
                "NUM_KV_HEADS": self.num_kv_heads, "GROUP_P": _pow2(args["GROUP"], 16),
                "BLOCK_N": cfg.block_n, "EARLY_LOADS": not metadata.reads_step_kv,
                "counter_ptr": counters if counters is not None else out,
                "MERGE_S": merge_s, "MERGE_G": merge_g,
                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **strides, **args,
                **_rope_args(rope), **pdl.launch_options(query.device),
            },  # fmt: skip
        )
        if prefix_len:
            launch.prefix_grid = (cdiv(plan.num_decodes, block_q), self.num_kv_heads, prefix_splits)
            prefix_args = {k: v for k, v in args.items() if k not in ("window", "USE_WINDOW")}
            launch.prefix_kwargs = {
                "req_offset": 0, "num_decodes": plan.num_decodes, "prefix_len": prefix_len,
                "split_base": num_splits, "num_splits": prefix_splits,
                "GROUP_P": _pow2(args["GROUP"]), "BLOCK_Q": block_q, "BLOCK_N": pcfg.block_n,
                "num_warps": pcfg.num_warps, "num_stages": pcfg.num_stages,
                **strides, **prefix_args,
            }  # fmt: skip
        if num_splits > 1 and not merge_s:
            launch.reduce_grid = (plan.num_decodes * self.num_heads,)
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
        metadata: AttentionMetadata,
        plan: StepPlan,
    ) -> None:
        launch = self._launches("varlen", out, query, kv_cache, metadata, plan)
        part_out, part_lse = launch.workspace or (out, out)
        prefill_range = metadata.prefill_range if plan.uniform else metadata.query_start_loc
        kernels.varlen_attention_kernel[launch.grid](
            out, part_out, part_lse, query, kv_cache[0], kv_cache[1], metadata.block_table,
            metadata.seq_lens, metadata.query_start_loc, prefill_range, **launch.kwargs,
        )  # fmt: skip
        if launch.reduce_grid:
            kernels.varlen_reduce_kernel[launch.reduce_grid](
                out, part_out, part_lse, **launch.reduce_kwargs
            )

    def _varlen_launches(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: StepPlan,
    ) -> Launches:
        """The prompt path's grid, key splits and kernel arguments for this step."""
        args = self._common_args(query, kv_cache)
        uniform_tokens = plan.prefill_tokens if plan.uniform else None
        cfg = varlen_tile_config(args["D_P"], query.dtype, uniform_tokens)
        group_p = _pow2(args["GROUP"])
        block_q = max(1, cfg.block_m // group_p)
        # Uniform grids know no context lengths: one split (measured on Llama-3.1-8B: a
        # 206-token chunk after 512 cached tokens is as fast as with its split keys).
        num_splits = 1 if plan.uniform else num_varlen_splits(
            plan.prefill_tokens, plan.num_prefills, block_q, self.num_kv_heads,
            plan.prefill_max_seq_len, device_num_sms(query.device),
        )  # fmt: skip
        workspace = self._workspace(plan, plan.prefill_tokens, num_splits, query.device)
        programs = plan.prefill_tokens // block_q + plan.num_prefills  # see _find_seq
        launch = Launches(
            workspace=workspace,
            grid=(
                (programs * num_splits * self.num_kv_heads, 1, 1)
                if plan.uniform else (programs, self.num_kv_heads, num_splits)
            ),
            kwargs={
                "req_offset": 0 if plan.uniform else plan.num_decodes,
                "num_seqs": plan.num_prefills, "UNIFORM": plan.uniform,
                "num_splits": num_splits, "stride_ot": out.stride(0),
                **_operand_strides(query, kv_cache, metadata, workspace or (out, out)),
                "NUM_KV_HEADS": self.num_kv_heads, "GROUP_P": group_p, "BLOCK_Q": block_q,
                "BLOCK_N": cfg.block_n,
                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **args,
            },  # fmt: skip
        )
        if num_splits > 1:
            launch.reduce_grid = (plan.prefill_tokens, self.num_heads)
            launch.reduce_kwargs = {
                "row_offset": plan.prefill_start,
                **self._reduce_args(out, workspace, num_splits, VARLEN_MAX_SPLITS),
            }
        return launch


class TritonAttentionBackend(AttentionBackend):
    """Triton paged-attention kernels for CUDA (also run by the Triton interpreter)."""

    name = "triton"
    supports_cascade = True
    supports_uniform_grids = True
    uniform_max_prefills = UNIFORM_MAX_PREFILLS

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def decode_warm_up_sizes(
        num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_decodes: int,
        device: torch.device,
    ) -> list[int]:  # fmt: skip
        """The smallest decode count for each decode tile (``decode_tile_config``) that a
        step of 1-token contexts (one key split) launches."""
        num_sms = device_num_sms(device)
        first: dict[TileConfig, int] = {}
        for n in range(1, max_decodes + 1):
            tile = decode_tile_config(_pow2(head_dim, 16), dtype, n * num_kv_heads, num_sms)
            first.setdefault(tile, n)
        return sorted(first.values())

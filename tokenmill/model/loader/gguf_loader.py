"""Read tensors from a GGUF file (llama.cpp's format), dequantized to float32.

Tensor names are mapped from llama.cpp's (``blk.0.attn_q.weight``) to Hugging Face's
(``model.layers.0.self_attn.q_proj.weight``) with the ``gguf`` package's own name table,
restricted to the names the model expects. llama.cpp's converter permutes the rows of Q and
K for Llama-architecture files (so its GPT-J-style RoPE matches); that permutation is undone
here so the Hugging Face (NeoX-style) layout comes back. For Gemma files the converter stores
RMSNorm weights as ``1 + w`` (llama.cpp multiplies by the weight as is); 1 is subtracted here,
since Gemma models apply ``(1 + w)`` to the Hugging Face weight ``w``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from tokenmill.gguf_config import GGML_MXFP4, gguf_experts_are_mxfp4, open_gguf
from tokenmill.kernels.quant.gguf_blocks import BLOCK_TYPES
from tokenmill.load_errors import ModelLoadError
from tokenmill.model.layers.quantization.tensors import GGUFTensor

logger = logging.getLogger(__name__)

# llama.cpp architectures whose converter permutes Q/K rows (not llama4: Llama 4 rotates
# adjacent pairs, as llama.cpp's "normal" RoPE does, so its converter keeps the rows).
PERMUTED_QK_ARCHS = ("llama", "mistral")
# llama.cpp architectures whose converter adds 1 to every RMSNorm weight.
NORM_PLUS_ONE_ARCHS = ("gemma", "gemma2", "gemma3")


def _arch_enum(arch: str):
    import gguf

    for enum, name in gguf.MODEL_ARCH_NAMES.items():
        if name == arch:
            return enum
    raise ModelLoadError(f"the gguf package does not know architecture {arch!r}")


# An HF per-expert name: "<prefix>.experts.<e>.<leaf>.weight".
EXPERT_NAME = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<leaf>\w+)\.weight$")


def _tensor_items(t, template: str, keep_quantized: bool, path: str, shapes_only: bool):
    """The experts of a stacked ``[E, rows, cols]`` GGUF tensor, one HF name each."""
    quantized = keep_quantized and int(t.tensor_type) in BLOCK_TYPES
    if quantized:
        data = np.array(t.data)
        shape = tuple(int(d) for d in reversed(t.shape))
        whole = GGUFTensor(torch.from_numpy(data), int(t.tensor_type), shape)
        for e in range(shape[0]):
            yield template.format(e=e), whole[e]
        return
    data = _dequantize(t, path, shapes_only)
    tensor = torch.from_numpy(data if shapes_only else np.array(data, copy=True))
    for e in range(tensor.shape[0]):
        yield template.format(e=e), tensor[e]


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`` on Q/K rows.

    Args:
        w: ``[n_head * head_dim, ...]`` (weight or bias) in llama.cpp's row order.
        n_head: heads in this projection (KV heads for K).

    Raises:
        ValueError: the rows are not a whole number of heads of even size.
    """
    shape = w.shape
    if shape[0] % (2 * n_head):
        raise ValueError(f"{shape[0]} rows are not {n_head} heads of an even size")
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


# HF names the gguf package's table spells differently (llama.cpp's converter renames them).
GGUF_LOOKUP_ALIASES = {"e_score_correction_bias": "e_score_correction.bias"}


def merge_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """DeepSeek's ``kv_b_proj`` weight ``[H * (nope + v), R]`` from llama.cpp's split
    ``attn_k_b`` (``[H, R, nope]``, transposed for the absorbed decode) and ``attn_v_b``
    (``[H, v, R]``), as current converters write MLA layers."""
    rank = v_b.shape[2]
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, rank)


def _dequantize(t, path: str, shapes_only: bool = False) -> np.ndarray:
    """``t``'s values as float32; with ``shapes_only`` zeros of its shape (nothing is read:
    a dry run of a load)."""
    import gguf

    if shapes_only:
        # GGUF lists dimensions inner first; zeros are allocated lazily, never touched.
        return np.zeros(tuple(int(d) for d in reversed(t.shape)), dtype=np.float32)
    try:
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot dequantize tensor {t.name!r}: {e}") from e


def _in_layers(gguf_name: str, layers: range) -> bool:
    """Whether a tensor belongs to one of ``layers`` or to no layer (``blk.N.`` names)."""
    if not gguf_name.startswith("blk."):
        return True
    return int(gguf_name.split(".", 2)[1]) in layers


def iterate_gguf(
    path: str,
    hf_names: Iterable[str],
    num_heads: int,
    num_kv_heads: int,
    keep_quantized: bool = False,
    layers: range | None = None,
    shapes_only: bool = False,
) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the GGUF file: float32, or with
    ``keep_quantized`` a ``GGUFTensor`` of the file's blocks for quantized types.

    Args:
        path: the ``.gguf`` file.
        hf_names: the Hugging Face checkpoint names the model expects (used to invert
            llama.cpp's naming).
        num_heads, num_kv_heads: to undo the Q/K row permutation.
        keep_quantized: keep quantized tensors in their blocks (rows are permuted as
            blocks: a row of blocks is one output feature).
        layers: the layers (llama.cpp's blocks) to read; the others' tensors are skipped
            undequantized (a pipeline stage). None: all.
        shapes_only: zeros of each tensor's shape instead of its values, from the tensor
            infos (a dry run of a load; blocks kept by ``keep_quantized`` are still read).

    Raises:
        ModelLoadError: unreadable file, a tensor with no known Hugging Face name, or one of
            a layer past the file's block count.
    """
    reader = open_gguf(path)
    arch = str(reader.fields["general.architecture"].contents())
    if arch == "gpt-oss":  # stacked experts split by gate/up, MXFP4 in ggml's blocks
        from tokenmill.model.loader import gguf_gpt_oss

        mxfp4 = gguf_experts_are_mxfp4({t.name: int(t.tensor_type) for t in reader.tensors})
        names, fused = gguf_gpt_oss.lookup_names(hf_names)
        items = _read_tensors(
            reader, arch, path, names, num_heads, num_kv_heads, keep_quantized, layers,
            shapes_only, raw_types={GGML_MXFP4} if mxfp4 else set(), extra_names=fused,
        )  # fmt: skip
        yield from gguf_gpt_oss.checkpoint_tensors(items, mxfp4)
        return
    yield from _read_tensors(reader, arch, path, hf_names, num_heads, num_kv_heads,
                             keep_quantized, layers, shapes_only)  # fmt: skip


def _read_tensors(
    reader, arch: str, path: str, hf_names: Iterable[str], num_heads: int, num_kv_heads: int,
    keep_quantized: bool, layers: range | None, shapes_only: bool,
    raw_types: set[int] = frozenset(),  # type: ignore[assignment]
    extra_names: dict[str, str] | None = None,
) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:  # fmt: skip
    """``iterate_gguf`` over an open file; tensors of a type in ``raw_types`` come as their
    blocks (``GGUFTensor``) whatever ``keep_quantized`` says; ``extra_names`` maps file
    names the gguf package's tables lack to checkpoint names."""
    import gguf

    num_blocks = int(reader.fields[f"{arch}.block_count"].contents())
    name_map = gguf.get_tensor_name_map(_arch_enum(arch), num_blocks)
    to_hf: dict[str, str] = dict(extra_names or {})
    experts: dict[str, str] = {}  # stacked experts tensor -> HF name with "{e}" for the expert
    # llama.cpp's split attn_k_b / attn_v_b -> (HF kv_b_proj name, which half); merged once
    # both halves are read (dequantized: the key half is stored transposed).
    kv_b_parts: dict[str, tuple[str, str]] = {}
    kv_b_read: dict[str, dict[str, np.ndarray]] = {}
    for hf_name in hf_names:
        match = EXPERT_NAME.match(hf_name)
        if match:
            stacked = f"{match['prefix']}.experts.{match['leaf']}.weight"
            gguf_name = name_map.get_name(stacked, try_suffixes=(".weight",))
            if gguf_name is not None:
                experts[gguf_name] = f"{match['prefix']}.experts.{{e}}.{match['leaf']}.weight"
            continue
        lookup = hf_name
        for hf_part, table_part in GGUF_LOOKUP_ALIASES.items():
            lookup = lookup.replace(hf_part, table_part)
        gguf_name = name_map.get_name(lookup, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            to_hf[gguf_name] = hf_name
        if hf_name.endswith(".kv_b_proj.weight"):
            for part in ("k_b_proj", "v_b_proj"):
                split = name_map.get_name(hf_name.replace("kv_b_proj", part), (".weight",))
                if split is not None:
                    kv_b_parts[split] = (hf_name, part)
    permute = arch in PERMUTED_QK_ARCHS
    norm_plus_one = arch in NORM_PLUS_ONE_ARCHS
    # quantized types without a kernel here (IQ*, TQ*): type -> [tensors, file bytes, elements]
    unkept: dict[str, list[int]] = {}
    for t in reader.tensors:
        if not _in_layers(t.name, range(num_blocks)):
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} belongs to no layer: the file's "
                f"{arch}.block_count is {num_blocks}"
            )
        if layers is not None and not _in_layers(t.name, layers):
            continue  # another pipeline stage's layer
        if t.name in experts:  # [E, rows, ...]: one tensor per expert, as HF names them
            yield from _tensor_items(t, experts[t.name], keep_quantized, path, shapes_only)
            continue
        if t.name in kv_b_parts:
            hf_name, part = kv_b_parts[t.name]
            halves = kv_b_read.setdefault(hf_name, {})
            halves[part] = _dequantize(t, path, shapes_only)
            if len(halves) == 2:
                del kv_b_read[hf_name]
                yield hf_name, torch.from_numpy(merge_kv_b(halves["k_b_proj"], halves["v_b_proj"]))
            continue
        hf_name = to_hf.get(t.name)
        if hf_name is None:
            if t.name in ("rope_freqs.weight",):  # RoPE factors (in rope_scaling)
                continue
            raise ModelLoadError(f"{path}: tensor {t.name!r} has no Hugging Face equivalent")
        quantized = (keep_quantized and int(t.tensor_type) in BLOCK_TYPES
                     or int(t.tensor_type) in raw_types)  # fmt: skip
        block = gguf.GGML_QUANT_SIZES[t.tensor_type][0]
        if keep_quantized and not quantized and not shapes_only and block > 1:
            seen = unkept.setdefault(t.tensor_type.name, [0, 0, 0])
            seen[0] += 1
            seen[1] += int(t.n_bytes)
            seen[2] += int(t.n_elements)
        if quantized:
            data = np.asarray(t.data)
        else:
            data = _dequantize(t, path, shapes_only)
            if hf_name.endswith("shared_expert_gate.weight") and data.ndim == 1:
                data = data[None, :]  # llama.cpp stores this [1, H] gate as a vector
        if permute and (".q_proj." in hf_name or ".k_proj." in hf_name):
            try:
                data = unpermute_qk(data, num_heads if ".q_proj." in hf_name else num_kv_heads)
            except ValueError as e:
                raise ModelLoadError(f"{path}: tensor {t.name!r}: {e}") from None
        elif norm_plus_one and hf_name.endswith("norm.weight"):
            data = data - 1.0
        if not data.flags.writeable or not data.flags.c_contiguous:
            data = np.array(data, copy=True)  # an mmap view of an unquantized tensor
        if quantized:
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions inner first
            yield hf_name, GGUFTensor(torch.from_numpy(data), int(t.tensor_type), shape)
        else:
            yield hf_name, torch.from_numpy(data)
    for name, (count, file_bytes, elements) in unkept.items():
        logger.warning(
            "%s: %d tensor(s) of type %s are not kept in their blocks (no kernel for it): "
            "dequantized, %.1f MiB of float32 for %.1f MiB in the file", path, count, name,
            elements * 4 / 2**20, file_bytes / 2**20,
        )  # fmt: skip

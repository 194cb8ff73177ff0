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

import re
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from tokenmill.hf_config import ModelLoadError
from tokenmill.kernels.quant.gguf_blocks import BLOCK_TYPES
from tokenmill.model.layers.quantization.tensors import GGUFTensor

# llama.cpp architectures whose converter permutes Q/K rows.
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


def _tensor_items(t, template: str, keep_quantized: bool, path: str):
    """The experts of a stacked ``[E, rows, cols]`` GGUF tensor, one HF name each."""
    import gguf

    quantized = keep_quantized and int(t.tensor_type) in BLOCK_TYPES
    if quantized:
        data = np.array(t.data)
        shape = tuple(int(d) for d in reversed(t.shape))
        whole = GGUFTensor(torch.from_numpy(data), int(t.tensor_type), shape)
        for e in range(shape[0]):
            yield template.format(e=e), whole[e]
        return
    try:
        data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    except Exception as err:
        raise ModelLoadError(f"{path}: cannot dequantize tensor {t.name!r}: {err}") from err
    tensor = torch.from_numpy(np.array(data, copy=True))
    for e in range(tensor.shape[0]):
        yield template.format(e=e), tensor[e]


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`` on Q/K rows.

    Args:
        w: ``[n_head * head_dim, ...]`` (weight or bias) in llama.cpp's row order.
        n_head: heads in this projection (KV heads for K).
    """
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def iterate_gguf(
    path: str,
    hf_names: Iterable[str],
    num_heads: int,
    num_kv_heads: int,
    keep_quantized: bool = False,
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

    Raises:
        ModelLoadError: unreadable file, or a tensor with no known Hugging Face name.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    arch = str(reader.fields["general.architecture"].contents())
    num_blocks = int(reader.fields[f"{arch}.block_count"].contents())
    name_map = gguf.get_tensor_name_map(_arch_enum(arch), num_blocks)
    to_hf: dict[str, str] = {}
    experts: dict[str, str] = {}  # stacked experts tensor -> HF name with "{e}" for the expert
    for hf_name in hf_names:
        match = EXPERT_NAME.match(hf_name)
        if match:
            stacked = f"{match['prefix']}.experts.{match['leaf']}.weight"
            gguf_name = name_map.get_name(stacked, try_suffixes=(".weight",))
            if gguf_name is not None:
                experts[gguf_name] = f"{match['prefix']}.experts.{{e}}.{match['leaf']}.weight"
            continue
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            to_hf[gguf_name] = hf_name
    permute = arch in PERMUTED_QK_ARCHS
    norm_plus_one = arch in NORM_PLUS_ONE_ARCHS
    for t in reader.tensors:
        if t.name in experts:  # [E, rows, ...]: one tensor per expert, as HF names them
            for hf_name, tensor in _tensor_items(t, experts[t.name], keep_quantized, path):
                yield hf_name, tensor
            continue
        hf_name = to_hf.get(t.name)
        if hf_name is None:
            if t.name in ("rope_freqs.weight",):  # llama3 rope factors: we compute them
                continue
            raise ModelLoadError(f"{path}: tensor {t.name!r} has no Hugging Face equivalent")
        quantized = keep_quantized and int(t.tensor_type) in BLOCK_TYPES
        if quantized:
            data = np.asarray(t.data)
        else:
            try:
                data = gguf.quants.dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise ModelLoadError(f"{path}: cannot dequantize tensor {t.name!r}: {e}") from e
            data = np.asarray(data, dtype=np.float32)
        if permute and ".q_proj." in hf_name:
            data = unpermute_qk(data, num_heads)
        elif permute and ".k_proj." in hf_name:
            data = unpermute_qk(data, num_kv_heads)
        elif norm_plus_one and hf_name.endswith("norm.weight"):
            data = data - 1.0
        if not data.flags.writeable or not data.flags.c_contiguous:
            data = np.array(data, copy=True)  # an mmap view of an unquantized tensor
        if quantized:
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions inner first
            yield hf_name, GGUFTensor(torch.from_numpy(data), int(t.tensor_type), shape)
        else:
            yield hf_name, torch.from_numpy(data)

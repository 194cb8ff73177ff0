"""gpt-oss GGUF files (llama.cpp's ``gpt-oss`` architecture) read as the released gpt-oss
checkpoint's tensors.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``GptOssModel``) writes each layer's
experts as stacked tensors: the checkpoint's ``gate_up_proj``, whose gate and up rows
alternate, split into ``ffn_gate_exps`` and ``ffn_up_exps`` (``[E, I, H]``; or fused as
``ffn_gate_up_exps [E, 2I, H]``, the gate rows then the up rows), and ``down_proj`` as
``ffn_down_exps`` (``[E, H, I]``), each with a bias. MXFP4 experts keep
their values in ggml's ``block_mxfp4``: per 32 values one byte of E8M0 scale, then 16 bytes
whose low nibbles hold values 0-15 and high nibbles values 16-31; other experts are stored
as ``[E, out, in]`` (float, or any other ggml type). The attention sinks are
``attn_sinks.weight``.

``lookup_names`` gives the loader the names to look the file's tensors up by, and
``checkpoint_tensors`` turns what it reads back into the checkpoint's tensors, which the
model loads as it loads the released checkpoint: ``gate_up_proj_blocks``/``_scales``
(MXFP4, rows interleaved, two values per byte with the even one in the low nibble) or
``gate_up_proj [E, H, 2I]``, ``gate_up_proj_bias [E, 2I]`` and the same for ``down_proj``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from tokenmill.gguf_config import GGML_MXFP4
from tokenmill.load_errors import ModelLoadError
from tokenmill.model.layers.quantization.tensors import GGUFTensor

_OUR_EXPERTS = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.w(13|2)\.")
_FILE_EXPERTS = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<proj>gate|up|down|gate_up)_proj\.(?P<kind>weight|bias)$"
)
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_SINKS = ".self_attn.sinks"


def lookup_names(expected: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """The names to find the file's tensors by.

    Returns:
        ``(checkpoint names, fused names)``: ``expected`` (the model's parameters) with each
        layer's experts as the converter names them before mapping
        (``mlp.experts.{gate,up,down}_proj.{weight,bias}``) and the sinks as
        ``self_attn.sinks.weight``; and the file name -> checkpoint name of each layer's
        fused ``ffn_gate_up_exps`` weight and bias (which the gguf package's tables do not
        name).
    """
    names, experts = [], []
    for name in expected:
        match = _OUR_EXPERTS.match(name)
        if match:
            if match["prefix"] not in experts:
                experts.append(match["prefix"])
        elif name.endswith(_SINKS):
            names.append(name + ".weight")
        else:
            names.append(name)
    fused = {}
    for prefix in experts:
        names += [f"{prefix}.{proj}_proj.{kind}" for proj in ("gate", "up", "down")
                  for kind in ("weight", "bias")]  # fmt: skip
        layer = _LAYER.search(prefix + ".")
        if layer is not None:
            fused.update({f"blk.{layer[1]}.ffn_gate_up_exps.{kind}": f"{prefix}.gate_up_proj.{kind}"
                          for kind in ("weight", "bias")})  # fmt: skip
    return names, fused


def mxfp4_checkpoint_blocks(
    data: torch.Tensor, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml ``block_mxfp4`` rows -> the checkpoint's ``(blocks [..., K/32, 16], scales
    [..., K/32])`` (uint8) for a tensor of logical ``shape [..., K]``.

    Raises:
        ModelLoadError: data that is not ``K/32`` blocks of 17 bytes per row.
    """
    k = shape[-1]
    if k % 32 or data.shape[-1] != k // 32 * 17:
        raise ModelLoadError(f"an MXFP4 tensor of shape {shape} has rows of {data.shape[-1]} "
                             f"bytes, not {k // 32} blocks of 17")  # fmt: skip
    raw = data.reshape(*shape[:-1], k // 32, 17)
    scales = raw[..., 0].contiguous()
    qs = raw[..., 1:]
    values = torch.cat((qs & 0xF, qs >> 4), dim=-1)  # value j of the block at index j
    return (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous(), scales


def _float(t: torch.Tensor | GGUFTensor) -> torch.Tensor:
    return t.dequantize() if isinstance(t, GGUFTensor) else t


def _is_mxfp4(t: torch.Tensor | GGUFTensor) -> bool:
    return isinstance(t, GGUFTensor) and t.qtype == GGML_MXFP4


def _interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[E, I, ...]`` twice -> ``[E, 2I, ...]``: row ``2i`` gate row ``i``, ``2i + 1`` up."""
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def _halves(t, kind: str) -> tuple:
    """A fused gate/up tensor's gate and up halves (rows; a bias' last dimension)."""
    if kind == "bias":
        return tuple(_float(t).chunk(2, dim=-1))
    if isinstance(t, GGUFTensor):
        n = t.shape[1] // 2
        return t.rows(0, n), t.rows(n, n)
    return tuple(t.chunk(2, dim=1))


def _gate_up(prefix: str, kind: str, gate, up) -> Iterator[tuple[str, torch.Tensor]]:
    if kind == "bias":
        yield f"{prefix}.gate_up_proj_bias", _interleave_rows(_float(gate), _float(up))
    elif _is_mxfp4(gate) and _is_mxfp4(up):
        (gb, gs), (ub, us) = (mxfp4_checkpoint_blocks(t.data, t.shape) for t in (gate, up))
        yield f"{prefix}.gate_up_proj_blocks", _interleave_rows(gb, ub)
        yield f"{prefix}.gate_up_proj_scales", _interleave_rows(gs, us)
    else:  # [E, 2I, H] as rows -> the checkpoint's [E, H, 2I]
        rows = _interleave_rows(_float(gate), _float(up))
        yield f"{prefix}.gate_up_proj", rows.transpose(1, 2).contiguous()


def _down(prefix: str, kind: str, t) -> Iterator[tuple[str, torch.Tensor]]:
    if kind == "bias":
        yield f"{prefix}.down_proj_bias", _float(t)
    elif _is_mxfp4(t):
        blocks, scales = mxfp4_checkpoint_blocks(t.data, t.shape)
        yield f"{prefix}.down_proj_blocks", blocks
        yield f"{prefix}.down_proj_scales", scales
    else:
        yield f"{prefix}.down_proj", _float(t).transpose(1, 2).contiguous()


def checkpoint_tensors(
    items: Iterable[tuple[str, torch.Tensor | GGUFTensor]], mxfp4: bool
) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """The loader's ``(name, tensor)`` pairs (named by ``lookup_names``) as the checkpoint's.

    Args:
        items: float tensors, or ``GGUFTensor`` blocks (MXFP4 experts; other kept types).
        mxfp4: the model's experts are MXFP4 (every expert weight of the file is); else
            every expert tensor is made float.

    Raises:
        ModelLoadError: a layer with a gate tensor but no up tensor, or the reverse.
    """
    pending: dict[tuple[str, str], dict[str, object]] = {}
    for name, tensor in items:
        if name.endswith(_SINKS + ".weight"):
            yield name.removesuffix(".weight"), tensor
            continue
        match = _FILE_EXPERTS.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, proj, kind = match["prefix"], match["proj"], match["kind"]
        if not mxfp4 and isinstance(tensor, GGUFTensor):
            tensor = tensor.dequantize()
        if proj == "down":
            yield from _down(prefix, kind, tensor)
            continue
        if proj == "gate_up":  # fused: the gate rows, then the up rows
            yield from _gate_up(prefix, kind, *_halves(tensor, kind))
            continue
        parts = pending.setdefault((prefix, kind), {})
        parts[proj] = tensor
        if len(parts) == 2:
            del pending[(prefix, kind)]
            yield from _gate_up(prefix, kind, parts["gate"], parts["up"])
    for (prefix, kind), parts in pending.items():
        missing = "up" if "gate" in parts else "gate"
        raise ModelLoadError(f"{prefix}: the file has no {missing} projection {kind} of the "
                             f"experts (ffn_{missing}_exps)")  # fmt: skip

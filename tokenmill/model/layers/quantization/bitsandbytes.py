"""bitsandbytes weights (``--quantization bitsandbytes``) through the bitsandbytes library:
4-bit NF4/FP4 (QLoRA's format, Dettmers et al. 2023, arXiv:2305.14314) and 8-bit
(LLM.int8()'s row-wise absmax int8, arXiv:2208.07339).

Two sources:

- an unquantized checkpoint: each layer is quantized once loaded (4-bit NF4, as vLLM does,
  unless the config says otherwise);
- a checkpoint transformers saved after quantizing with bitsandbytes: ``weight`` holds the
  packed values and ``weight.absmax``, ``weight.quant_map``, ``weight.nested_*`` and
  ``weight.quant_state.bitsandbytes__*`` its quantization state (``SCB`` for 8-bit). Each
  part is dequantized with its own state and the merged weight quantized again with the
  same type and block size, which gives back the same codes (a block's largest value
  dequantizes to its absmax exactly).

Products: ``bitsandbytes.matmul_4bit`` (4-bit) and the int8 rows times their scales (8-bit).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from tokenmill.model.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    ShardSlice,
    copy_shard,
    layer_ignored,
    layer_names,
    name_listed,
    set_layout,
)
from tokenmill.model.layers.weight_shape import check_shape

# Checkpoint names ``<layer>.weight.<state>`` -> our parameter ``<layer>.weight_<state>``.
STATE_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map",
                  "quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")


# bitsandbytes' 4-bit block sizes.
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)


def checkpoint_param_name(name: str) -> str:
    """The parameter a bitsandbytes checkpoint tensor loads into (state tensors renamed)."""
    for suffix in STATE_SUFFIXES:
        if name.endswith(".weight." + suffix):
            head = name[: -len(suffix) - len(".weight.")]
            return f"{head}.weight_{suffix.replace('.', '_')}"
    return name


def _import_bnb():
    try:
        import bitsandbytes
        import bitsandbytes.functional
    except ImportError as e:
        raise QuantizationError(
            "--quantization bitsandbytes needs the bitsandbytes package: "
            "pip install 'bitsandbytes>=0.48'"
        ) from e
    return bitsandbytes


class BitsAndBytesLinearMethod(LinearMethod):
    """One layer's bitsandbytes weight (see the module docstring)."""

    def __init__(self, bits: int, quant_type: str, blocksize: int) -> None:
        self.bits = bits
        self.quant_type = quant_type
        self.blocksize = blocksize

    def create_weights(self, layer, input_size, output_sizes, dtype) -> None:
        weight = torch.empty(sum(output_sizes), input_size, dtype=dtype)
        layer.weight = set_layout(nn.Parameter(weight, requires_grad=False))
        state_names = [s.replace(".", "_") for s in STATE_SUFFIXES] + ["SCB", "format"]
        for name in state_names:
            attr = name if name == "SCB" else f"weight_{name}"
            p = nn.Parameter(torch.empty(0), requires_grad=False)
            p.tm_optional = True  # type: ignore[attr-defined]  # pre-quantized only
            setattr(layer, attr, p)
        layer.bnb_parts = {}
        layer.bnb_slices = {}
        layer.bnb_dtype = dtype

    def load_weight(self, layer, param, loaded, s: ShardSlice) -> None:
        name = getattr(param, "_tm_name", "?").rsplit(".", 1)[-1]
        if name == "weight_format":  # LLM.int8()'s row layout tag: rows are plain here
            return
        if name == "weight" and loaded.is_floating_point():
            copy_shard(param, loaded, s, getattr(param, "_tm_name", "?"))
            return
        start = s.dst_start or 0
        size = s.size if s.size is not None else sum(layer.output_partition_sizes)
        # A pre-quantized part is the whole checkpoint tensor (its packed values and block
        # scales do not split by rows and columns): each rank dequantizes it whole and keeps
        # its slice ``s``. Kept until the layer is complete, read now: bitsandbytes takes
        # tensors, not the lazily read checkpoint regions of the safetensors loader.
        layer.bnb_parts.setdefault((start, size), {})[name] = loaded.contiguous()
        layer.bnb_slices[(start, size)] = s

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bnb = _import_bnb()
        weight = layer.weight.data
        device = weight.device
        # Rows' absmax of a pre-quantized 8-bit checkpoint (0: none), kept as they are.
        row_absmax = torch.zeros(weight.shape[0], device=device)
        name = getattr(layer.weight, "_tm_name", "weight")
        for (start, size), state in sorted(layer.bnb_parts.items()):
            s = layer.bnb_slices[(start, size)]
            part_name = name if len(layer.bnb_parts) == 1 else f"{name} (rows from {start})"
            whole = _dequantize_part(bnb, state, device, part_name, self._format())
            part = _rank_slice(whole, s, size, layer.input_size, name)
            weight[start : start + size] = part.to(weight.dtype)
            if "SCB" in state:
                scb = state["SCB"].to(device).float()
                row_absmax[start : start + size] = scb[s.src_start : s.src_start + size]
        layer.bnb_parts, layer.bnb_slices = {}, {}
        for name in list(layer._parameters):
            if name != "bias":
                delattr(layer, name)
        if self.bits == 8:
            cb, scb, _ = bnb.functional.int8_vectorwise_quant(weight.float())
            # NOTE: a row-parallel rank holds part of each row: quantized with the whole
            # row's absmax, it keeps the checkpoint's codes (its own absmax would round
            # them anew).
            kept = row_absmax > 0
            if kept.any():
                scale = 127 / row_absmax[kept, None]
                cb[kept] = torch.round(weight[kept].float() * scale).clamp(-127, 127).to(cb.dtype)
                scb[kept] = row_absmax[kept]
            layer.register_buffer("bnb_int8", cb, persistent=False)
            layer.register_buffer("bnb_row_scale", (scb / 127).to(layer.bnb_dtype),
                                  persistent=False)
            return
        packed, state = bnb.functional.quantize_4bit(
            weight, blocksize=self.blocksize, quant_type=self.quant_type,
            compress_statistics=False,
        )
        layer.register_buffer("bnb_packed", packed, persistent=False)
        layer.register_buffer("bnb_absmax", state.absmax, persistent=False)
        layer.bnb_state = state

    def _format(self) -> str:
        """This method's format as ``_dequantize_part`` names a stored one."""
        if self.bits == 8:
            return "8-bit"
        return f"4-bit {self.quant_type}, block size {self.blocksize}"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        if self.bits == 8:
            y = torch.nn.functional.linear(x, layer.bnb_int8.to(x.dtype)) * layer.bnb_row_scale
        else:
            import bitsandbytes

            y = bitsandbytes.matmul_4bit(x, layer.bnb_packed.t(), quant_state=layer.bnb_state)
        return y if bias is None else y + bias


def _rank_slice(weight: torch.Tensor, s: ShardSlice, rows: int, cols: int,
                name: str) -> torch.Tensor:
    """This rank's ``[rows, cols]`` of a whole ``[N, K]`` weight: output features from
    ``s.src_start``, input features from ``s.in_start`` (row-parallel ranks).

    Raises:
        WeightShapeError: the checkpoint tensor is too small for the layer.
    """
    in_start = s.in_start or 0
    # A whole layer (no slice) takes the whole tensor; a slice, a region inside it.
    n = rows if s.size is None else max(weight.shape[0], s.src_start + rows)
    k = cols if s.in_start is None else max(weight.shape[1], in_start + cols)
    check_shape(name, (n, k), weight.shape)
    return weight[s.src_start : s.src_start + rows, in_start : in_start + cols]


def _check_state(state: dict[str, torch.Tensor], name: str) -> None:
    """Refuse a pre-quantized part whose state is incomplete or does not fit its weight.

    Raises:
        QuantizationError: naming the missing or misshapen tensor.
    """
    packed = state.get("weight")
    if packed is None:
        raise QuantizationError(f"{name}: the bitsandbytes checkpoint has its quantization "
                                "state but not the quantized weight")  # fmt: skip
    if packed.dtype == torch.int8 or "SCB" in state:  # LLM.int8(): int8 rows, their absmax
        scb = state.get("SCB")
        if scb is None:
            raise QuantizationError(f"{name}: an 8-bit bitsandbytes weight without its SCB "
                                    "(row absmax) tensor")  # fmt: skip
        if packed.dim() != 2 or scb.shape != (packed.shape[0],):
            raise QuantizationError(
                f"{name}: SCB has shape {tuple(scb.shape)}, the int8 weight "
                f"{tuple(packed.shape)} needs ({packed.shape[0]},)"
            )
        return
    missing = [k for k in ("absmax", "quant_map") if f"weight_{k}" not in state]
    header = [k for k in state if k.startswith("weight_quant_state_")]
    if not header:
        missing.append("quant_state.bitsandbytes__nf4 (or __fp4)")
    else:
        try:
            fields = json.loads(bytes(state[header[0]].to(torch.uint8).tolist()))
        except (ValueError, UnicodeDecodeError):
            raise QuantizationError(f"{name}: its bitsandbytes quant_state is not valid "
                                    "JSON") from None  # fmt: skip
        if isinstance(fields, dict) and "nested_offset" in fields:  # double quantization
            missing += [k for k in ("nested_absmax", "nested_quant_map")
                        if f"weight_{k}" not in state]  # fmt: skip
    if missing:
        raise QuantizationError(
            f"{name}: the 4-bit bitsandbytes state lacks "
            + ", ".join(f"weight.{k}" for k in missing)
        )


def _dequantize_part(bnb: Any, state: dict[str, torch.Tensor], device: torch.device,
                     name: str, expected: str) -> torch.Tensor:  # fmt: skip
    """A pre-quantized checkpoint tensor -> its whole ``[N, K]`` weight in float32.

    Args:
        expected: the format ``quantization_config`` names (``"8-bit"``, or ``"4-bit nf4,
            block size 64"``): the stored state must be of it, since the weight is
            quantized again in that format.

    Raises:
        QuantizationError: an incomplete or inconsistent state (``_check_state``), one
            bitsandbytes cannot read, or one of another format than ``expected``.
    """
    _check_state(state, name)
    packed = state["weight"]
    if "SCB" in state:  # 8-bit: int8 rows and their absmax
        _check_format(name, "8-bit", expected)
        return packed.to(device).float() * (state["SCB"].to(device).float()[:, None] / 127)
    try:
        quant_state = _quant_state(state, device)
        stored = f"4-bit {quant_state.quant_type}, block size {quant_state.blocksize}"
        _check_format(name, stored, expected)
        return bnb.functional.dequantize_4bit(state["weight"].to(device), quant_state).float(
        ).reshape(quant_state.shape)
    except QuantizationError:
        raise
    except (ValueError, KeyError, RuntimeError, TypeError) as e:
        reason = " ".join(str(e).split())[:200]
        raise QuantizationError(f"{name}: bitsandbytes cannot read its 4-bit state: "
                                f"{reason}") from None  # fmt: skip


def _check_format(name: str, stored: str, expected: str) -> None:
    if stored != expected:
        raise QuantizationError(
            f"{name}: the checkpoint stores bitsandbytes {stored}, its quantization_config "
            f"says {expected}"
        )


def _quant_state(state: dict[str, torch.Tensor], device: torch.device) -> Any:
    """bitsandbytes' ``QuantState`` of a pre-quantized 4-bit part's state tensors."""
    from bitsandbytes.functional import QuantState

    qs_dict = {}
    for key, value in state.items():
        if key == "weight":
            continue
        key = key[len("weight_"):]
        if key.startswith("quant_state_"):
            key = "quant_state." + key[len("quant_state_"):]
        qs_dict[key] = value
    return QuantState.from_dict(qs_dict, device=device)


class BitsAndBytesConfig(QuantizationConfig):
    """Every linear layer but those ``llm_int8_skip_modules`` names."""

    name = "bitsandbytes"

    def __init__(self, bits: int, quant_type: str, blocksize: int, skip: list[str]) -> None:
        self.bits = bits
        self.quant_type = quant_type
        self.blocksize = blocksize
        self.skip = skip

    @classmethod
    def from_config(cls, qc: dict[str, Any], device: str) -> BitsAndBytesConfig:
        """The config of a ``quantization_config`` (transformers' BitsAndBytesConfig keys).

        Raises:
            QuantizationError: both 4-bit and 8-bit, a 4-bit type or block size
                bitsandbytes does not have, or ``llm_int8_skip_modules`` that is not a list
                of names.
        """
        _import_bnb()
        if qc.get("load_in_8bit") and qc.get("load_in_4bit"):
            raise QuantizationError(
                "bitsandbytes quantization_config sets both load_in_4bit and load_in_8bit"
            )
        bits = 8 if qc.get("load_in_8bit") else 4
        quant_type = str(qc.get("bnb_4bit_quant_type", "nf4"))
        if quant_type not in ("nf4", "fp4"):
            raise QuantizationError(f"bitsandbytes 4-bit type {quant_type!r} (nf4 or fp4)")
        blocksize = qc.get("bnb_4bit_blocksize", 64)
        if blocksize not in BLOCK_SIZES or isinstance(blocksize, bool):
            raise QuantizationError(
                f"bitsandbytes quantization_config bnb_4bit_blocksize {blocksize!r}: one of "
                f"{', '.join(map(str, BLOCK_SIZES))}"
            )
        skip = layer_names(qc, "llm_int8_skip_modules")
        return cls(bits, quant_type, int(blocksize), skip)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        from tokenmill.model.layers.quantization.unquantized import UnquantizedLinearMethod

        # A checkpoint layer named (or ending with) a skipped module stays 16-bit; a merged
        # layer by its parts, which must agree.
        if getattr(layer, "replicated", False) or layer_ignored(
            prefix, lambda name: name_listed(name, self.skip)
        ):
            return UnquantizedLinearMethod()
        return BitsAndBytesLinearMethod(self.bits, self.quant_type, self.blocksize)

    def get_moe_method(self, layer: nn.Module, prefix: str):
        raise QuantizationError("bitsandbytes MoE experts are not supported")

    def describe(self) -> str:
        return f"bitsandbytes {'int8' if self.bits == 8 else self.quant_type}"

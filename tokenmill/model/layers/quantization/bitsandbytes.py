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

from typing import Any

import torch
from torch import nn

from tokenmill.model.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    ShardSlice,
    copy_shard,
    set_layout,
)

# Checkpoint names ``<layer>.weight.<state>`` -> our parameter ``<layer>.weight_<state>``.
STATE_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map",
                  "quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")


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
        layer.bnb_parts.setdefault((start, size), {})[name] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bnb = _import_bnb()
        weight = layer.weight.data
        device = weight.device
        for (start, size), state in sorted(layer.bnb_parts.items()):
            weight[start : start + size] = _dequantize_part(bnb, state, size, layer.input_size,
                                                            device).to(weight.dtype)
        layer.bnb_parts = {}
        for name in list(layer._parameters):
            if name != "bias":
                delattr(layer, name)
        if self.bits == 8:
            cb, scb, _ = bnb.functional.int8_vectorwise_quant(weight.float())
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

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        if self.bits == 8:
            y = torch.nn.functional.linear(x, layer.bnb_int8.to(x.dtype)) * layer.bnb_row_scale
        else:
            import bitsandbytes

            y = bitsandbytes.matmul_4bit(x, layer.bnb_packed.t(), quant_state=layer.bnb_state)
        return y if bias is None else y + bias


def _dequantize_part(bnb: Any, state: dict[str, torch.Tensor], rows: int, cols: int,
                     device: torch.device) -> torch.Tensor:
    """A pre-quantized checkpoint part -> ``[rows, cols]`` float32."""
    packed = state.get("weight")
    if packed is None:
        raise QuantizationError("a bitsandbytes checkpoint part has state but no weight")
    if "SCB" in state:  # 8-bit: int8 rows and their absmax
        return packed.to(device).float() * (state["SCB"].to(device).float()[:, None] / 127)
    from bitsandbytes.functional import QuantState

    qs_dict = {}
    for key, value in state.items():
        if key == "weight":
            continue
        key = key[len("weight_"):]
        if key.startswith("quant_state_"):
            key = "quant_state." + key[len("quant_state_"):]
        qs_dict[key] = value
    quant_state = QuantState.from_dict(qs_dict, device=device)
    return bnb.functional.dequantize_4bit(packed.to(device), quant_state).float().reshape(
        rows, cols)


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
        _import_bnb()
        if qc.get("load_in_8bit"):
            bits = 8
        else:
            bits = 4
        quant_type = str(qc.get("bnb_4bit_quant_type", "nf4"))
        if quant_type not in ("nf4", "fp4"):
            raise QuantizationError(f"bitsandbytes 4-bit type {quant_type!r} (nf4 or fp4)")
        skip = list(qc.get("llm_int8_skip_modules") or [])
        return cls(bits, quant_type, int(qc.get("bnb_4bit_blocksize", 64)), skip)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        from tokenmill.model.layers.quantization.unquantized import UnquantizedLinearMethod

        if getattr(layer, "replicated", False) or any(
            s and (prefix == s or prefix.endswith("." + s)) for s in self.skip
        ):
            return UnquantizedLinearMethod()
        return BitsAndBytesLinearMethod(self.bits, self.quant_type, self.blocksize)

    def get_moe_method(self, layer: nn.Module, prefix: str):
        raise QuantizationError("bitsandbytes MoE experts are not supported")

    def describe(self) -> str:
        return f"bitsandbytes {'int8' if self.bits == 8 else self.quant_type}"

"""Quantized weights: the ``QuantizationConfig`` / ``LinearMethod`` seam and its methods."""

from tokenmill.model.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    ShardSlice,
    copy_shard,
    set_layout,
)
from tokenmill.model.layers.quantization.context import active_config, quantization_context

__all__ = [
    "LinearMethod",
    "QuantizationConfig",
    "QuantizationError",
    "ShardSlice",
    "active_config",
    "copy_shard",
    "quantization_context",
    "set_layout",
]


def get_quantization_config(method: str | None, hf_config, device: str):
    """The ``QuantizationConfig`` of a resolved method name (``resolve_quantization``), or
    None for unquantized weights.

    Raises:
        QuantizationError: the method cannot run on ``device``.
    """
    if method in (None, "mxfp4"):
        # MXFP4 checkpoints (gpt-oss) quantize only the experts, which the model's MoE
        # layers hold as MXFP4 themselves; every linear layer is unquantized.
        return None
    qc = hf_config.get("quantization_config") or {}
    if method == "gguf":
        from tokenmill.model.layers.quantization.gguf import GGUFConfig

        return GGUFConfig()
    if method in ("awq", "gptq"):
        from tokenmill.model.layers.quantization.int4 import awq_config, gptq_config

        return awq_config(qc) if method == "awq" else gptq_config(qc)
    if method == "compressed-tensors":
        from tokenmill.model.layers.quantization.compressed_tensors import (
            CompressedTensorsConfig,
        )
        from tokenmill.model.layers.quantization.fp8 import Fp8Config

        config = CompressedTensorsConfig.from_config(qc)
        if isinstance(config, Fp8Config):
            _refuse_fp8_experts(hf_config)
        return config
    if method == "fp8":
        from tokenmill.model.layers.quantization.fp8 import Fp8Config

        if qc:
            _refuse_fp8_experts(hf_config)
        return Fp8Config.from_config(qc or None)
    if method == "bitsandbytes":
        from tokenmill.model.layers.quantization.bitsandbytes import BitsAndBytesConfig

        return BitsAndBytesConfig.from_config(qc, device)
    raise QuantizationError(f"quantization method {method!r} is not supported")


# config.json fields that give a model routed experts.
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def _refuse_fp8_experts(hf_config) -> None:
    """FP8 MoE checkpoints are not read yet (``--quantization fp8`` quantizes a 16-bit MoE
    checkpoint's experts while loading)."""
    if any((hf_config.get(f) or 0) > 1 for f in EXPERT_FIELDS):
        raise QuantizationError(
            "FP8 checkpoints of MoE models (routed experts) are not supported yet; FP8 "
            "checkpoints of dense models are, and --quantization fp8 on a 16-bit MoE checkpoint"
        )

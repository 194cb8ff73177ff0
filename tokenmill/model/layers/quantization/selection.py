"""Which quantization method a model runs with: ``--quantization`` (vLLM's spellings) and the
checkpoint's ``quantization_config`` (config.json), checked against each other at start-up.

A method or layout that is not implemented is refused here, in one line naming it and what is
supported, before any weight is read.
"""

from __future__ import annotations

from typing import Any

from tokenmill.model.layers.quantization.base import QuantizationError

# --quantization values accepted; the Marlin spellings load the same checkpoints.
FLAG_METHODS = {
    "awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "compressed-tensors": "compressed-tensors",
    "bitsandbytes": "bitsandbytes",
    "gguf": "gguf",
    "mxfp4": "mxfp4",
    "fp8": "fp8",
}
# MXFP4 (OCP Microscaling FP4) experts are held by these architectures' MoE layers.
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)
# Methods vLLM knows that tokenmill does not run yet (refused by name).
FP8_METHODS = ("fbgemm_fp8", "ptpc_fp8", "modelopt", "modelopt_fp4", "fp_quant")
SUPPORTED_TEXT = (
    "supported: awq, gptq (and their _marlin spellings), compressed-tensors W4A16 "
    "(pack-quantized) and FP8 (float-quantized), fp8, bitsandbytes, gguf, mxfp4 "
    "(gpt-oss experts)"
)
INT4_GROUP_SIZES = (32, 64, 128, -1)


def resolve_quantization(
    flag: str | None, hf_config: Any, is_gguf: bool, gguf_dequantize: bool = False
) -> str | None:
    """The method to run (``awq``, ``gptq``, ``compressed-tensors``, ``bitsandbytes``,
    ``gguf``, ``mxfp4``) or None for unquantized weights.

    Args:
        flag: ``--quantization`` as given (None: not given).
        hf_config: the model's config (``quantization_config`` read from it).
        is_gguf: the model is a ``.gguf`` file.
        gguf_dequantize: dequantize GGUF weights at load (``--gguf-dequantize``).

    Raises:
        QuantizationError: an unknown or unsupported method, a layout that is not
            implemented, a flag that contradicts the checkpoint, or ``--gguf-dequantize``
            for a model that is not loaded from GGUF blocks.
    """
    if flag is not None and flag not in FLAG_METHODS:
        if flag in FP8_METHODS:
            raise QuantizationError(
                f"--quantization {flag}: this FP8/FP4 method is not implemented yet; "
                f"{SUPPORTED_TEXT}"
            )
        raise QuantizationError(f"--quantization {flag}: unknown method; {SUPPORTED_TEXT}")
    method = FLAG_METHODS.get(flag or "")
    if gguf_dequantize and not is_gguf:
        raise QuantizationError(
            "--gguf-dequantize applies to .gguf model files loaded from their blocks "
            "(--load-format auto or gguf)"
        )
    if gguf_dequantize and method == "gguf":
        raise QuantizationError(
            "--gguf-dequantize and --quantization gguf contradict each other: pass one of them"
        )
    if is_gguf:
        if method == "fp8":
            if gguf_dequantize:
                raise QuantizationError(
                    "--quantization fp8 and --gguf-dequantize contradict each other: fp8 "
                    "already dequantizes the GGUF blocks, then quantizes them to FP8 at load; "
                    "pass one of them"
                )
            return method  # the GGUF blocks dequantized, then quantized to FP8 at load
        if method not in (None, "gguf"):
            raise QuantizationError(
                f"--quantization {flag}: the model is a GGUF file, whose weights are GGUF "
                "blocks (leave the flag out, or pass --quantization gguf or fp8)"
            )
        return None if gguf_dequantize else "gguf"
    if method == "gguf":
        raise QuantizationError("--quantization gguf needs a .gguf model file")
    config = hf_config.get("quantization_config")
    if config is not None and not isinstance(config, dict):
        raise QuantizationError(
            f"config.json's quantization_config must be a JSON object, got {config!r}"
        )
    detected = detect_checkpoint_method(config) if config else None
    if "mxfp4" in (method, detected):
        _check_mxfp4_architecture(hf_config)
    if method is None or method == detected:
        return detected
    if detected is None:
        if method in ("bitsandbytes", "fp8"):
            return method  # quantized while loading an unquantized checkpoint
        raise QuantizationError(
            f"--quantization {flag}: the checkpoint has no quantization_config; {flag} needs "
            "a checkpoint quantized with it (only bitsandbytes and fp8 quantize while loading)"
        )
    raise QuantizationError(
        f"--quantization {flag}: the checkpoint is quantized with {detected} "
        f"(its config.json's quantization_config)"
    )


def detect_checkpoint_method(config: dict[str, Any]) -> str:
    """The method of a ``quantization_config``, after checking its layout is one tokenmill
    runs.

    Raises:
        QuantizationError: an unsupported method or layout (one line).
    """
    name = str(config.get("quant_method", "")).lower()
    if name == "awq":
        _check_awq(config)
    elif name == "gptq":
        _check_gptq(config)
    elif name == "compressed-tensors":
        from tokenmill.model.layers.quantization.compressed_tensors import (
            is_fp8,
            parse_fp8,
            parse_w4a16,
        )

        parse_fp8(config) if is_fp8(config) else parse_w4a16(config)
    elif name in ("bitsandbytes", "mxfp4"):
        pass
    elif name == "fp8":
        from tokenmill.model.layers.quantization.fp8 import Fp8Config

        Fp8Config.from_config(config)
    elif name in FP8_METHODS or "fp8" in name:
        raise QuantizationError(
            f"checkpoint quantization {name!r} (FP8) is not implemented yet; {SUPPORTED_TEXT}"
        )
    else:
        raise QuantizationError(f"checkpoint quantization {name!r} is not supported; "
                                f"{SUPPORTED_TEXT}")
    return name


def _check_mxfp4_architecture(hf_config: Any) -> None:
    archs = list(hf_config.get("architectures") or [])
    if not any(a in MXFP4_ARCHITECTURES for a in archs):
        raise QuantizationError(
            f"mxfp4 is implemented for the MoE experts of {', '.join(MXFP4_ARCHITECTURES)}, "
            f"not for {', '.join(archs) or 'this model'}"
        )


def _check_group(method: str, group: Any) -> None:
    if group not in INT4_GROUP_SIZES:
        raise QuantizationError(
            f"{method} group_size {group!r} is not supported (the integers 32, 64, 128, or -1 "
            "for per-channel)"
        )


def _check_awq(config: dict[str, Any]) -> None:
    bits = config.get("bits", config.get("w_bit"))
    version = str(config.get("version", "gemm")).lower()
    if bits != 4:
        raise QuantizationError(f"awq bits {bits!r} is not supported (the integer 4 only)")
    if version != "gemm":
        raise QuantizationError(
            f"awq version {version!r} is not supported (the GEMM layout, version 'gemm', is)"
        )
    _check_group("awq", config.get("group_size", config.get("q_group_size")))


def _check_gptq(config: dict[str, Any]) -> None:
    bits = config.get("bits")
    fmt = str(config.get("checkpoint_format", "gptq")).lower()
    if bits != 4:
        raise QuantizationError(f"gptq bits {bits!r} is not supported (the integer 4 only)")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(
            f"gptq checkpoint_format {fmt!r} is not supported (gptq and gptq_v2 are)"
        )
    if config.get("lm_head"):
        raise QuantizationError("gptq lm_head: true (a quantized LM head) is not supported")
    if config.get("dynamic"):
        raise QuantizationError(
            "gptq dynamic (per-module bits, group sizes or skipped modules) is not supported"
        )
    _check_group("gptq", config.get("group_size"))

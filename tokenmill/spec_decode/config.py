"""``--speculative-config``: vLLM's JSON object -> ``tokenmill.config.SpeculativeConfig``.

The fields and their resolution follow vLLM's ``SpeculativeConfig``: ``method`` is inferred
when absent (``"model": "ngram"`` -> ngram; a model whose path names ``eagle-`` or ``eagle3``
-> that EAGLE variant; any other model -> draft_model); n-gram sizes default to 5, or to each
other when only one is given. vLLM fields that tokenmill does not implement are refused by
name, unless they carry their default value.
"""

from __future__ import annotations

import os
from typing import Any

from tokenmill.arg_types import json_object
from tokenmill.config import (
    ConfigError,
    ModelConfig,
    SpeculativeConfig,
    UnsupportedQuantizationError,
)

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# The most draft tokens per step: verification costs grow with k, acceptance falls with it.
MAX_SPECULATIVE_TOKENS = 32
# vLLM's default n-gram size when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
# vLLM fields accepted only at these values (what tokenmill does anyway).
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "draft_sample_method": ("greedy",),
    "rejection_sample_method": ("standard",),
    "disable_padded_drafter_batch": (False,),
    "parallel_drafting": (False,),
    "revision": (None,),
    "code_revision": (None,),
    "enforce_eager": (None,),
    "use_local_argmax_reduction": (False,),
}
_FIELDS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_tensor_parallel_size",
    "max_model_len",
    "quantization",
)


def parse_speculative_json(value: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """``--speculative-config`` text (or a dict, offline) -> a dict; None stays None.

    Checks that need no model: the JSON, unknown and unimplemented fields, the method name
    and the integer fields' ranges.

    Raises:
        ConfigError: the problem, in one line naming the field.
    """
    if value is None or value == {}:
        return None
    try:
        value = json_object(value, "--speculative-config")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name, choice in value.items():
        if name in _DEFAULT_ONLY:
            if choice not in _DEFAULT_ONLY[name]:
                allowed = ", ".join(repr(v) for v in _DEFAULT_ONLY[name])
                raise ConfigError(
                    f"--speculative-config: tokenmill does not implement {name}={choice!r} "
                    f"(only {allowed})"
                )
        elif name not in _FIELDS:
            raise ConfigError(
                f"--speculative-config: unknown or unimplemented field {name!r}; known: "
                f"{', '.join(_FIELDS)}"
            )
    method = value.get("method")
    if method is not None and method not in METHODS:
        raise ConfigError(
            f"--speculative-config: method must be one of {', '.join(METHODS)}, got {method!r}"
        )
    for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                 "draft_tensor_parallel_size", "max_model_len"):  # fmt: skip
        number = value.get(name)
        if number is not None and (not isinstance(number, int) or isinstance(number, bool)
                                   or number < 1):  # fmt: skip
            raise ConfigError(f"--speculative-config: {name} must be a positive integer")
    k = value.get("num_speculative_tokens")
    if k is not None and k > MAX_SPECULATIVE_TOKENS:
        raise ConfigError(
            f"--speculative-config: num_speculative_tokens {k} is more than "
            f"{MAX_SPECULATIVE_TOKENS}"
        )
    if value.get("draft_tensor_parallel_size", 1) != 1:
        raise ConfigError(
            "--speculative-config: draft_tensor_parallel_size must be 1 (the draft runs on "
            "the target's device)"
        )
    return dict(value)


def resolve_speculative_config(
    fields: dict[str, Any] | None, target: ModelConfig, device: str = "cpu"
) -> SpeculativeConfig | None:
    """The resolved configuration for ``target`` (None without speculative decoding).

    Args:
        fields: from ``parse_speculative_json``.
        target: the target model's configuration.
        device: where the target (and so the draft) runs: ``cuda`` or ``cpu``; a quantized
            draft's method is checked against it.

    Raises:
        ConfigError: a missing or inconsistent field, a draft that cannot serve this target
            (another vocabulary, another hidden size for EAGLE), or ``mtp`` for a model
            without MTP layers, or a draft quantization the device cannot run.
        ModelLoadError: the draft's config cannot be read.
    """
    if fields is None:
        return None
    model = fields.get("model")
    method = fields.get("method") or _infer_method(model)
    if method == "ngram":
        model = None
    k = fields.get("num_speculative_tokens")
    if k is None:
        raise ConfigError("--speculative-config: num_speculative_tokens is required")
    if fields.get("max_model_len") not in (None, target.max_model_len):
        raise ConfigError(
            "--speculative-config: max_model_len must be the target's (speculation is never "
            "cut short by a shorter draft context)"
        )
    if fields.get("quantization") is not None and method != "draft_model":
        raise ConfigError(
            f"--speculative-config: quantization applies to a draft model, not {method}"
        )
    if method == "ngram":
        low, high = _prompt_lookup(fields)
        return SpeculativeConfig("ngram", k, None, low, high)
    if fields.get("prompt_lookup_min") or fields.get("prompt_lookup_max"):
        raise ConfigError(f"--speculative-config: prompt_lookup_* apply to ngram, not {method}")
    if method == "mtp":
        _check_mtp(target)
        return SpeculativeConfig("mtp", k, None, draft_model_config=target)
    if not model:
        raise ConfigError(f"--speculative-config: method {method} needs a model")
    draft = _draft_model_config(
        os.path.expanduser(model), target, fields.get("quantization"), device
    )
    _check_draft(method, draft, target)
    return SpeculativeConfig(method, k, draft.model, draft_model_config=draft)  # type: ignore[arg-type]


def _infer_method(model: str | None) -> str:
    """vLLM's inference of ``method`` from ``model`` when ``method`` is absent."""
    if model is None or model in ("ngram", "[ngram]"):
        return "ngram"
    name = model.lower()
    if "eagle3" in name:
        return "eagle3"
    if "eagle-" in name:
        return "eagle"
    return "draft_model"


def _prompt_lookup(fields: dict[str, Any]) -> tuple[int, int]:
    low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    if low > high:
        raise ConfigError(
            f"--speculative-config: prompt_lookup_min={low} must be <= prompt_lookup_max={high}"
        )
    return low, high


def _check_mtp(target: ModelConfig) -> None:
    from tokenmill.model.registry import get_model_class

    layers = target.hf_config.get("num_nextn_predict_layers") or 0
    supports = getattr(get_model_class(target.architecture), "supports_mtp", False)
    if not (layers and supports):
        raise ConfigError(
            f"--speculative-config: method mtp needs a model that ships MTP layers "
            f"(num_nextn_predict_layers in its config); {target.architecture} "
            f"({target.model}) has none"
        )


def _draft_model_config(
    model: str, target: ModelConfig, flag: str | None, device: str
) -> ModelConfig:
    """The draft's configuration: the target's dtype and context; its quantization from
    ``flag`` (the ``quantization`` field) or, as vLLM, its own checkpoint (a ``.gguf`` draft
    keeps its GGUF blocks unless the target is a GGUF file loaded dequantized)."""
    from tokenmill.hf_config import ModelLoadError, load_hf_config
    from tokenmill.model.layers.quantization import get_quantization_config
    from tokenmill.model.layers.quantization.selection import resolve_quantization

    if os.path.abspath(model) == os.path.abspath(target.model):
        # NOTE: the target's own file as its draft (a test setup, and self-speculation
        # checks): its config is already read, and a GGUF header takes seconds to parse.
        hf_config, generation_config = target.hf_config, target.generation_config
    else:
        try:
            hf_config, generation_config = load_hf_config(model)
        except ModelLoadError as e:
            # named as the draft's: the message alone reads as the target model's path
            raise ModelLoadError(f"--speculative-config: the draft model: {e}") from None
    is_gguf = model.endswith(".gguf")
    dequantize = is_gguf and flag is None and _gguf_dequantized(target)
    try:
        quantization = resolve_quantization(flag, hf_config, is_gguf, dequantize)
        quant_config = get_quantization_config(quantization, hf_config, device)
        if quant_config is not None:
            quant_config.check_dtype(target.dtype, device)
    except ValueError as e:
        # As the target's: a quantization tokenmill does not run exits 2 (an invalid flag).
        raise UnsupportedQuantizationError(
            f"--speculative-config: the draft {model}: {e}"
        ) from None
    return ModelConfig(
        model=model,
        tokenizer=target.tokenizer,
        served_model_name=os.path.basename(model.rstrip("/")),
        hf_config=hf_config,
        generation_config=generation_config,
        dtype=target.dtype,
        max_model_len=target.max_model_len,
        seed=target.seed,
        max_logprobs=target.max_logprobs,
        quantization=quantization,
    )


def _gguf_dequantized(target: ModelConfig) -> bool:
    """The target is a GGUF file loaded dequantized (``--gguf-dequantize``)."""
    return target.model.endswith(".gguf") and target.quantization is None


def _check_draft(method: str, draft: ModelConfig, target: ModelConfig) -> None:
    """A draft shares the target's tokenizer: same vocabulary; an EAGLE head reads the
    target's hidden states: same hidden size."""
    hf = draft.hf_config
    if hf.get("vocab_size") != target.vocab_size:
        raise ConfigError(
            f"--speculative-config: the draft {draft.model} has a vocabulary of "
            f"{hf.get('vocab_size')} tokens, the target {target.vocab_size}: a draft must "
            "share the target's tokenizer"
        )
    if method == "draft_model":
        from tokenmill.model.registry import get_model_class, is_pooling_model

        if is_pooling_model(draft.architecture):
            raise ConfigError(f"--speculative-config: {draft.model} is not a generative model")
        get_model_class(draft.architecture)  # UnsupportedArchitectureError names it
        return
    if draft.quantization is not None:
        raise ConfigError(
            f"--speculative-config: the {method} head {draft.model} is quantized "
            f"({draft.quantization}); heads load unquantized"
        )
    target_hidden = target.hf_config.hidden_size
    draft_hidden = hf.get("target_hidden_size") or hf.hidden_size
    if method == "eagle" and hf.hidden_size != target_hidden:
        raise ConfigError(
            f"--speculative-config: the EAGLE head {draft.model} has hidden size "
            f"{hf.hidden_size}, the target {target_hidden}"
        )
    if method == "eagle3" and draft_hidden != target_hidden:
        raise ConfigError(
            f"--speculative-config: the EAGLE-3 head {draft.model} reads hidden states of "
            f"size {draft_hidden}, the target's are {target_hidden}"
        )
    draft_vocab = hf.get("draft_vocab_size") or target.vocab_size
    if method == "eagle3" and draft_vocab > target.vocab_size:
        raise ConfigError(
            f"--speculative-config: the EAGLE-3 head {draft.model} drafts over {draft_vocab} "
            f"tokens, more than the target's {target.vocab_size}"
        )

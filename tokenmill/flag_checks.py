"""Checks of ``EngineArgs``' flag values that need no model config: ranges, spellings and
flags that need another one, each refused in one line before the model is read."""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.arg_types import parse_bytes
from tokenmill.config import (
    ConfigError,
    UnsupportedQuantizationError,
    check_kv_offloading_flags,
)
from tokenmill.sampling_params import INT64_MAX, INT64_MIN

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_flag_values(args: Any) -> int | None:
    """The checks of flag values that need no model (before its config is read, which
    takes seconds for a large GGUF file).

    Args:
        args: the ``EngineArgs`` (typed loosely: ``engine_args`` imports this module).

    Returns:
        ``--kv-cache-memory`` in bytes (None: unset).

    Raises:
        ConfigError: a value out of its range, or flags that need another one.
        UnsupportedQuantizationError: a ``--quantization`` method tokenmill does not run.
    """
    _check_choices(args)
    try:
        kv_bytes = parse_bytes(args.kv_cache_memory) if args.kv_cache_memory else None
    except ValueError as e:
        raise ConfigError(f"--kv-cache-memory: {e}") from None
    if kv_bytes is not None and kv_bytes <= 0:
        raise ConfigError(f"--kv-cache-memory must be positive, got {args.kv_cache_memory}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ConfigError(
            f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
        )
    if args.max_model_len is not None and args.max_model_len != -1 and args.max_model_len < 1:
        raise ConfigError(f"--max-model-len must be positive or -1, got {args.max_model_len}")
    override = args.num_gpu_blocks_override
    if override is not None and (isinstance(override, bool) or not isinstance(override, int)
                                 or override < 1):
        raise ConfigError(f"--num-gpu-blocks-override must be a positive integer, got {override!r}")
    if args.tokenizer_mode not in ("auto", "hf"):
        raise ConfigError(
            f"--tokenizer-mode {args.tokenizer_mode} is not supported: tokenmill reads Hugging "
            "Face fast tokenizers (tokenizer.json) and GGUF vocabularies (auto or hf)"
        )
    if args.quantization is not None:
        from tokenmill.model.layers.quantization.selection import (
            FLAG_METHODS,
            resolve_quantization,
        )

        if args.quantization not in FLAG_METHODS:  # refused before the model is read
            try:
                resolve_quantization(args.quantization, {}, False)
            except ValueError as e:
                raise UnsupportedQuantizationError(str(e)) from None
    if not INT64_MIN <= args.seed <= INT64_MAX:
        raise ConfigError(f"--seed must be a 64-bit signed integer, got {args.seed}")
    names = args.served_model_name
    if names is not None and any(
        not n.strip() for n in ([names] if isinstance(names, str) else names)
    ):
        raise ConfigError("--served-model-name: a served model name cannot be empty")
    for name in ("max_num_seqs", "max_num_batched_tokens", "stream_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("prefill_pacing_tokens", "long_prefill_token_threshold"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be non-negative, got {value}")
    if args.prefill_pacing_tokens and not args.enable_chunked_prefill:
        raise ConfigError(
            "--prefill-pacing-tokens needs chunked prefill: without it a prompt is "
            "computed whole in one step"
        )
    if args.max_logprobs < 0:
        raise ConfigError(f"--max-logprobs must be non-negative, got {args.max_logprobs}")
    check_kv_offloading_flags(
        args.kv_offloading_size,
        args.kv_offloading_backend,
        args.kv_offloading_disk_path,
        args.kv_offloading_disk_size,
        args.enable_prefix_caching,
    )
    return kv_bytes


def _check_choices(args: Any) -> None:
    """Flags with a fixed set of values: the command line's parser refuses others, and
    ``LLM(...)`` / ``EngineArgs(...)`` must too (else a misspelt value runs as the default).

    Raises:
        ConfigError: a value outside its flag's ``choices``.
    """
    for field in dataclasses.fields(args):
        choices = field.metadata.get("choices")
        value = getattr(args, field.name)
        # (a torch.dtype where a dtype name is expected is left to the dtype's own check)
        if choices is None or not isinstance(value, (str, int)) or value in choices:
            continue
        flag = "--" + field.name.replace("_", "-")
        raise ConfigError(
            f"{flag}: {value!r} is not one of {', '.join(str(c) for c in choices)}"
        )

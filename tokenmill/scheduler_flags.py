"""The scheduler's configuration from the engine's flags (``EngineArgs``): step budgets,
sequence limits, prefill pacing and async scheduling, with their device defaults."""

from __future__ import annotations

import os
from typing import Any

from tokenmill.config import ConfigError, ModelConfig, SchedulerConfig
from tokenmill.core.prefill_pacing import SERVING_PACING_TOKENS
from tokenmill.multimodal.config import BIDIRECTIONAL_IMAGE_ARCHITECTURES


def create_scheduler_config(
    args: Any, device: str, server: bool, model_config: ModelConfig, speculative: bool
) -> SchedulerConfig:
    """The scheduler's budgets, policy and pacing from ``args`` (an ``EngineArgs``; ``None``
    fields: the device's and usage's defaults).

    Raises:
        ConfigError: a batch budget below the context without chunked prefill, a token
            table larger than host memory, a pacing mode without pacing, or
            ``--async-scheduling`` with speculative decoding.
    """
    if device == "cuda":
        default_tokens, default_seqs = (8192 if server else 16384), 1024
    else:
        default_tokens, default_seqs = (2048 if server else 4096), (128 if server else 256)
    max_tokens = args.max_num_batched_tokens or default_tokens
    max_seqs = args.max_num_seqs or default_seqs
    if not args.enable_chunked_prefill:
        if args.max_num_batched_tokens is None:
            max_tokens = max(max_tokens, model_config.max_model_len)
        elif max_tokens < model_config.max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens {max_tokens} is smaller than --max-model-len "
                f"{model_config.max_model_len}: without chunked prefill a whole prompt must "
                "fit in one step's budget"
            )
    _check_token_table_fits(max_seqs, model_config.max_model_len)
    pacing_tokens = _prefill_pacing_tokens(args, device, server)
    if args.prefill_pacing_mode is not None and not pacing_tokens:
        raise ConfigError(
            f"--prefill-pacing-mode {args.prefill_pacing_mode} needs prefill pacing: pass "
            "--prefill-pacing-tokens N (it is on by default only for servers on CUDA with "
            "CUDA graphs)"
        )
    return SchedulerConfig(
        max_num_batched_tokens=max_tokens,
        max_num_seqs=max_seqs,
        max_model_len=model_config.max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,  # type: ignore[arg-type]
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        async_scheduling=_async_scheduling(args, device, speculative),
        prefill_pacing_tokens=pacing_tokens,
        prefill_pacing_mode=args.prefill_pacing_mode or "step",  # type: ignore[arg-type]
        stream_interval=args.stream_interval,
        disable_chunked_mm_input=_whole_images(args, model_config, max_tokens),
    )


def _whole_images(args: Any, model_config: ModelConfig, max_tokens: int) -> bool:
    """``--disable-chunked-mm-input``, forced on for models whose image tokens attend to
    each other both ways (their images' tokens must be computed in one step).

    Raises:
        ConfigError: images kept whole, on a model whose images all take the same number
            of tokens (LLaVA, Gemma 3), with a step budget below that number: no image
            could ever be scheduled.
    """
    if model_config.multimodal_config is None:
        return bool(args.disable_chunked_mm_input)
    forced = model_config.architecture in BIDIRECTIONAL_IMAGE_ARCHITECTURES
    if not forced and not args.disable_chunked_mm_input:
        return False
    from tokenmill.multimodal.processor import fixed_tokens_per_image

    per_image = fixed_tokens_per_image(model_config.hf_config)
    if per_image and max_tokens < per_image:
        why = (f"{model_config.architecture}'s image tokens attend to each other both ways"
               if forced else "--disable-chunked-mm-input keeps images whole")  # fmt: skip
        raise ConfigError(
            f"--max-num-batched-tokens {max_tokens} is below the {per_image} tokens of one "
            f"image: {why}, so an image's tokens are computed in one step"
        )
    return True


def _async_scheduling(args: Any, device: str, speculative: bool) -> bool:
    if speculative:
        # NOTE: the next step's drafts are proposed from this step's accepted tokens, so
        # a speculating engine plans each step after the previous one's tokens are known.
        if args.async_scheduling:
            raise ConfigError(
                "--async-scheduling does not combine with --speculative-config yet: "
                "speculative decoding plans each step after the previous one"
            )
        return False
    if args.async_scheduling is None:
        return device == "cuda" and args.pipeline_parallel_size == 1
    return args.async_scheduling

def _prefill_pacing_tokens(args: Any, device: str, server: bool) -> int:
    if args.prefill_pacing_tokens is not None:
        return args.prefill_pacing_tokens
    # Pacing makes most steps mix prompt chunks with decodes; only the piecewise CUDA
    # graphs make those cheap, so eager servers keep full-budget steps.
    paced = (
        server and device == "cuda" and args.enable_chunked_prefill and not args.enforce_eager
    )
    return SERVING_PACING_TOKENS if paced else 0


def _check_token_table_fits(max_num_seqs: int, max_model_len: int) -> None:
    """The worker keeps every running request's token ids in a host table of
    ``max_num_seqs x max_model_len`` int32 (``worker/input_batch.py``): refuse, before the
    model loads, a table larger than the machine's memory.

    Raises:
        ConfigError: the table would not fit.
    """
    table_bytes = 4 * max_num_seqs * max_model_len
    try:
        memory_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (not POSIX): unchecked
        return
    if table_bytes > memory_bytes:
        raise ConfigError(
            f"--max-num-seqs {max_num_seqs} with --max-model-len {max_model_len} needs a "
            f"{table_bytes / 2**30:,.1f} GiB table of token ids in host memory, more than "
            f"this machine's {memory_bytes / 2**30:,.1f} GiB: lower one of them"
        )

"""EngineArgs: every engine flag, its default and its help, in one place.

The CLI (``tokenmill serve``, ``tokenmill bench``) is generated from these fields, and
``LLM(**kwargs)`` takes the same names, so vLLM users can keep their flags. A flag that is
accepted works; values tokenmill does not implement are rejected with a clear message.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.arg_types import (
    add_dataclass_flags,
    byte_size_arg,
    human_readable_int,
)
from tokenmill.arg_types import flag as _flag
from tokenmill.config import (
    LOGPROBS_MODES,
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    KernelConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
)
from tokenmill.core.prefill_pacing import SERVING_PACING_TOKENS
from tokenmill.distributed.config_checks import (
    BACKENDS,
    check_device_count,
    check_parallel_features,
    check_parallel_layout,
    parallel_config_from_flags,
)
from tokenmill.feature_checks import check_feature_combinations, check_kv_cache_dtype
from tokenmill.flag_checks import KV_CACHE_DTYPES, check_flag_values
from tokenmill.lora.config import LORA_DTYPES, check_lora_model, create_lora_config
from tokenmill.model_config_args import (
    create_model_config,
    default_model_path,  # noqa: F401 (the API's name for it)
)
from tokenmill.scheduler_flags import create_scheduler_config
from tokenmill.spec_decode.config import parse_speculative_json, resolve_speculative_config

logger = logging.getLogger(__name__)

UsageContext = Literal["llm", "server"]

# KV cache on CPU when --kv-cache-memory is not given: suits a 24 GiB machine.
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


# --kv-cache-dtype values (vLLM's spellings; fp8 is e4m3).


@dataclass
class EngineArgs:
    """Engine flags (vLLM names). ``None`` means "resolved from the model or the device"."""

    model: str | None = _flag(
        "Model folder (Hugging Face layout) or .gguf file. Default: the embedded "
        "SmolLM2-135M-Instruct.",
    )
    tokenizer: str | None = _flag("Tokenizer folder or .gguf file (default: the model).")
    tokenizer_mode: str = _flag(
        "auto or hf: the model's Hugging Face fast tokenizer (tokenizer.json) or its GGUF "
        "vocabulary; vLLM's slow, mistral and custom modes are refused.",
        default="auto",
        choices=["auto", "hf", "slow", "mistral", "custom"],
    )
    served_model_name: str | list[str] | None = _flag(
        "Name(s) clients use for the model: requests may name any of them, responses carry "
        "the first (default: the model path's base name; SmolLM2-135M-Instruct for the "
        "embedded default model).",
        nargs="+",
    )
    dtype: str = _flag(
        "Weights/activations dtype; auto = bfloat16 on CUDA, float32 on CPU.",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
    )
    max_model_len: int | None = _flag(
        "Longest context (prompt + output tokens), also as 1k (1,000) or 1K (1,024). Default: "
        "the model's; -1: the largest that fits the KV cache.",
        type=human_readable_int,
    )
    seed: int = _flag("Seed of the engine's random state.", default=0)
    load_format: str = _flag(
        "Weights format; dummy = random weights (benchmarks).",
        default="auto",
        choices=["auto", "safetensors", "gguf", "dummy"],
    )
    device: str = _flag("Device.", default="auto", choices=["auto", "cuda", "cpu"])
    block_size: int = _flag("Tokens per KV-cache block.", default=16, choices=[8, 16, 32, 64, 128])
    gpu_memory_utilization: float = _flag(
        "Fraction of GPU memory for weights, activations and KV cache (CUDA).", default=0.9
    )
    kv_cache_memory: str | None = _flag(
        "KV cache size in bytes (e.g. 4GiB); overrides --gpu-memory-utilization. "
        f"CPU default: {DEFAULT_CPU_KV_CACHE_BYTES >> 30} GiB.",
        aliases=["--kv-cache-memory-bytes"],
        type=byte_size_arg,
    )
    num_gpu_blocks_override: int | None = _flag(
        "KV cache blocks to allocate, whatever the memory sizing finds (vLLM's flag, for "
        "testing preemption and small caches); must be positive."
    )
    kv_cache_dtype: str = _flag(
        "Data type of the KV cache: auto (the model's dtype); fp8 or fp8_e4m3 "
        "(float8_e4m3fn), fp8_e5m2: one byte per element, twice the tokens per GiB, scaled by "
        "the checkpoint's per-layer k_scale/v_scale where it has them (else 1.0).",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
    )
    enable_prefix_caching: bool = _flag(
        "Reuse KV blocks of identical prompt prefixes (automatic prefix caching).", default=True
    )
    max_num_seqs: int | None = _flag(
        "Most requests running at once. Default: 1024 on CUDA; 256 (offline) / 128 (server) on CPU."
    )
    max_num_batched_tokens: int | None = _flag(
        "Token budget of one step. Default: 16384 (offline) / 8192 (server) on CUDA; "
        "4096 / 2048 on CPU."
    )
    kv_offloading_size: float | None = _flag(
        "GiB of host memory for a second KV tier (vLLM's flag): prefix-cache blocks evicted "
        "from the device move there, and a later request whose prefix is there loads it "
        "back instead of computing it again. With -tp, the total over the ranks (each holds "
        "its share). Off by default."
    )
    kv_offloading_backend: str | None = _flag(
        "How KV blocks are offloaded: native (the default with --kv-offloading-size).",
        choices=["native", "lmcache"],
    )
    kv_offloading_disk_path: str | None = _flag(
        "Folder for a third KV tier on disk, behind the host tier: blocks evicted from host "
        "memory move there (needs --kv-offloading-size and --kv-offloading-disk-size)."
    )
    kv_offloading_disk_size: float | None = _flag(
        "GiB of the disk tier (with --kv-offloading-disk-path); with -tp, the total over the "
        "ranks."
    )
    enable_chunked_prefill: bool = _flag("Split long prompts across steps.", default=True)
    scheduling_policy: str = _flag(
        "fcfs: arrival order; priority: by the request's priority, then arrival.",
        default="fcfs",
        choices=["fcfs", "priority"],
    )
    long_prefill_token_threshold: int = _flag(
        "If > 0, a prompt chunk takes at most this many tokens of a step.", default=0
    )
    disable_chunked_mm_input: bool = _flag(
        "Never split an image's placeholder tokens over two prompt chunks: a chunk that "
        "would end inside an image ends before it (always on for Gemma 3, whose image "
        "tokens attend to each other both ways).",
        default=False,
    )
    stream_interval: int = _flag(
        "Streamed responses send a request's tokens in chunks of this many (the first token "
        "and the last chunk at once): fewer, larger chunks cost the server less per token. "
        "1 sends every step's tokens.",
        default=1,
    )
    prefill_pacing_tokens: int | None = _flag(
        "If > 0, while requests decode, steps compute at most this many tokens (see "
        "--prefill-pacing-mode) of the queued prompts, up to two steps' budget of them (the "
        "excess is computed at once), so a short queue of prompts does not stall the "
        "decodes; 0 turns it off (full-budget steps). Needs chunked prefill. Default: "
        f"{SERVING_PACING_TOKENS} when serving on CUDA with chunked prefill and CUDA graphs, "
        "else 0.",
        default=None,
    )
    prefill_pacing_mode: str | None = _flag(
        "What --prefill-pacing-tokens counts. step: all of a paced step's tokens, its "
        "decodes first (Sarathi-Serve's token budget: the fastest decoding under load; the "
        "default). prompt: the prompt tokens of a paced step, beside its decodes (a lower "
        "TTFT and a little more throughput under load, for a higher TPOT); see "
        "benchmarks/RESULTS.md for the trade on an H200.",
        default=None,
        choices=["prompt", "step"],
    )
    async_scheduling: bool | None = _flag(
        "Overlap scheduling and output processing of the next step with the device's work "
        "on this one. Default: on for CUDA, off on CPU (where nothing runs asynchronously).",
        default=None,
    )
    tensor_parallel_size: int = _flag(
        "Tensor-parallel ranks: each layer's weights split over this many devices.",
        default=1,
        aliases=["-tp"],
    )
    pipeline_parallel_size: int = _flag(
        "Pipeline-parallel stages: the layers split into this many stages, one micro-batch "
        "in flight per stage.",
        default=1,
        aliases=["-pp"],
    )
    data_parallel_size: int = _flag(
        "Data-parallel replicas: this many engine cores behind one API server (serve only), "
        "each with tensor x pipeline parallel devices; requests go to the least loaded.",
        default=1,
        aliases=["-dp"],
    )
    enable_expert_parallel: bool = _flag(
        "MoE models: spread whole experts over the tensor-parallel ranks instead of "
        "splitting every expert.",
        default=False,
    )
    distributed_executor_backend: str | None = _flag(
        "How ranks run: mp (one process per rank on this node), ray (one Ray actor per "
        "rank, on the cluster RAY_ADDRESS names or a local one), uni (one rank, in the "
        "engine's process). Default: uni for one rank, else mp.",
        choices=list(BACKENDS),
    )
    disable_custom_all_reduce: bool = _flag(
        "Accepted as vLLM's flag: tensor-parallel all-reduces always run through "
        "torch.distributed (NCCL on GPUs), there is no custom all-reduce to turn off.",
        default=False,
    )
    enforce_eager: bool = _flag("Disable CUDA graphs (always eager).", default=False)
    disable_cascade_attn: bool = _flag(
        "Never use cascade attention, which reads a prompt prefix that all decoding "
        "requests of a step share (found by prefix caching) once instead of once per "
        "request. Outputs agree up to floating-point rounding either way.",
        default=False,
    )
    kernel_config: str | dict[str, Any] | KernelConfig | None = _flag(
        "Kernel choices, as a JSON object, e.g. '{\"skinny_gemm\": \"off\"}' (cuBLAS for "
        "every linear layer); fields: skinny_gemm (auto, all or off), cpu_bf16_weights "
        "(auto, on or off). Default: the measured fastest."
    )
    speculative_config: str | dict[str, Any] | None = _flag(
        "Speculative decoding, as a JSON object (vLLM's fields), e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
        '\'{"model": "path/to/draft", "num_speculative_tokens": 4}\'; methods: ngram, '
        "draft_model, eagle, eagle3, mtp. Default: off."
    )
    max_logprobs: int = _flag("Most logprobs a request may ask for per position.", default=20)
    logprobs_mode: str = _flag(
        "What returned logprobs hold: raw_logprobs (of the model's logits), raw_logits, "
        "processed_logprobs or processed_logits (after penalties, logits processors, "
        "temperature, min-p, top-k and top-p: the distribution tokens are drawn from). "
        "Prompt logprobs are always raw logprobs.",
        default="raw_logprobs",
        choices=list(LOGPROBS_MODES),
    )
    disable_log_stats: bool = _flag("Do not log engine statistics.", default=False)
    generation_config: str = _flag(
        "auto: take sampling defaults from the model's generation_config.json; vllm: "
        "ignore it; or a folder holding one.",
        default="auto",
    )
    quantization: str | None = _flag(
        "Quantization method of the weights: awq, gptq (or awq_marlin, gptq_marlin: the same "
        "checkpoints), compressed-tensors, bitsandbytes (also quantizes an unquantized "
        "checkpoint while loading), gguf or mxfp4 (gpt-oss' experts). Default: from the "
        "checkpoint's quantization_config, gguf for .gguf files.",
        aliases=["-q"],
    )
    gguf_dequantize: bool = _flag(
        "GGUF files: load the weights dequantized to --dtype instead of keeping them in their "
        "GGUF blocks (about 4x the weight memory in float32; the float path transformers "
        "computes, for comparisons).",
        default=False,
    )
    override_generation_config: str | dict[str, Any] | None = _flag(
        "Sampling defaults as a JSON object, e.g. '{\"temperature\": 0.5}' (fields: "
        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); merged over "
        "the model's generation_config.json with --generation-config auto, used alone with "
        "vllm."
    )
    hf_overrides: str | dict[str, Any] | None = _flag(
        "Keys of the model's config.json to replace, as a JSON object, e.g. "
        "'{\"max_position_embeddings\": 65536}' (applied before the config is checked)."
    )
    pooler_config: str | dict[str, Any] | None = _flag(
        "Embedding models: a JSON object overriding the pooling of the model folder's "
        'sentence-transformers files, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
        "(pooling_type MEAN, CLS or LAST)."
    )
    limit_mm_per_prompt: str | dict[str, Any] | None = _flag(
        "Models that take images: the most images one prompt may carry, as a JSON object, "
        "e.g. '{\"image\": 4}' (default: 999); 0 refuses images."
    )
    mm_processor_kwargs: str | dict[str, Any] | None = _flag(
        "Models that take images: keyword arguments for the model's image processor, as a "
        "JSON object, e.g. '{\"max_pixels\": 1003520}' (Qwen2.5-VL: fewer pixels, fewer "
        "image tokens); checked on a test image at start-up."
    )
    allowed_media_domains: list[str] | None = _flag(
        "Hosts whose http(s) image URLs the server fetches (at most 20 MB each, within 10 s); "
        "without it image URLs are refused and images come as base64 data URLs.",
        nargs="+",
    )
    disable_sliding_window: bool = _flag(
        "Models with sliding-window layers (Mistral, Gemma 2/3, gpt-oss, ...): every layer "
        "attends to the whole context, and the context is capped to the window (as vLLM's).",
        default=False,
    )
    allowed_local_media_path: str | None = _flag(
        "A folder whose image files requests may name as file:///path URLs (each at most 20 "
        "MB; links are resolved, so none leads out of it). Any client of the server can then "
        "read the images in it: only for trusted clients. Without it file URLs are refused."
    )
    enable_sleep_mode: bool = _flag(
        "Let the engine sleep (POST /sleep, LLM.sleep): level 1 frees the weights (kept in "
        "host memory) and the KV cache, level 2 drops the weights too; /wake_up brings them "
        "back and /update_weights loads new ones in place.",
        default=False,
    )
    trust_remote_code: bool = _flag(
        "Accepted for compatibility: tokenmill never runs code from a model folder.",
        default=False,
    )
    enable_lora: bool = _flag("Serve LoRA adapters (PEFT folders) on the model.", default=False)
    lora_modules: list[str] | None = _flag(
        "Adapters served from start-up: name=path, or a JSON object "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\' (the flag may repeat).',
        nargs="+",
        action="extend",
    )
    max_loras: int = _flag("Adapter slots on the device: distinct adapters per step.", default=1)
    max_lora_rank: int = _flag("Largest adapter rank (the slots' rank).", default=16)
    max_cpu_loras: int | None = _flag(
        "Adapters kept loaded in host memory, least recently used evicted (default: "
        "--max-loras)."
    )
    lora_dtype: str = _flag(
        "Dtype of the adapter slots (auto: the model's).",
        default="auto",
        choices=list(LORA_DTYPES),
    )
    fully_sharded_loras: bool = _flag(
        "By default only half of the LoRA computation is sharded with tensor parallelism "
        "(B of column-parallel layers, A of row-parallel ones); this shards all of it: each "
        "rank holds 1/tp of every adapter, for one more small collective per projection. Needs "
        "--max-lora-rank divisible by --tensor-parallel-size.",
        default=False,
    )

    # ---- CLI -------------------------------------------------------------------------

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        positional_model: bool = False,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        """Add one flag per field (``--max-num-seqs`` for ``max_num_seqs``); ``defaults``
        replaces some fields' defaults for this command (value and help text)."""
        group = parser.add_argument_group("engine")
        add_dataclass_flags(group, cls, defaults, skip={"model"} if positional_model else ())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    # ---- resolution ------------------------------------------------------------------

    def create_engine_config(self, usage_context: UsageContext = "llm") -> EngineConfig:
        """Resolve every ``auto``/``None`` and check the combination.

        Raises:
            ConfigError: an invalid or unimplemented value (the message names the flag).
            ModelLoadError: the model cannot be read.
        """
        kv_bytes = check_flag_values(self)
        kernel_config = KernelConfig.parse(self.kernel_config)
        parallel_config = parallel_config_from_flags(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.data_parallel_size,
            self.enable_expert_parallel,
            self.distributed_executor_backend,
            server=usage_context == "server",
            async_scheduling=self.async_scheduling,
        )
        speculative_fields = parse_speculative_json(self.speculative_config)
        if speculative_fields is not None and self.enable_lora:
            raise ConfigError("--speculative-config does not combine with --enable-lora yet")
        device = self._resolve_device()
        check_device_count(parallel_config, device)
        model_config = create_model_config(self, device)
        check_parallel_layout(model_config, parallel_config)
        check_parallel_features(
            parallel_config,
            kv_offloading=bool(self.kv_offloading_size),
            speculative=speculative_fields is not None,
            fp8_kv_cache=self.kv_cache_dtype.startswith("fp8"),
        )
        check_feature_combinations(
            model_config,
            speculative=speculative_fields is not None,
            lora=self.enable_lora,
            kv_cache_dtype=self.kv_cache_dtype,
            enable_sleep_mode=self.enable_sleep_mode,
            kv_offloading=bool(self.kv_offloading_size),
            model_parallel_size=(
                parallel_config.tensor_parallel_size * parallel_config.pipeline_parallel_size
            ),
        )
        speculative_config = None
        if speculative_fields is not None:
            if model_config.is_pooling_model:
                raise ConfigError("--speculative-config applies to generative models only")
            speculative_config = resolve_speculative_config(
                speculative_fields, model_config, device
            )
        check_kv_cache_dtype(self.kv_cache_dtype, device)
        scheduler_config = create_scheduler_config(
            self, device, usage_context == "server", model_config, speculative_config is not None
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory=kv_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            cpu_kv_cache_memory=DEFAULT_CPU_KV_CACHE_BYTES,
            kv_offloading_bytes=int((self.kv_offloading_size or 0) * (1 << 30)),
            kv_offloading_disk_path=self.kv_offloading_disk_path,
            kv_offloading_disk_bytes=int((self.kv_offloading_disk_size or 0) * (1 << 30)),
            cache_dtype=self.kv_cache_dtype,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
        )
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            parallel_config=parallel_config,
            load_config=LoadConfig(self.load_format),  # type: ignore[arg-type]
            device_config=DeviceConfig(device),  # type: ignore[arg-type]
            kernel_config=kernel_config,
            speculative_config=speculative_config,
            enforce_eager=self.enforce_eager or device != "cuda",
            disable_cascade_attn=self.disable_cascade_attn,
            disable_log_stats=self.disable_log_stats,
            max_model_len_auto=self.max_model_len == -1,
            enable_sleep_mode=self.enable_sleep_mode,
            lora_config=self._create_lora_config(model_config),
        )

    def _create_lora_config(self, model_config: ModelConfig) -> LoRAConfig | None:
        """``--enable-lora`` and its flags (``tokenmill.lora.config``), checked.

        Raises:
            ConfigError: an invalid LoRA flag or ``--lora-modules`` folder, an adapter
                named as the base model, or LoRA on a model it does not apply to.
        """
        try:
            config = create_lora_config(
                self.enable_lora, self.lora_modules, self.max_loras, self.max_lora_rank,
                self.max_cpu_loras, self.lora_dtype, self.fully_sharded_loras,
                self.tensor_parallel_size,
            )  # fmt: skip
            if config is not None:
                for module in config.lora_modules:
                    if module.name in model_config.served_model_names:
                        raise ValueError(
                            f"--lora-modules: {module.name!r} is the base model's served "
                            "name; give the adapter another name"
                        )
                check_lora_model(config, model_config.is_pooling_model,
                                 model_config.quantization, model_config.is_gguf)  # fmt: skip
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if config is not None and model_config.multimodal_config is not None:
            raise ConfigError("--enable-lora is not implemented for models that take images")
        return config

    def _resolve_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available")
        return self.device

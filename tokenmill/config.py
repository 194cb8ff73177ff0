"""Engine configuration: a handful of typed dataclasses and EngineArgs, which maps CLI flags
and ``LLM(**kwargs)`` onto them (one place for every default).

The dataclasses here hold resolved values only; EngineArgs (engine_args.py) does the
resolution (``auto`` dtype, device defaults, the model's context length).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_type_hints

from tokenmill.arg_types import json_object
from tokenmill.hf_config import HFConfig
from tokenmill.multimodal.config import MultiModalConfig

DType = Literal["float32", "bfloat16", "float16"]
LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]
SkinnyGemm = Literal["auto", "all", "off"]
CpuBf16Weights = Literal["auto", "on", "off"]
MoEPromptExperts = Literal["auto", "grouped_gemm", "loop"]
SpeculativeMethod = Literal["ngram", "draft_model", "eagle", "eagle3", "mtp"]
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and why."""


def check_kv_offloading_flags(
    size: float | None,
    backend: str | None,
    disk_path: str | None,
    disk_size: float | None,
    enable_prefix_caching: bool,
) -> None:
    """Check the KV offloading flags together (sizes in GiB; None: not given).

    Raises:
        ConfigError: LMCache, a size that is not positive, a backend or disk tier without
            the host tier, a disk path without its size (or the reverse), or offloading
            without prefix caching.
    """
    if backend == "lmcache":
        raise ConfigError(
            "--kv-offloading-backend lmcache: tokenmill does not implement LMCache; "
            "native offloading is built in"
        )
    if backend is not None and size is None:
        raise ConfigError("--kv-offloading-backend needs --kv-offloading-size GiB")
    for flag, value in (("size", size), ("disk-size", disk_size)):
        if value is not None and not value > 0:
            raise ConfigError(f"--kv-offloading-{flag} must be positive GiB, got {value}")
    if (disk_path is None) != (disk_size is None):
        raise ConfigError("--kv-offloading-disk-path and --kv-offloading-disk-size go together")
    if disk_path is not None and size is None:
        raise ConfigError(
            "--kv-offloading-disk-path needs --kv-offloading-size: the disk tier sits "
            "behind the host-memory tier"
        )
    if size is not None and not enable_prefix_caching:
        raise ConfigError(
            "--kv-offloading-size extends the prefix cache: it needs prefix caching "
            "(drop --no-enable-prefix-caching)"
        )
class UnsupportedQuantizationError(ConfigError):
    """The checkpoint's ``quantization_config`` or ``--quantization`` names a method or
    layout tokenmill does not run; the message names it and what is supported. The CLI
    exits with code 2 for it, as for an invalid flag."""


@dataclass
class PoolerConfig:
    """How an embedding model turns its token states into one vector per input.

    Attributes:
        pooling_type: "MEAN" (over real tokens), "CLS" (the first token) or "LAST" (the
            last real token); None: what the model folder's sentence-transformers files say.
        normalize: L2-normalize the pooled vector; None: as the model folder says.
    """

    pooling_type: str | None = None
    normalize: bool | None = None


@dataclass
class ModelConfig:
    """The model being served.

    Attributes:
        model: path of a Hugging Face model folder or a single ``.gguf`` file.
        tokenizer: path of the tokenizer (defaults to ``model``).
        served_model_name: the name clients use in the API, and that responses carry.
        served_model_aliases: further names requests may use (``--served-model-name a b``).
        hf_config: the model's config.json (or GGUF metadata mapped onto its keys).
        generation_config: the model's generation_config.json (may be empty).
        dtype: weights and activations dtype.
        max_model_len: the longest context (prompt + output, tokens) a request may use.
        seed: seed of the engine's random state (dummy weights, unseeded sampling).
        max_logprobs: the most logprobs a request may ask for per position.
        chat_template: a Jinja template (its text) that replaces the model's own.
        pooler_config: how token states become one embedding; set (resolved) for
            embedding models only, None for generative models.
        quantization: how the weights are quantized (``awq``, ``gptq``,
            ``compressed-tensors``, ``bitsandbytes``, ``gguf``), None when they are not (a
            GGUF file loaded with ``--gguf-dequantize`` included).
        multimodal_config: image limits and sources; set for models that take images.
        logprobs_mode: what sampled positions' logprobs hold (vLLM's ``--logprobs-mode``):
            ``raw_logprobs`` (log-softmax of the model's logits), ``raw_logits``, or
            ``processed_logprobs`` / ``processed_logits`` (after penalties, logits
            processors, temperature, min-p, top-k and top-p; dropped tokens at -inf).
    """

    model: str
    tokenizer: str
    served_model_name: str
    hf_config: HFConfig
    generation_config: dict[str, Any]
    dtype: DType
    max_model_len: int
    seed: int = 0
    max_logprobs: int = 20
    chat_template: str | None = None
    pooler_config: PoolerConfig | None = None
    served_model_aliases: tuple[str, ...] = ()
    quantization: str | None = None
    multimodal_config: MultiModalConfig | None = None
    logprobs_mode: LogprobsMode = "raw_logprobs"

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name the API answers to, the one responses carry first."""
        return (self.served_model_name, *self.served_model_aliases)

    @property
    def architecture(self) -> str:
        return self.hf_config.architectures[0]

    @property
    def is_pooling_model(self) -> bool:
        """An embedding model: served by the embedding engine, not the generation engine."""
        return self.pooler_config is not None

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.hf_config.max_position_embeddings

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids from generation_config.json (preferred, as vLLM does) or config.json."""
        eos = self.generation_config.get("eos_token_id")
        if eos is None:
            eos = self.hf_config.get("eos_token_id")
        if eos is None:
            return []
        return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]

    def get_num_kv_heads(self) -> int:
        c = self.hf_config
        return c.get("num_key_value_heads") or c.num_attention_heads

    def get_head_dim(self) -> int:
        c = self.hf_config
        return c.get("head_dim") or c.hidden_size // c.num_attention_heads

    def get_num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def use_mla(self) -> bool:
        """The model's attention is multi-head latent attention (DeepSeek-V2/V3 configs set
        ``kv_lora_rank``): its KV cache holds one compressed latent per token."""
        return bool(self.hf_config.get("kv_lora_rank"))


@dataclass
class CacheConfig:
    """The paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        gpu_memory_utilization: fraction of the GPU's memory the engine may use
            (weights + activations + KV cache), CUDA only.
        kv_cache_memory: if set, the KV cache gets exactly this many bytes.
        enable_prefix_caching: reuse the KV of identical prompt prefixes across requests.
        cpu_kv_cache_memory: KV cache bytes on CPU when ``kv_cache_memory`` is unset.
        cache_dtype: ``auto`` (the model's dtype), ``fp8`` / ``fp8_e4m3`` (float8_e4m3fn)
            or ``fp8_e5m2``: K and V stored in one byte each, divided by the layer's
            per-tensor scale (the checkpoint's ``k_scale`` / ``v_scale``, else 1.0).
        num_blocks: filled in once the worker has sized the cache.
        num_gpu_blocks_override: if set, the cache gets exactly this many blocks, whatever
            the memory sizing found (vLLM's flag, for tests of preemption and small caches).
        kv_offloading_bytes: size of the host-memory tier that prefix-cache blocks evicted
            from the device move to (0: none); see ``tokenmill.core.kv_offload``.
        kv_offloading_disk_path: folder of the disk tier behind the host tier, or None.
        kv_offloading_disk_bytes: size of the disk tier.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    cpu_kv_cache_memory: int = 4 << 30
    cache_dtype: str = "auto"
    num_blocks: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_offloading_bytes: int = 0
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_bytes: int = 0


@dataclass
class SchedulerConfig:
    """The iteration-level scheduler.

    Attributes:
        max_num_batched_tokens: token budget of one step (all requests together).
        max_num_seqs: the most requests running at once.
        max_model_len: copied from ModelConfig (the scheduler caps requests with it).
        enable_chunked_prefill: split long prompts over several steps; when off, a
            prompt is scheduled whole (so it must fit in the token budget).
        scheduling_policy: ``fcfs`` (arrival order) or ``priority`` (lower value first,
            then arrival order).
        long_prefill_token_threshold: if > 0, a prompt chunk takes at most this many
            tokens of a step, so long prompts do not starve decodes.
        async_scheduling: schedule step n+1 while step n runs on the device (each
            running request is assumed to get one token; a stop is seen one step late).
        admission_headroom: admit a waiting request only if the blocks left free cover
            the running requests' expected growth (``tokenmill.core.admission``), so a
            KV-bound load preempts (and recomputes) far less.
        prefill_pacing_tokens: if > 0 (and chunked prefill is on), the most prompt tokens
            a step computes while other requests decode, of the queued prompt work up to
            two steps' budget (``tokenmill.core.prefill_pacing``).
        prefill_pacing_mode: what ``prefill_pacing_tokens`` counts: ``step`` (all of a
            paced step's tokens, its decodes first) or ``prompt`` (the prompt tokens of a
            paced step, beside its decodes).
        stream_interval: streamed (DELTA) outputs carry a request's tokens in chunks of at
            least this many, but for its first output and its last (vLLM's).
        disable_chunked_mm_input: an image's placeholders are never split over two
            prompt chunks (vLLM's): a chunk that would end inside one ends before it, and
            one that starts inside it (after a prefix-cache hit) takes all of its rest,
            past ``long_prefill_token_threshold`` and prefill pacing. Always on for models
            whose image tokens attend to each other both ways (Gemma 3).
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = False
    admission_headroom: bool = True
    prefill_pacing_tokens: int = 0
    prefill_pacing_mode: Literal["prompt", "step"] = "step"
    stream_interval: int = 1
    disable_chunked_mm_input: bool = False


DistributedExecutorBackend = Literal["uni", "mp", "ray"]


@dataclass
class ParallelConfig:
    """How the model is split over devices, processes and engine cores.

    Ranks are numbered ``pp_rank * tensor_parallel_size + tp_rank``: the ranks of one
    tensor-parallel group are neighbours (one node, the fastest links), as in Megatron-LM
    and vLLM.

    Attributes:
        tensor_parallel_size: ranks each layer's weights are split over (TP).
        pipeline_parallel_size: stages the layers are split into (PP).
        data_parallel_size: engine cores behind one API server, each with its own
            ``tensor_parallel_size x pipeline_parallel_size`` ranks (DP).
        enable_expert_parallel: MoE layers hold whole experts, spread over the
            tensor-parallel ranks (EP), instead of a slice of every expert.
        distributed_executor_backend: how an engine core runs its ranks: ``uni`` (one
            worker in the engine core's process), ``mp`` (one process per rank) or ``ray``
            (one Ray actor per rank, placed by a placement group).
        data_parallel_rank: which of the ``data_parallel_size`` engine cores this is.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: DistributedExecutorBackend = "uni"
    data_parallel_rank: int = 0

    @property
    def world_size(self) -> int:
        """Ranks of one engine core: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class LoadConfig:
    """Where weights come from: ``auto`` picks safetensors or GGUF by the model path."""

    load_format: LoadFormat = "auto"


@dataclass
class DeviceConfig:
    """The device the model runs on: ``cuda`` or ``cpu``."""

    device: Literal["cuda", "cpu"] = "cpu"


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts tokens, one target forward pass verifies them
    and rejection sampling keeps the target's distribution (``tokenmill.spec_decode``).
    Resolved from ``--speculative-config`` by ``tokenmill.spec_decode.config``.

    Attributes:
        method: where drafts come from: ``ngram`` (prompt lookup in the request's own
            tokens), ``draft_model`` (a smaller model sharing the tokenizer), ``eagle`` /
            ``eagle3`` (an EAGLE head reading the target's hidden states), ``mtp`` (the
            target's own multi-token-prediction layers).
        num_speculative_tokens: draft tokens proposed per request and step (k).
        model: the draft model or EAGLE head (folder or .gguf); None for ngram and mtp.
        prompt_lookup_min: ngram: the shortest suffix n-gram looked up.
        prompt_lookup_max: ngram: the longest suffix n-gram looked up.
        draft_model_config: the draft's (or EAGLE head's) model configuration, else None.
        draft_tensor_parallel_size: ranks of the draft model (1).
    """

    method: SpeculativeMethod
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    draft_model_config: ModelConfig | None = None
    draft_tensor_parallel_size: int = 1

    @property
    def uses_draft_kv_cache(self) -> bool:
        """Whether the proposer runs layers with a KV cache of their own (every method but
        ngram): each KV block then also holds the draft's KV of the same tokens."""
        return self.method != "ngram"

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots a request needs past the tokens a step computes: a proposer with a KV
        cache writes its drafts' KV there, up to k positions ahead."""
        return self.num_speculative_tokens if self.uses_draft_kv_cache else 0


@dataclass(frozen=True)
class KernelConfig:
    """Which kernel computes a product where tokenmill has more than one. The defaults are
    the measured fastest; other values are for machines and shapes where they were not
    measured, and for diagnosis.

    Attributes:
        skinny_gemm: linear layers of decode-sized batches (at most 32 rows, bf16/fp16
            weights of at least 1 MiB): ``"auto"`` runs the Triton skinny GEMM for the
            shapes tuned on this GPU model (Llama-3.1-8B's on an H200) and cuBLAS for the
            rest; ``"all"`` the skinny GEMM for every such product; ``"off"`` cuBLAS for
            every product. FP8 weights take the skinny GEMM under "auto" and "all", and
            ``kernels.gemm.fp8.fp8_weight_gemm`` under "off".
        cpu_bf16_weights: quantized weights on the CPU (GGUF blocks, AWQ/GPTQ int4) also
            keep a bfloat16 copy, which the prompt tokens' products run on (generated
            tokens stay on the int4 kernel; ``tokenmill.kernels.quant.int4_cpu``), at two
            more bytes per weight: ``"auto"`` where the CPU has bfloat16 dot products
            (AVX-512 BF16 or AMX), ``"on"`` always, ``"off"`` never (every product on the
            int4 kernel).
        moe_prompt_experts: the routed experts of steps too large for the fused MoE
            kernel (eager steps from 2,048 tokens; MXFP4 experts from 12,288 under
            "auto" and "loop"), on CUDA: ``"auto"`` and ``"loop"`` one pair of cuBLAS
            products per expert that got tokens (MXFP4 experts decoded one at a time),
            ``"grouped_gemm"`` torch's grouped GEMM over every expert at once (no
            read-back of the per-expert counts; MXFP4 experts decoded into bfloat16 for
            each product, a transient buffer of all of a layer's experts).
    """

    skinny_gemm: SkinnyGemm = "auto"
    cpu_bf16_weights: CpuBf16Weights = "auto"
    moe_prompt_experts: MoEPromptExperts = "auto"

    @classmethod
    def parse(cls, value: KernelConfig | dict[str, Any] | str | None) -> KernelConfig:
        """``--kernel-config`` (a JSON object), a dict or a KernelConfig -> KernelConfig;
        None gives the defaults.

        Raises:
            ConfigError: not a JSON object, an unknown field or a value it cannot take.
        """
        if value is None or isinstance(value, cls):
            return value or cls()
        try:
            value = json_object(value, "--kernel-config")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ConfigError(
                f"--kernel-config: unknown field(s) {unknown}; known: {', '.join(fields)}"
            )
        hints = get_type_hints(cls)
        for name, choice in value.items():
            allowed = get_args(hints[name])  # the field's Literal values
            if choice not in allowed:
                raise ConfigError(
                    f"--kernel-config: {name} must be one of {', '.join(allowed)}, got {choice!r}"
                )
        return cls(**value)


# The kernel choices of the model being built (``kernel_config_scope``); None: the defaults.
_current_kernel_config: ContextVar[KernelConfig | None] = ContextVar(
    "current_kernel_config", default=None
)


@contextmanager
def kernel_config_scope(config: KernelConfig) -> Iterator[None]:
    """Layers built inside the block take their kernel choices from ``config``
    (``current_kernel_config``); the model loader wraps model construction in it, as
    ``torch.device`` wraps it for the device."""
    token = _current_kernel_config.set(config)
    try:
        yield
    finally:
        _current_kernel_config.reset(token)


def current_kernel_config() -> KernelConfig:
    """The kernel choices of the model being built; the defaults outside
    ``kernel_config_scope``."""
    return _current_kernel_config.get() or KernelConfig()


@dataclass(frozen=True)
class LoRAModule:
    """An adapter given at start-up (``--lora-modules``)."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass
class LoRAConfig:
    """Resolved LoRA settings of an engine.

    Attributes:
        max_loras: adapter slots on the device: the most distinct adapters in one step.
        max_lora_rank: the largest rank an adapter may have (the slots' rank).
        max_cpu_loras: adapters kept loaded in host memory (an LRU, >= max_loras).
        lora_dtype: the slots' dtype (``auto``: the model's).
        lora_modules: adapters to serve from start-up.
        fully_sharded_loras: under tensor parallelism, shard every adapter's A and B over
            the ranks (``tokenmill.lora.layers``), not only the halves the base layers'
            split dictates.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    lora_dtype: str = "auto"
    lora_modules: list[LoRAModule] = field(default_factory=list)
    fully_sharded_loras: bool = False

    def resolved_dtype(self, model_dtype: str) -> str:
        return model_dtype if self.lora_dtype == "auto" else self.lora_dtype


@dataclass
class EngineConfig:
    """Everything the engine needs, resolved."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    kernel_config: KernelConfig = field(default_factory=KernelConfig)
    speculative_config: SpeculativeConfig | None = None
    enforce_eager: bool = False
    disable_cascade_attn: bool = False
    disable_log_stats: bool = False
    # --max-model-len -1: the worker shrinks max_model_len to what the KV cache holds.
    max_model_len_auto: bool = False
    # --enable-sleep-mode: the engine can free its weights and KV cache (worker/sleep_mode.py).
    enable_sleep_mode: bool = False
    # --enable-lora: adapter slots and the adapters served from start-up; None: off.
    lora_config: LoRAConfig | None = None

"""Start-up checks of a parallel layout against the model and the machine, each failing in
one line (``ConfigError``) before anything loads, in vLLM's terms where vLLM has one."""

from __future__ import annotations

import importlib.util
import logging
import socket
from urllib.parse import urlparse

from tokenmill import envs
from tokenmill.config import ConfigError, ModelConfig, ParallelConfig

logger = logging.getLogger(__name__)

BACKENDS = ("uni", "mp", "ray")
# Architectures whose layers split over tensor-parallel ranks and pipeline stages (their
# models build stage layers and shard heads, experts and vocabulary). The others (MLA,
# attention sinks, vision encoders, ...) run on one device.
PARALLEL_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
)
# How long a Ray address may take to accept a connection before start-up fails (s).
RAY_CONNECT_TIMEOUT_S = 5.0


def resolve_executor_backend(backend: str | None, world_size: int) -> str:
    """``--distributed-executor-backend``: ``uni`` for one rank, else ``mp`` unless given
    (one of ``BACKENDS``: ``EngineArgs`` refuses others).

    Raises:
        ConfigError: ``uni`` with more than one rank.
    """
    if backend is None:
        return "uni" if world_size == 1 else "mp"
    if backend == "uni" and world_size > 1:
        raise ConfigError(
            f"--distributed-executor-backend uni runs one rank, but the layout has {world_size} "
            "(tensor x pipeline parallel size): use mp or ray"
        )
    return backend


def parallel_config_from_flags(
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    data_parallel_size: int,
    enable_expert_parallel: bool,
    distributed_executor_backend: str | None,
    server: bool,
    async_scheduling: bool | None,
) -> ParallelConfig:
    """The parallel layout of the flags, with the checks that need no model (those that do
    come once its config is read: ``check_parallel_layout``).

    Raises:
        ConfigError: a size below 1; data parallelism offline; an unknown or unfit
            executor backend; Ray missing, or a ``RAY_ADDRESS`` that does not answer;
            ``--async-scheduling`` with pipeline parallelism.
    """
    pc = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        data_parallel_size=data_parallel_size,
        enable_expert_parallel=enable_expert_parallel,
    )
    for flag, value in (
        ("tensor", tensor_parallel_size),
        ("pipeline", pipeline_parallel_size),
        ("data", data_parallel_size),
    ):
        if value < 1:
            raise ConfigError(f"--{flag}-parallel-size must be at least 1, got {value}")
    if data_parallel_size > 1 and not server:
        raise ConfigError(
            f"--data-parallel-size {data_parallel_size} runs engine cores behind "
            "`tokenmill serve`; offline, run one LLM per replica"
        )
    backend = resolve_executor_backend(distributed_executor_backend, pc.world_size)
    pc.distributed_executor_backend = backend  # type: ignore[assignment]
    if backend == "ray":
        if importlib.util.find_spec("ray") is None:
            raise ConfigError(
                "--distributed-executor-backend ray needs Ray: pip install 'tokenmill[ray]'"
            )
        check_ray_address(envs.ray_address())
    if pipeline_parallel_size > 1 and async_scheduling:
        raise ConfigError(
            "--async-scheduling does not apply with pipeline parallelism: the stages overlap "
            "micro-batches instead"
        )
    return pc


def check_parallel_features(
    pc: ParallelConfig,
    *,
    kv_offloading: bool,
    speculative: bool = False,
    fp8_kv_cache: bool = False,
) -> None:
    """Engine features that several ranks do not carry yet (beam search is refused per
    request under pipeline parallelism, ``InputProcessor``).

    Sleep mode runs on every rank (each frees its stage's share); the KV offload tiers run
    under tensor parallelism, where every rank's share of a block has the same size.

    Raises:
        ConfigError: ``--kv-offloading-size`` with pipeline parallelism (stages of
            different depths hold blocks of different sizes); ``--speculative-config`` or
            an FP8 ``--kv-cache-dtype`` with more than one rank (tensor, pipeline or data
            parallel).
    """
    pp = pc.pipeline_parallel_size
    sizes = (
        f"--tensor-parallel-size {pc.tensor_parallel_size}, --pipeline-parallel-size {pp}, "
        f"--data-parallel-size {pc.data_parallel_size}"
    )
    ranks = pc.tensor_parallel_size * pp * pc.data_parallel_size
    for flag, on in (
        ("--speculative-config", speculative),
        ("--kv-cache-dtype fp8", fp8_kv_cache),
    ):
        if on and ranks > 1:
            raise ConfigError(f"{flag} is not implemented with parallelism yet ({sizes})")
    if pp > 1 and kv_offloading:
        raise ConfigError(
            f"--kv-offloading-size is not implemented with pipeline parallelism "
            f"(--pipeline-parallel-size {pp})"
        )


def num_experts(model_config: ModelConfig) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    c = model_config.hf_config
    return int(c.get("num_local_experts") or c.get("num_experts") or 0)


def check_parallel_layout(model_config: ModelConfig, pc: ParallelConfig) -> None:
    """Check that the model splits as asked.

    Raises:
        ConfigError: heads, KV heads or MLP widths that the tensor-parallel size does not
            divide; more stages than layers; an embedding model with more
            than one rank; an architecture outside ``PARALLEL_ARCHITECTURES`` with more
            than one rank per engine; expert parallelism across data-parallel ranks; GGUF
            blocks or quantized experts with tensor parallelism.
    """
    tp, pp, dp = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.data_parallel_size
    if model_config.is_pooling_model and pc.world_size * dp > 1:
        raise ConfigError(
            "embedding models run on one device: tensor, pipeline and data parallelism "
            "are for generative models"
        )
    arch = model_config.architecture
    if pc.world_size > 1 and arch not in PARALLEL_ARCHITECTURES:
        what = (
            "multi-head latent attention" if model_config.use_mla
            else "images" if model_config.multimodal_config is not None
            else arch
        )  # fmt: skip
        raise ConfigError(
            f"{arch} ({what}) does not split over tensor-parallel ranks or pipeline stages "
            f"yet (-tp {tp} -pp {pp}): run it on one device per engine (-dp replicates it)"
        )
    c = model_config.hf_config
    heads = c.num_attention_heads
    if heads % tp:
        raise ConfigError(
            f"Total number of attention heads ({heads}) must be divisible by tensor parallel "
            f"size ({tp})."
        )
    kv_heads = model_config.get_num_kv_heads()
    if (kv_heads >= tp and kv_heads % tp) or (kv_heads < tp and tp % kv_heads):
        raise ConfigError(
            f"Total number of KV heads ({kv_heads}) and tensor parallel size ({tp}) must divide "
            "one another (KV heads are split, or replicated when there are fewer than ranks)."
        )
    if pp > model_config.get_num_layers():
        raise ConfigError(
            f"pipeline parallel size ({pp}) is larger than the number of layers "
            f"({model_config.get_num_layers()})"
        )
    _check_mlp(model_config, pc)
    _check_quantization(model_config, pc)


def _check_quantization(model_config: ModelConfig, pc: ParallelConfig) -> None:
    """GGUF blocks and quantized experts are held whole by one rank (their kernels take
    whole tensors); the other methods split as the float weights do."""
    tp, method = pc.tensor_parallel_size, model_config.quantization
    if tp == 1 or method is None:
        return
    if method == "gguf":
        raise ConfigError(
            f"GGUF weights kept quantized do not split over {tp} tensor-parallel ranks: add "
            "--gguf-dequantize to load them dequantized, or use -pp"
        )
    if num_experts(model_config):
        raise ConfigError(
            f"quantized experts ({method}) do not split over {tp} tensor-parallel ranks yet: "
            "use -pp, or an unquantized checkpoint"
        )


def _check_mlp(model_config: ModelConfig, pc: ParallelConfig) -> None:
    c = model_config.hf_config
    tp, experts = pc.tensor_parallel_size, num_experts(model_config)
    dense = c.get("intermediate_size")
    if dense and dense % tp and not (experts and c.get("model_type") == "mixtral"):
        raise ConfigError(
            f"the MLP's intermediate size ({dense}) is not divisible by tensor parallel size "
            f"({tp})"
        )
    if not pc.enable_expert_parallel:
        moe = c.get("moe_intermediate_size") or (dense if experts else None)
        if experts and moe and moe % tp:
            raise ConfigError(
                f"the experts' intermediate size ({moe}) is not divisible by tensor parallel "
                f"size ({tp}); --enable-expert-parallel spreads whole experts instead"
            )
        return
    if pc.data_parallel_size > 1:
        raise ConfigError(
            "--enable-expert-parallel with --data-parallel-size > 1 is not implemented: "
            "experts are spread over the tensor-parallel ranks of each engine"
        )
    if not experts:
        logger.warning("--enable-expert-parallel: %s has no experts", model_config.architecture)
    elif experts < tp:
        raise ConfigError(
            f"--enable-expert-parallel: {experts} experts cannot be spread over {tp} "
            "tensor-parallel ranks"
        )
    elif tp == 1:
        logger.warning("--enable-expert-parallel with one tensor-parallel rank changes nothing")


def check_device_count(pc: ParallelConfig, device: str) -> None:
    """More ranks than this node's CUDA devices fail at once (Ray places them on a
    cluster instead: its placement group fails there when the cluster is too small).

    Raises:
        ConfigError: ``data x tensor x pipeline`` ranks exceed the devices.
    """
    needed = pc.world_size * pc.data_parallel_size
    if device != "cuda" or pc.distributed_executor_backend == "ray" or needed == 1:
        return
    import torch

    available = torch.cuda.device_count()
    if needed > available:
        raise ConfigError(
            f"the layout needs {needed} GPUs (data {pc.data_parallel_size} x tensor "
            f"{pc.tensor_parallel_size} x pipeline {pc.pipeline_parallel_size}), more than "
            f"the {available} of this node; use fewer ranks, or "
            "--distributed-executor-backend ray to place them across nodes"
        )


def check_ray_address(address: str | None) -> None:
    """A ``RAY_ADDRESS`` (``host:port`` or ``ray://host:port``) must accept a connection
    within a few seconds; unset, ``auto`` and ``local`` are left to Ray.

    Raises:
        ConfigError: the address is malformed or does not answer.
    """
    if not address or address in ("auto", "local"):
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise ConfigError(f"RAY_ADDRESS {address!r} is not host:port or ray://host:port")
    try:
        with socket.create_connection((host, port), timeout=RAY_CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise ConfigError(
            f"the Ray cluster at RAY_ADDRESS {address} does not answer ({e.strerror or e}); "
            "start it (`ray start --head`) or unset RAY_ADDRESS to start a local one"
        ) from None

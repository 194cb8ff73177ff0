"""The flags that make a LoRAConfig (``--enable-lora``, ``--lora-modules``,
``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``, ``--lora-dtype``,
``--fully-sharded-loras``), vLLM's names and defaults. Torch-free: the engine core and the
API server both read it. Errors are ``ValueError``s whose message names the flag
(``EngineArgs`` reports them as ``ConfigError``). ``LoRAConfig`` itself sits with the
engine's other config dataclasses (``tokenmill.config``), below the LoRA layers."""

from __future__ import annotations

import json

from tokenmill.config import LoRAConfig, LoRAModule
from tokenmill.lora.peft import read_peft_config
from tokenmill.lora.request import LoRARequest

# The ranks a slot may hold, as vLLM allows them.
SUPPORTED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")


def parse_lora_module(text: str) -> LoRAModule:
    """One ``--lora-modules`` entry: ``name=path`` or the JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``.

    Raises:
        ValueError: neither form, or an empty name or path.
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: not valid JSON: {text!r} ({e})") from None
        unknown = set(value) - {"name", "path", "base_model_name"}
        if (
            unknown
            or not isinstance(value.get("name"), str)
            or not isinstance(value.get("path"), str)
            or not isinstance(value.get("base_model_name"), (str, type(None)))
        ):
            raise ValueError(
                f"--lora-modules: a JSON entry needs string fields name and path (and "
                f"optionally a string base_model_name), got {text!r}"
            )
        module = LoRAModule(value["name"], value["path"], value.get("base_model_name"))
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {text!r}")
        module = LoRAModule(name.strip(), path.strip())
    if not module.name or not module.path:
        raise ValueError(f"--lora-modules: empty adapter name or path in {text!r}")
    return module


def create_lora_config(
    enable_lora: bool,
    lora_modules: list[str] | str | None,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int | None,
    lora_dtype: str,
    fully_sharded_loras: bool,
    tensor_parallel_size: int = 1,
) -> LoRAConfig | None:
    """Check the LoRA flags; None when ``--enable-lora`` is off.

    Raises:
        ValueError: LoRA flags without ``--enable-lora``, a rank vLLM does not allow,
            ``--max-cpu-loras`` below ``--max-loras``, a repeated adapter name, or
            ``--fully-sharded-loras`` with a ``--max-lora-rank`` that
            ``tensor_parallel_size`` does not divide (each rank holds an equal block).
    """
    entries = [lora_modules] if isinstance(lora_modules, str) else list(lora_modules or [])
    if not enable_lora:
        if entries:
            raise ValueError("--lora-modules needs --enable-lora")
        if fully_sharded_loras:
            raise ValueError("--fully-sharded-loras needs --enable-lora")
        return None
    if max_loras < 1:
        raise ValueError(f"--max-loras must be at least 1, got {max_loras}")
    if max_lora_rank not in SUPPORTED_RANKS:
        raise ValueError(
            f"--max-lora-rank must be one of {', '.join(map(str, SUPPORTED_RANKS))}, "
            f"got {max_lora_rank}"
        )
    cpu = max_loras if max_cpu_loras is None else max_cpu_loras
    if cpu < max_loras:
        raise ValueError(
            f"--max-cpu-loras ({cpu}) must be at least --max-loras ({max_loras})"
        )
    if fully_sharded_loras and max_lora_rank % tensor_parallel_size:
        fits = [r for r in SUPPORTED_RANKS if r % tensor_parallel_size == 0]
        above = [r for r in fits if r >= max_lora_rank] or fits[-1:]
        hint = (
            f"e.g. {above[0]}" if above
            else "no allowed rank is: drop --fully-sharded-loras (the default shards half of "
            "the adapters' work)"
        )
        raise ValueError(
            f"--fully-sharded-loras: --max-lora-rank ({max_lora_rank}) must be divisible by "
            f"--tensor-parallel-size ({tensor_parallel_size}); {hint}"
        )
    modules = [parse_lora_module(e) if isinstance(e, str) else e for e in entries]
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: adapter names repeat: {names}")
    return LoRAConfig(max_loras, max_lora_rank, cpu, lora_dtype, modules, fully_sharded_loras)


def check_lora_model(
    config: LoRAConfig, is_pooling_model: bool, quantization: str | None, is_gguf: bool
) -> None:
    """Check that LoRA applies to the model and that every ``--lora-modules`` folder can be
    served (read before the model loads, so that a wrong folder fails at once).

    Raises:
        ValueError: an embedding model, quantized weights, or an adapter folder that cannot
            be served (``read_peft_config``'s reasons, prefixed with the flag's entry).
    """
    if is_pooling_model:
        raise ValueError("--enable-lora: LoRA adapters apply to generative models only")
    if quantization:
        hint = " (a GGUF file: add --gguf-dequantize)" if is_gguf else ""
        raise ValueError(
            f"--enable-lora: LoRA adapters apply to unquantized models only, and this one "
            f"is {quantization}{hint}"
        )
    for module in config.lora_modules:
        try:
            read_peft_config(module.path, config.max_lora_rank)
        except ValueError as e:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {e}") from None


def startup_lora_requests(config: LoRAConfig | None) -> list[LoRARequest]:
    """The ``--lora-modules`` adapters as LoRARequests, ids 1, 2, ... in flag order."""
    if config is None:
        return []
    return [
        LoRARequest(m.name, i, m.path, m.base_model_name)
        for i, m in enumerate(config.lora_modules, start=1)
    ]

"""LoRARequest: the adapter a request runs with (vLLM's class name and fields). Torch-free:
it crosses to the engine core inside ``EngineCoreRequest``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter, named by a request.

    Attributes:
        lora_name: the adapter's name (what ``"model"`` names in the HTTP API).
        lora_int_id: a positive id, unique per adapter among the engine's adapters; the
            engine keys slots, its host cache and prefix-cache blocks by it.
        lora_path: the PEFT adapter folder (``adapter_config.json`` and
            ``adapter_model.safetensors``).
        base_model_name: the base model the adapter was trained on (``parent`` in
            ``/v1/models``); None: the served model.

    Raises:
        ValueError: ``lora_int_id`` below 1 or an empty name or path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, got {self.lora_int_id}")
        if not self.lora_name or not self.lora_path:
            raise ValueError("a LoRARequest needs a lora_name and a lora_path")

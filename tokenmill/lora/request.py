"""LoRARequest: the adapter a request runs with (vLLM's class name and fields). Torch-free:
it crosses to the engine core inside ``EngineCoreRequest``."""

from __future__ import annotations

import os
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
        ValueError: ``lora_int_id`` not an int in ``[1, 2**63)``, or an empty name or path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        lora_id = self.lora_int_id
        # the engine keeps ids in int64 arrays: a float, a bool or a wider int is refused here
        # rather than in a step
        if type(lora_id) is not int or not 1 <= lora_id < 2**63:
            raise ValueError(
                f"lora_int_id must be an int from 1 to 2**63 - 1, got {lora_id!r}"
            )
        if not self.lora_name or not self.lora_path:
            raise ValueError("a LoRARequest needs a lora_name and a lora_path")
        # as vLLM reads adapter paths: "~" is the user's home folder
        object.__setattr__(self, "lora_path", os.path.expanduser(self.lora_path))

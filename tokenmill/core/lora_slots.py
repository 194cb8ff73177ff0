"""Admission under LoRA adapter slots: the running requests never use more distinct adapters
than the device has slots (``--max-loras``), so no step needs more. Torch-free.

A waiting request whose adapter would need a slot that is not free waits; so do the LoRA
requests queued after it (first come, first served among adapter requests), so that the
running adapters drain and it gets its slot: requests of other adapters wait, never
starve. Requests without an adapter are admitted as usual.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.core.request import Request


class LoRASlots:
    """One scheduling step's view of the adapter slots.

    Args:
        running: the running requests.
        max_loras: adapter slots.
    """

    def __init__(self, running: Iterable[Request], max_loras: int) -> None:
        self.max_loras = max_loras
        self.in_use = {r.lora_int_id for r in running if r.lora_int_id}
        self.skipped: list[Request] = []
        self._blocked = False

    def admits(self, request: Request) -> bool:
        """Whether ``request`` may be admitted now."""
        lora_id = request.lora_int_id
        if not lora_id:
            return True
        if self._blocked:
            return False
        if lora_id in self.in_use or len(self.in_use) < self.max_loras:
            return True
        self._blocked = True
        return False

    def skip(self, request: Request) -> None:
        """``request`` waits (the caller put it back in the queue, in order)."""
        self.skipped.append(request)

    def take(self, request: Request) -> None:
        """``request`` was admitted: its adapter holds a slot."""
        if request.lora_int_id:
            self.in_use.add(request.lora_int_id)


def count_adapters(requests: Iterable[Request]) -> dict[str, int]:
    """LoRA adapter name -> how many of ``requests`` use it (the scheduler's stats)."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_request is not None:
            counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
    return counts

"""Errors the engine raises to its callers, in-process and across its processes."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine failed (its process exited, or a step raised); it serves no more
    requests."""

"""The error raised when a model's files cannot be loaded (torch-free, imported by the
config readers and the loaders alike)."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model file is missing, unreadable or inconsistent; the message names it."""

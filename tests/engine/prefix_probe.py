"""Test helper: record the shared-prefix length the model runner gives attention each step."""

from __future__ import annotations


def record_common_prefix_lens(runner, monkeypatch) -> list[int]:
    """Wrap ``runner._prepare_inputs`` (undone by ``monkeypatch``) so that every step appends
    its ``metadata.common_prefix_len`` (tokens; 0 without cascade) to the returned list."""
    seen: list[int] = []
    prepare = runner._prepare_inputs

    def recording(so):
        inputs = prepare(so)
        seen.append(inputs.metadata.common_prefix_len)
        return inputs

    monkeypatch.setattr(runner, "_prepare_inputs", recording)
    return seen

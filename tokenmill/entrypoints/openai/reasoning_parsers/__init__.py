"""Reasoning parsers: ``ReasoningParser`` (the seam), ``ReasoningParserManager`` (the
registry ``--reasoning-parser NAME`` and ``--reasoning-parser-plugin FILE`` use) and the
built-in ``deepseek_r1`` and ``qwen3``."""

from __future__ import annotations

from tokenmill.entrypoints.openai.reasoning_parsers import think_tags  # noqa: F401 (registers)
from tokenmill.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
    ReasoningParserManager,
)

__all__ = ["ReasoningParser", "ReasoningParserManager"]

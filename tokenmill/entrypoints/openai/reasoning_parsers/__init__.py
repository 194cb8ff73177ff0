"""Reasoning parsers: ``ReasoningParser`` (the seam), ``ReasoningParserManager`` (the
registry ``--reasoning-parser NAME`` and ``--reasoning-parser-plugin FILE`` use) and the
built-in ``deepseek_r1``, ``qwen3`` and ``openai_gptoss``."""

from __future__ import annotations

from tokenmill.entrypoints.openai.reasoning_parsers import (  # noqa: F401 (they register)
    gptoss,
    think_tags,
)
from tokenmill.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
    ReasoningParserManager,
)

__all__ = ["ReasoningParser", "ReasoningParserManager"]

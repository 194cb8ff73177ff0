"""Tool parsers: ``ToolParser`` (the seam), ``ToolParserManager`` (the registry that
``--tool-call-parser NAME`` and ``--tool-parser-plugin FILE`` use) and the built-in parsers:
hermes, llama3_json, mistral, pythonic, qwen3_coder (alias qwen3_xml)."""

from __future__ import annotations

from tokenmill.entrypoints.openai.tool_parsers import (  # noqa: F401 (they register themselves)
    hermes,
    llama3_json,
    mistral,
    pythonic,
    qwen3_coder,
)
from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParserManager,
)

__all__ = ["ToolParser", "ToolParserManager"]

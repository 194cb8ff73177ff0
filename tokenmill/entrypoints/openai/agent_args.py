"""The server's agent-API flags (vLLM's names): tool-call and reasoning parsers, and the
Responses API's store. ``tokenmill serve`` generates them from ``AgentArgs``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any

from tokenmill.config import ConfigError
from tokenmill.engine_args import add_dataclass_flags

# Responses kept for ``previous_response_id`` by default.
DEFAULT_STORED_RESPONSES = 1024


def _flag(help: str, default: Any = None, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class AgentArgs:
    """Tool calling, reasoning and Responses-store flags of ``tokenmill serve``."""

    enable_auto_tool_choice: bool = _flag(
        'Serve tool_choice "auto" (the default when a request has tools): the model decides '
        "whether to call tools and --tool-call-parser reads the calls out of its output.",
        False,
    )
    tool_call_parser: str | None = _flag(
        "How the model writes tool calls: hermes, llama3_json, mistral, pythonic, "
        "qwen3_coder (qwen3_xml), or a name a --tool-parser-plugin registers.",
    )
    tool_parser_plugin: str | None = _flag(
        "A Python file that registers a ToolParser (ToolParserManager.register_module).",
    )
    reasoning_parser: str | None = _flag(
        "Split the model's thinking into reasoning_content: deepseek_r1, qwen3, or a name a "
        "--reasoning-parser-plugin registers.",
    )
    reasoning_parser_plugin: str | None = _flag(
        "A Python file that registers a ReasoningParser (ReasoningParserManager.register_module).",
    )
    max_stored_responses: int = _flag(
        "Responses (/v1/responses with store) kept in memory for previous_response_id and "
        "GET /v1/responses/{id}; the oldest go first. 0 keeps none.",
        DEFAULT_STORED_RESPONSES,
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_flags(parser.add_argument_group("tool calling and reasoning"), cls)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> AgentArgs:
        values = vars(args)
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    def tool_settings(self) -> Any:
        """The parsers these flags select (plugins imported first).

        Raises:
            ConfigError: a plugin fails to import, a parser name is unknown, or
                --enable-auto-tool-choice and --tool-call-parser are not given together.
        """
        from tokenmill.entrypoints.openai.chat_tools import ToolSettings
        from tokenmill.entrypoints.openai.reasoning_parsers import ReasoningParserManager
        from tokenmill.entrypoints.openai.tool_parsers import ToolParserManager

        if self.max_stored_responses < 0:
            raise ConfigError(
                f"--max-stored-responses must be 0 or more, got {self.max_stored_responses}"
            )
        try:
            if self.tool_parser_plugin:
                ToolParserManager.import_tool_parser(self.tool_parser_plugin)
            if self.reasoning_parser_plugin:
                ReasoningParserManager.import_reasoning_parser(self.reasoning_parser_plugin)
        except ImportError as e:
            raise ConfigError(str(e)) from None
        if self.enable_auto_tool_choice != (self.tool_call_parser is not None):
            raise ConfigError(
                "--enable-auto-tool-choice and --tool-call-parser go together: the parser "
                "reads the calls the model chooses to make"
            )
        try:
            tool_parser = (
                ToolParserManager.get_tool_parser(self.tool_call_parser)
                if self.tool_call_parser
                else None
            )
            reasoning_parser = (
                ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)
                if self.reasoning_parser
                else None
            )
        except KeyError as e:
            raise ConfigError(
                f"--{'tool-call' if 'tool' in str(e) else 'reasoning'}-parser: {e.args[0]}"
            ) from None
        return ToolSettings(self.enable_auto_tool_choice, tool_parser, reasoning_parser)

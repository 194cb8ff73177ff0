"""The reasoning-parser seam: ``ReasoningParser`` and the registry ``--reasoning-parser``
names.

A reasoning parser splits a thinking model's output into its reasoning (sent as
``reasoning_content``) and its answer (``content``, where tool calls and structured output
apply). The methods follow vLLM's interface, so a parser written for vLLM's
``--reasoning-parser-plugin`` ports by changing its imports to tokenmill's. One instance
serves one generated sequence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    import_plugin,
    lookup_parser,
    parser_registrar,
)

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, DeltaMessage


class ReasoningParser(ABC):
    """Splits one sequence's output into reasoning and answer.

    Args:
        tokenizer: the model's tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.model_tokenizer = tokenizer

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Change the request before it is served, e.g. keep the special tokens that mark
        the reasoning in the text (``skip_special_tokens = False``). The default changes
        nothing."""
        return request

    @abstractmethod
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether text generated after ``input_ids`` is answer rather than reasoning (e.g. a
        prompt whose template already closed the thinking: ``enable_thinking: false``)."""

    @abstractmethod
    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The answer's token ids among a whole output's ``input_ids``."""

    @abstractmethod
    def extract_reasoning_content(
        self, model_output: str, request: Any
    ) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output; either is None when empty."""

    @abstractmethod
    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        """What to send for the newest piece of a streamed output: ``reasoning_content``
        and/or ``content`` deltas; None when nothing is ready (e.g. a marker's first
        characters are held back)."""

    def finish_streaming(self) -> DeltaMessage | None:
        """What is left to send once the output has ended (held-back text). Default: none."""
        return None

    def reasoning_end_token_ids(self) -> list[int] | None:
        """The token ids that end the reasoning in an output (``</think>``): structured
        outputs apply to the tokens after them. None (the default): the parser cannot say,
        and a constraint applies from the first token."""
        return None


class ReasoningParserManager:
    """The registry of reasoning parsers by name (``--reasoning-parser NAME``)."""

    reasoning_parsers: dict[str, type[ReasoningParser]] = {}

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        """The parser class registered as ``name``.

        Raises:
            KeyError: no parser has that name (the message lists the names).
        """
        return lookup_parser(cls.reasoning_parsers, name, "reasoning parser")

    @classmethod
    def register_module(
        cls,
        name: str | list[str] | None = None,
        force: bool = True,
        module: type[ReasoningParser] | None = None,
    ) -> type[ReasoningParser] | Callable[[type[ReasoningParser]], type[ReasoningParser]]:
        """Register a parser class under ``name`` (or several; default: the class name), as
        a decorator or called with ``module``.

        Raises:
            TypeError: the class is not a ReasoningParser.
            KeyError: the name is taken and ``force`` is false.
        """

        return parser_registrar(
            cls.reasoning_parsers, ReasoningParser, "reasoning parser", name, force, module
        )

    @classmethod
    def import_reasoning_parser(cls, plugin_path: str) -> None:
        """Import a Python file that registers parsers (``--reasoning-parser-plugin FILE``).

        Raises:
            ImportError: the file does not exist or fails to import.
        """
        import_plugin(plugin_path, "reasoning parser")

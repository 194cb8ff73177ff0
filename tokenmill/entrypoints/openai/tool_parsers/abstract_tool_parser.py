"""The tool-parser seam: ``ToolParser`` and the registry that ``--tool-call-parser`` names.

A tool parser turns a model's raw output into OpenAI tool calls, whole
(``extract_tool_calls``) or while it streams (``extract_tool_calls_streaming``). The methods
and the registry follow vLLM's interface, so a parser written for vLLM's
``--tool-parser-plugin`` ports by changing its imports to tokenmill's::

    from tokenmill.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager

    @ToolParserManager.register_module("my_format")
    class MyParser(ToolParser):
        def extract_tool_calls(self, model_output, request): ...
        def extract_tool_calls_streaming(self, previous_text, current_text, delta_text,
                                         previous_token_ids, current_token_ids,
                                         delta_token_ids, request): ...

One parser instance serves one generated sequence (a choice), so it may keep state between
the streaming calls.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tokenmill.entrypoints.openai.protocol_tools import ExtractedToolCallInformation

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, DeltaMessage


class ToolParser(ABC):
    """Extracts tool calls from one sequence's generated text.

    Args:
        tokenizer: the model's tokenizer (for parsers that look at token ids).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.model_tokenizer = tokenizer
        # The streaming state vLLM's parsers keep, for plugins written against it.
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.current_tool_id = -1
        self.current_tool_name_sent = False
        self.streamed_args_for_tool: list[str] = []

    @property
    def vocab(self) -> dict[str, int]:
        """The tokenizer's token -> id map (for parsers that look for marker tokens)."""
        return self.model_tokenizer.get_vocab()

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Change the request before it is served, e.g. keep the special tokens that mark
        tool calls in the text (``skip_special_tokens = False``). The default changes nothing.
        """
        return request

    @abstractmethod
    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest
    ) -> ExtractedToolCallInformation:
        """The tool calls in a whole output and the text around them.

        An output whose calls are malformed (not valid JSON, no name) comes back as
        ``tools_called=False`` with the whole output as content.
        """

    @abstractmethod
    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: ChatCompletionRequest,
    ) -> DeltaMessage | None:
        """What to send for the newest piece of a streamed output (``current_text`` is
        ``previous_text + delta_text``): content, or ``tool_calls`` deltas (a call's first
        delta carries its index, id and name; the later ones argument text to append, the
        whole concatenating to the arguments' JSON). None: nothing to send yet (e.g. text
        that may be the start of tool-call markup is held back).
        """

    def finish_streaming(self, request: ChatCompletionRequest) -> DeltaMessage | None:
        """What is left to send once the stream's output has ended (held-back text); called
        once, after the last ``extract_tool_calls_streaming``. The default sends nothing."""
        return None


class ToolParserManager:
    """The registry of tool parsers by name (``--tool-call-parser NAME``)."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        """The parser class registered as ``name``.

        Raises:
            KeyError: no parser has that name (the message lists the names).
        """
        return lookup_parser(cls.tool_parsers, name, "tool call parser")

    @classmethod
    def register_module(
        cls,
        name: str | list[str] | None = None,
        force: bool = True,
        module: type[ToolParser] | None = None,
    ) -> type[ToolParser] | Callable[[type[ToolParser]], type[ToolParser]]:
        """Register a parser class under ``name`` (or several names; default: the class
        name). Used as a decorator, or called with ``module``.

        Raises:
            TypeError: the class is not a ToolParser.
            KeyError: the name is taken and ``force`` is false.
        """

        return parser_registrar(cls.tool_parsers, ToolParser, "tool parser", name, force, module)

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Import a Python file that registers parsers (``--tool-parser-plugin FILE``).

        Raises:
            ImportError: the file does not exist or fails to import (the reason given).
        """
        import_plugin(plugin_path, "tool parser")


def lookup_parser(registry: dict[str, type], name: str, what: str) -> type:
    """``registry[name]`` (the tool and reasoning parser managers' lookup).

    Raises:
        KeyError: no parser has that name (the message lists the names).
    """
    if name not in registry:
        known = ", ".join(sorted(registry))
        raise KeyError(f"unknown {what} {name!r} (known: {known})")
    return registry[name]


def parser_registrar(
    registry: dict[str, type],
    base: type,
    what: str,
    name: str | list[str] | None,
    force: bool,
    module: type | None,
) -> Any:
    """The parser managers' ``register_module``: registers a subclass of ``base`` under
    ``name`` (or several; default: the class name) in ``registry``; a decorator, or applied
    at once to ``module``.

    Raises:
        TypeError: the class is not a subclass of ``base``.
        KeyError: the name is taken and ``force`` is false.
    """

    def register(parser: type) -> type:
        if not (isinstance(parser, type) and issubclass(parser, base)):
            raise TypeError(f"a {what} must subclass {base.__name__}, got {parser!r}")
        names = [name] if isinstance(name, str) else list(name or [parser.__name__])
        for n in names:
            if not force and n in registry:
                raise KeyError(f"{what} {n!r} is already registered")
            registry[n] = parser
        return parser

    return register if module is None else register(module)


def import_plugin(plugin_path: str, what: str) -> None:
    """Run a plugin file as a module of its own name, so its registrations take effect.

    Raises:
        ImportError: the file does not exist or fails to import (the reason given).
    """
    if not os.path.isfile(plugin_path):
        raise ImportError(f"{what} plugin {plugin_path!r} is not a file")
    name = os.path.splitext(os.path.basename(plugin_path))[0]
    spec = importlib.util.spec_from_file_location(name, plugin_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{what} plugin {plugin_path!r} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ImportError(f"{what} plugin {plugin_path!r} failed: {type(e).__name__}: {e}") from e

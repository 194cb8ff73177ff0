"""``pythonic``: calls as a Python list of function calls with keyword arguments, the format
of Llama 3.2's and Llama 4's pythonic tool-calling templates (Llama 4 wraps it in
``<|python_start|>`` / ``<|python_end|>``)::

    [get_weather(city='San Francisco', unit="celsius"), get_time(zone="UTC")]

Argument values are Python literals (strings, numbers, True/False/None, lists, dicts),
written out as JSON. An output that does not start with ``[`` is plain content.
"""

from __future__ import annotations

import ast
import json
import re
from typing import TYPE_CHECKING

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from tokenmill.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, skip_ws
from tokenmill.entrypoints.openai.tool_parsers.markup_parser import (
    MarkupToolParser,
    ParsedToolOutput,
    PartialToolCall,
)

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest

START, END = "<|python_start|>", "<|python_end|>"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


_BRACKETS = re.compile(r"[()\[\]{}'\"]")
_STRING_REST = {q: re.compile(rf"[^{q}\\]*(?:\\.[^{q}\\]*)*{q}", re.S) for q in "'\""}


def _python_value_end(text: str, i: int) -> int | None:
    """Past the bracket that closes the one opening at ``text[i]`` (Python strings, with
    either quote, skipped); None if the text ends first.

    Raises:
        MalformedJSON: brackets that do not match.
    """
    stack = [_CLOSERS[text[i]]]
    j = i + 1
    while (match := _BRACKETS.search(text, j)) is not None:
        j = match.start()
        c = text[j]
        if c in "'\"":
            rest = _STRING_REST[c].match(text, j + 1)
            if rest is None:
                return None
            j = rest.end()
            continue
        if c in _CLOSERS:
            stack.append(_CLOSERS[c])
        elif c != stack.pop():
            raise MalformedJSON(f"unmatched {c!r}")
        elif not stack:
            return j + 1
        j += 1
    return None


def _arguments(call_text: str) -> str:
    """The JSON object of a call's keyword arguments (``f(a=1)`` -> ``{"a": 1}``).

    Raises:
        MalformedJSON: not one call with literal keyword arguments only.
    """
    try:
        node = ast.parse(call_text, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            raise MalformedJSON("a call takes keyword arguments only")
        values = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        if None in values:
            raise MalformedJSON("a call takes keyword arguments only")
        return json.dumps(values, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as e:
        raise MalformedJSON(str(e)) from None


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(MarkupToolParser):
    """Reads ``[f(a=1), g(b="x")]``; each call is sent whole (name and arguments) once its
    ``)`` arrives, so a call that turns out malformed was never sent."""

    def parse(self, text: str, final: bool, request: ChatCompletionRequest) -> ParsedToolOutput:
        body = text
        i = skip_ws(body, 0)
        if body.startswith(START, i):
            i = skip_ws(body, i + len(START))
            if i >= len(body) and not final:  # calls follow the tag
                return ParsedToolOutput()
        elif START.startswith(body[i:]) and not final:
            return ParsedToolOutput()
        if i >= len(body) or body[i] != "[":
            return ParsedToolOutput(content=text)
        parsed = ParsedToolOutput()
        try:
            self._read_list(body, i + 1, final, parsed)
        except MalformedJSON:
            if not parsed.calls or final:
                return ParsedToolOutput(content=text)
        return parsed

    @staticmethod
    def _read_list(text: str, i: int, final: bool, parsed: ParsedToolOutput) -> None:
        n = len(text)
        while True:
            i = skip_ws(text, i)
            name_end = i
            while name_end < n and text[name_end] in _NAME_CHARS:
                name_end += 1
            if name_end >= n:
                return  # the name goes on
            if text[name_end] != "(" or name_end == i:
                raise MalformedJSON("expected a function call")
            end = _python_value_end(text, name_end)
            if end is None:
                return  # the call is sent whole, once it has been read
            call = PartialToolCall(text[i:name_end], _arguments(text[i:end]), complete=True)
            parsed.calls.append(call)
            i = skip_ws(text, end)
            if i >= n:
                return
            if text[i] == "]":
                rest = text[skip_ws(text, i + 1) :]
                if rest and not rest.startswith(END) and not (not final and END.startswith(rest)):
                    raise MalformedJSON("text after the calls")
                return
            if text[i] != ",":
                raise MalformedJSON("expected ',' or ']'")
            i += 1

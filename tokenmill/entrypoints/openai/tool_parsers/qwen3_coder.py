"""``qwen3_coder`` (also ``qwen3_xml``): Qwen3-Coder's XML-style calls (its chat template's
format), one ``<function=NAME>`` per call with a ``<parameter=KEY>`` per argument::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value loses one newline at each end and is converted by the type its tool's JSON Schema
gives the parameter: strings stay text; numbers, booleans, null, objects and arrays are read
as JSON (then as a Python literal), falling back to text.
"""

from __future__ import annotations

import ast
import json
from typing import TYPE_CHECKING, Any

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from tokenmill.entrypoints.openai.tool_parsers.markup_parser import (
    MarkupToolParser,
    ParsedToolOutput,
    PartialToolCall,
    visible,
)

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def _parameter_types(request: ChatCompletionRequest, function: str) -> dict[str, Any]:
    """The JSON Schema ``type`` of each parameter of the request's tool ``function``."""
    for tool in request.tools or []:
        if tool.function.name == function:
            properties = (tool.function.parameters or {}).get("properties") or {}
            return {
                k: v.get("type") if isinstance(v, dict) else None for k, v in properties.items()
            }
    return {}


def convert_value(raw: str, type_name: Any) -> Any:
    """A parameter's text as the value its schema type says (text when it cannot be read)."""
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    if type_name == "string" or (isinstance(type_name, list) and "string" in type_name):
        return value
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return ast.literal_eval(value)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return value


@ToolParserManager.register_module(["qwen3_coder", "qwen3_xml"])
class Qwen3CoderToolParser(MarkupToolParser):
    """Reads ``<function=NAME>`` blocks (inside ``<tool_call>`` or bare); a call's arguments
    are sent one parameter at a time, as each ``</parameter>`` arrives."""

    def parse(self, text: str, final: bool, request: ChatCompletionRequest) -> ParsedToolOutput:
        parsed = ParsedToolOutput()
        pos = 0
        while True:
            start = min(
                (i for i in (text.find(TOOL_CALL, pos), text.find(FUNCTION, pos)) if i >= 0),
                default=-1,
            )
            if start < 0:
                parsed.content += visible(text[pos:], final, [TOOL_CALL, FUNCTION])
                return parsed
            parsed.content += text[pos:start]
            func = text.find(FUNCTION, start)
            if func < 0 or text[start:func].strip() not in ("", TOOL_CALL):
                if final:  # a <tool_call> with no function in it
                    parsed.content += text[start:]
                return parsed
            pos = self._read_function(text, func, final, request, parsed)
            if pos >= len(text):
                return parsed

    @staticmethod
    def _read_function(
        text: str, func: int, final: bool, request: ChatCompletionRequest, parsed: ParsedToolOutput
    ) -> int:
        """Read the call at ``func`` (``<function=``) into ``parsed``; the index past it
        (and past its ``</tool_call>``), or ``len(text)`` while it is open."""
        name_end = text.find(">", func)
        if name_end < 0:
            return len(text)
        call = PartialToolCall(name=text[func + len(FUNCTION) : name_end].strip(), arguments="{")
        parsed.calls.append(call)
        types = _parameter_types(request, call.name or "")
        members = []
        pos = name_end + 1
        while True:
            param = text.find(PARAMETER, pos)
            close = text.find(FUNCTION_END, pos)
            if param < 0 or (0 <= close < param):
                break
            key_end = text.find(">", param)
            if key_end < 0:
                break
            # A value ends at its </parameter>, or (when the model leaves that out) at the
            # next parameter or the function's end.
            bounds = [i for i in (text.find(PARAMETER, key_end + 1), close) if i >= 0]
            value_end = text.find(PARAMETER_END, key_end + 1)
            if value_end < 0 or (bounds and value_end > min(bounds)):
                if not bounds:
                    break
                value_end = min(bounds)
            key = text[param + len(PARAMETER) : key_end].strip()
            value = convert_value(text[key_end + 1 : value_end], types.get(key))
            members.append(
                f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
            )
            pos = value_end + (
                len(PARAMETER_END) if text.startswith(PARAMETER_END, value_end) else 0
            )
        call.arguments = "{" + ", ".join(members)
        close = text.find(FUNCTION_END, pos)
        if close < 0:
            return len(text)
        call.arguments += "}"
        call.complete = True
        end = close + len(FUNCTION_END)
        after = end + len(text[end:]) - len(text[end:].lstrip())
        if text.startswith(TOOL_CALL_END, after):
            return after + len(TOOL_CALL_END)
        if not final and TOOL_CALL_END.startswith(text[after:]):
            return len(text)  # the closing tag may be on its way
        return end

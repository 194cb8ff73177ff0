"""Tool calling on a chat request: checking ``tools`` and ``tool_choice``, the grammar that
forces ``required`` and named choices, and the conversation's tool calls and results as the
chat template receives them.

- ``none`` (or no tools): the model answers in text; the tools still reach the template.
- ``auto`` (the default with tools): the model decides; ``--tool-call-parser`` reads calls out
  of its output. It needs ``--enable-auto-tool-choice``.
- ``required``: structured outputs force a JSON array of one or more
  ``{"name", "parameters"}`` objects over the tools' schemas (one with
  ``parallel_tool_calls: false``), so any model calls a tool.
- a named function: structured outputs force that function's arguments object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError

from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.protocol_tools import ChatCompletionNamedToolChoiceParam
from tokenmill.entrypoints.openai.structured_outputs import constraint_field
from tokenmill.sampling_params import SamplingParamsError, StructuredOutputsParams
from tokenmill.structured_output import validate as validate_structured_outputs

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.reasoning_parsers import ReasoningParser
    from tokenmill.entrypoints.openai.tool_parsers import ToolParser

ToolMode = Literal["off", "auto", "required", "named"]
# A function without a parameters schema takes no arguments.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool and reasoning flags.

    Attributes:
        enable_auto_tool_choice: ``--enable-auto-tool-choice``.
        tool_parser: the ``--tool-call-parser`` class, or None.
        reasoning_parser: the ``--reasoning-parser`` class, or None.
    """

    enable_auto_tool_choice: bool = False
    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are served.

    Attributes:
        mode: off (no tools, or ``none``), auto, required or named.
        name: the named function (mode named).
        parallel: more than one call may be made (``parallel_tool_calls``).
        constraint: the grammar forcing the calls (required, named), or None.
    """

    mode: ToolMode = "off"
    name: str | None = None
    parallel: bool = True
    constraint: StructuredOutputsParams | None = None


def plan_tool_calls(request: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan:
    """Check the request's ``tools`` and ``tool_choice`` and say how they are served.

    Raises:
        OpenAIError: 400 naming the field: duplicate tool names, a choice naming no given
            tool or given without tools, ``auto`` on a server without
            ``--enable-auto-tool-choice``, a forced choice with another output constraint,
            or a tool schema that does not compile.
    """
    tools = request.tools or []
    choice = request.tool_choice
    names = [t.function.name for t in tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise bad_request(f"tools: the function name {duplicate!r} is given twice.", "tools")
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None and tool.function.parameters.get("type") not in (
            None,
            "object",
        ):
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON Schema of type object.",
                f"tools.{i}.function.parameters",
            )
    parallel = request.parallel_tool_calls is not False
    choice = _tool_choice(choice)
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan("off", parallel=parallel)
    if not tools:
        raise bad_request(
            "tool_choice other than 'none' needs tools: the request gives none.", "tool_choice"
        )
    if choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_parser is not None):
            raise bad_request(
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                'and --tool-call-parser (or ask for tool_choice "required" or a function).',
                "tool_choice",
            )
        return ToolPlan("auto", parallel=parallel)
    _check_no_other_constraint(request)
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        name = choice.function.name
        if name not in names:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not among the tools "
                f"({', '.join(names)}).",
                "tool_choice",
            )
        index = names.index(name)
        schema = tools[index].function.parameters or NO_PARAMETERS
        constraint = _compiled(schema, f"tools.{index}.function.parameters")
        return ToolPlan("named", name=name, parallel=parallel, constraint=constraint)
    for i, tool in enumerate(tools):  # name the tool whose schema fails
        _compiled(tool.function.parameters or NO_PARAMETERS, f"tools.{i}.function.parameters")
    return ToolPlan(
        "required",
        parallel=parallel,
        constraint=_compiled(required_schema(request, parallel), "tools"),
    )


def _tool_choice(choice: Any) -> str | ChatCompletionNamedToolChoiceParam | None:
    """``tool_choice`` checked: None, a mode, or a named function.

    Raises:
        OpenAIError: 400 naming ``tool_choice`` for anything else.
    """
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    try:
        return ChatCompletionNamedToolChoiceParam.model_validate(choice)
    except ValidationError:
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or a function, as "
            '{"type": "function", "function": {"name": ...}}.',
            "tool_choice",
        ) from None


def required_schema(request: ChatCompletionRequest, parallel: bool) -> dict[str, Any]:
    """The JSON Schema of ``tool_choice: "required"`` output: an array of one or more (one
    without ``parallel``) ``{"name": <a tool's name>, "parameters": <its arguments>}``."""
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in request.tools or []
    ]
    items = branches[0] if len(branches) == 1 else {"anyOf": branches}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _compiled(schema: dict[str, Any], field: str) -> StructuredOutputsParams:
    """The constraint of ``schema``, checked to compile (JSON kept to single spaces, which
    keeps small models from wandering into whitespace).

    Raises:
        OpenAIError: 400 naming ``field`` when the schema does not compile.
    """
    try:
        params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        validate_structured_outputs(params)
    except SamplingParamsError as e:
        message = str(e).replace("structured_outputs: ", "", 1)
        raise bad_request(f"{field}: {message}", field) from None
    return params


def _check_no_other_constraint(request: ChatCompletionRequest) -> None:
    """A forced tool choice is itself the output's constraint."""
    fmt = request.response_format
    other = (
        (isinstance(fmt, dict) and fmt.get("type") not in (None, "text"))
        or request.structured_outputs is not None
        or any(
            getattr(request, f) is not None
            for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        )
    )
    if other:
        field = constraint_field(request)
        raise bad_request(
            f'{field} cannot be combined with tool_choice "required" or a named function, '
            "which constrain the output themselves.",
            field,
        )


def tools_for_template(request: Any) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template receives them (transformers' ``tools``:
    OpenAI's ``{"type": "function", "function": {...}}`` entries), or None."""
    tools = getattr(request, "tools", None)
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]


def tool_message_fields(message: Any, index: int, call_ids: set[str]) -> dict[str, Any]:
    """The tool fields of one conversation entry for the template: an assistant's
    ``tool_calls`` (arguments as objects, as templates expect) and ``reasoning_content``,
    a tool message's ``tool_call_id``. Records the calls' ids in ``call_ids``.

    Raises:
        OpenAIError: 400 naming the field: arguments that are not a JSON object, tool_calls
            outside an assistant message, or a tool message without a matching earlier call.
    """
    fields: dict[str, Any] = {}
    if message.tool_calls:
        if message.role != "assistant":
            raise bad_request(
                f"messages[{index}]: only assistant messages carry tool_calls.",
                f"messages.{index}.tool_calls",
            )
        calls = []
        for j, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                field = f"messages.{index}.tool_calls.{j}.function.arguments"
                raise bad_request(f"{field} must be a JSON object (as text).", field)
            call_ids.add(call.id)
            calls.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments},
                }
            )
        fields["tool_calls"] = calls
    if message.role == "tool":
        if message.tool_call_id is None or message.tool_call_id not in call_ids:
            raise bad_request(
                f"messages[{index}]: a tool message must answer an earlier assistant tool "
                f"call by its id; tool_call_id {message.tool_call_id!r} matches none.",
                f"messages.{index}.tool_call_id",
            )
        fields["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        fields["reasoning_content"] = message.reasoning_content
    return fields

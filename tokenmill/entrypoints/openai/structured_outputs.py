"""The output constraint of an OpenAI-API request (structured outputs), from whichever field
the client used; ``tokenmill/structured_output.py`` compiles and enforces it."""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.errors import OpenAIError, bad_request
from tokenmill.entrypoints.openai.protocol import SamplingFields
from tokenmill.sampling_params import SamplingParamsError, StructuredOutputsParams
from tokenmill.structured_output import validate as validate_structured_outputs

_CONSTRAINT_KEYS = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def constraint_field(request: SamplingFields) -> str:
    """The request field that carries its output constraint (``response_format``,
    ``structured_outputs`` or one of the ``guided_*`` fields), for errors found after the
    request was accepted; ``structured_outputs`` when it has none."""
    fmt = request.response_format
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        return "response_format"
    for name in _GUIDED_FIELDS:
        if getattr(request, name) is not None:
            return name
    return "structured_outputs"


def structured_outputs_of(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever field the client used: OpenAI's
    ``response_format`` (``json_object``, or ``json_schema`` with its ``schema``), vLLM's
    ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``)
    or vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar``. None for plain text.

    Raises:
        OpenAIError: 400 naming the field: more than one given, an unknown type or key, a
            value of the wrong type, or a schema, regex or grammar that does not compile.
    """
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = request.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad_request(
                    "response_format json_schema needs json_schema.schema, a JSON schema object.",
                    "response_format",
                )
            given.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise bad_request(
                "response_format type must be 'text', 'json_object' or 'json_schema'.",
                "response_format",
            )
    if request.structured_outputs is not None:
        if not isinstance(request.structured_outputs, dict):
            raise bad_request("structured_outputs must be an object.", "structured_outputs")
        given.append(("structured_outputs", request.structured_outputs))
    for name, key in _GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            given.append((name, {key: value}))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(f"give one output constraint, not several ({names}).", given[1][0])
    name, fields = given[0]
    unknown = set(fields) - _CONSTRAINT_KEYS
    if unknown:
        raise bad_request(f"{name}: unknown keys {sorted(unknown)}.", name)
    try:
        params = StructuredOutputsParams(**fields)
        validate_structured_outputs(params)
    except SamplingParamsError as e:
        raise constraint_error(str(e), name) from None
    return params


def constraint_error(message: str, field: str) -> OpenAIError:
    """A 400 for an error about a request's constraint, checked here or given up by the
    engine: ``message`` names it ``structured_outputs``, as the engine does; the error names
    ``field``, the one the client used."""
    if field in _GUIDED_FIELDS:  # "structured_outputs.regex ..." is "guided_regex ..."
        message = message.replace(f"structured_outputs.{_GUIDED_FIELDS[field]}", field, 1)
    return bad_request(message.replace("structured_outputs", field, 1), field)

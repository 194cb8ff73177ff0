"""Structured outputs: the checks a constraint passes before the engine takes it.

A constraint (JSON schema, regular expression, choice or EBNF grammar) is refused with a
clear error when it is too large to compile quickly, uses what xgrammar would not enforce, or
does not parse; ``validate`` runs these checks on the server (and offline in the input
processor). Compiling and following a constraint happen in the engine
(``tokenmill/grammar_runtime.py``).
"""

from __future__ import annotations

import json
import logging
import re
from functools import lru_cache
from typing import Any

from tokenmill.sampling_params import SamplingParamsError, StructuredOutputsParams

logger = logging.getLogger(__name__)

# Bounds on a constraint's size, which keep compiles short (the server also checks each one
# on its event loop); an ambiguous pattern within them can still compile slowly, which
# ``core/grammar_compilation.py`` bounds in time. Measured on CPU with xgrammar
# 0.2.9: 20,000 choices took 7.6 s, a schema nested 400 levels deep 3.4 s, a one-million
# character regex 98 s.
MAX_SCHEMA_CHARS = 32768
MAX_SCHEMA_DEPTH = 32
MAX_ENUM_VALUES = 256
MAX_REGEX_CHARS = 4096
MAX_GRAMMAR_CHARS = 16384
MAX_CHOICES = 256
# Regex repetition counts ({m,n}) in a regex or a schema's patterns: xgrammar expands them,
# and a schema pattern's cost grows with the square of the count (``[a-z]{0,2000}`` 0.15 s,
# ``{0,9998}`` ~5 s to check).
MAX_REPEAT = 1024
MAX_REPEAT_TOTAL = 4096
# Compiled grammars xgrammar keeps for reuse (each distinct schema takes ~1-5 MB).
GRAMMAR_CACHE_BYTES = 256 << 20
# JSON Schema keywords xgrammar 0.2.9 does not enforce: a schema using one is refused rather
# than served with outputs that may break it.
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset(
    {
        "allOf", "not", "if", "then", "else", "contains", "minContains", "maxContains",
        "uniqueItems", "dependentRequired", "dependentSchemas", "dependencies",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems", "multipleOf",
    }
)  # fmt: skip


def xgrammar_module() -> Any:
    """The xgrammar module.

    Raises:
        SamplingParamsError: xgrammar is not installed.
    """
    try:
        import xgrammar
    except ImportError as e:  # pinned in pyproject.toml; a broken install says so
        raise SamplingParamsError(
            "structured outputs need the xgrammar package, which is not installed.",
            "structured_outputs",
        ) from e
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (JSON string escapes are valid
    in its string literals)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def constraint_source(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind xgrammar compiles: json, regex or ebnf; its text, also the cache key)."""
    if params.json is not None:
        return "json", str(params.json)
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "ebnf", choice_grammar(params.choice)
    if params.grammar is not None:
        return "ebnf", params.grammar
    # OpenAI's JSON mode: an object (xgrammar's built-in JSON grammar takes any value).
    return "json", '{"type": "object"}'


@lru_cache(maxsize=256)
def _check_source(kind: str, spec: str) -> None:
    xgr = xgrammar_module()
    if kind == "json":
        xgr.Grammar.from_json_schema(spec)
    elif kind == "regex":
        xgr.Grammar.from_regex(spec)
    else:
        xgr.Grammar.from_ebnf(spec)


def _refuse(message: str) -> SamplingParamsError:
    return SamplingParamsError(f"structured_outputs: {message}", "structured_outputs")


# Keywords whose value maps names to subschemas, and keywords whose value is data.
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required"})
# Keywords that constrain nothing (OpenAPI's discriminator names the tag that already
# tells a oneOf's branches apart), and the definitions a $ref points into.
_ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$comment", "$schema", "$id",
        "deprecated", "readOnly", "writeOnly", "discriminator", "$defs", "definitions",
    }
)  # fmt: skip
# Counts that must be non-negative integers.
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
# Keywords xgrammar enforces only alone: it ignores the rest of the node beside them.
_EXCLUSIVE = ("enum", "const", "$ref", "anyOf", "oneOf")
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


# Letters xgrammar 0.2.9's regex converter knows after a backslash (each tried alone and with
# its arguments: \cA, \x41, \u0041, \U0001F600). Any other letter (\A, \Z, \z, \G, \h, ...)
# it matches as the letter itself with only a log warning; \b, \B, \k, \p and \P fail to
# compile, which refuses them anyway.
_KNOWN_ESCAPE_LETTERS = frozenset("acdefnrstuvwxDSUW" + "bBkpP")
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_CHAR_CLASS = re.compile(r"\[\^?\]?[^\]]*\]")
# Lookahead and lookbehind: refused in a regex, silently dropped from a schema's pattern.
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def _check_regex_syntax(pattern: str) -> None:
    """Refuse regex constructs xgrammar would not enforce: escapes it would take literally,
    lookarounds, and anchors other than a leading ``^`` and a trailing ``$``.

    Raises:
        SamplingParamsError: ``pattern`` uses one.
    """
    for match in _ESCAPE.finditer(pattern):
        letter = match.group(1)
        if letter.isascii() and letter.isalpha() and letter not in _KNOWN_ESCAPE_LETTERS:
            raise _refuse(
                f"the regex escape '\\{letter}' is not supported (it would match "
                f"{letter!r} itself)."
            )
    # Escapes and character classes become one neutral character each, so that neither
    # "(\\s?=" nor "[(?=]" reads as a lookaround.
    plain = _CHAR_CLASS.sub("_", _ESCAPE.sub("_", pattern))
    if _LOOKAROUND.search(plain):
        raise _refuse("regex lookahead and lookbehind are not supported.")
    # xgrammar matches the whole output and drops anchors with a log warning: at the ends of
    # the regex or of its top-level alternatives that is what they mean; elsewhere ("a$b",
    # "(^a|b)c") dropping them changes what the regex matches.
    for branch in _top_level_branches(plain):
        inner = branch.removeprefix("^").removesuffix("$")
        if "^" in inner or "$" in inner:
            raise _refuse(
                "'^' and '$' are supported only at the start and the end of a regex (or of its "
                "top-level alternatives)."
            )


def _top_level_branches(plain: str) -> list[str]:
    """``plain`` (escapes and character classes neutralised) split at its ``|`` outside
    parentheses."""
    branches, depth, start = [], 0, 0
    for i, ch in enumerate(plain):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        elif ch == "|" and depth == 0:
            branches.append(plain[start:i])
            start = i + 1
    branches.append(plain[start:])
    return branches


def _check_pattern(pattern: str) -> int:
    """Check a regex (the ``regex`` constraint, or a schema's ``pattern`` or
    ``patternProperties`` key) and return the sum of its repetition counts (each count's
    larger bound), which the caller bounds in total.

    Raises:
        SamplingParamsError: its syntax is refused (``_check_regex_syntax``), or one count
            is above ``MAX_REPEAT``.
    """
    _check_regex_syntax(pattern)
    total = 0
    for match in _REPEAT.finditer(pattern):
        count = max(int(match.group(1)), int(match.group(2) or 0))
        if count > MAX_REPEAT:
            raise _refuse(f"a regex repetition count is above {MAX_REPEAT} ({count}).")
        total += count
    return total


def _check_exclusive(node: dict) -> None:
    """Refuse keywords that xgrammar would ignore beside an exclusive one, counts that are
    not non-negative integers, and lengths beside a pattern or format."""
    for key in _EXCLUSIVE:
        if key not in node:
            continue
        # {"type": "string", "enum": [...]}: the values carry their type; a const that is
        # one of the enum's values is what xgrammar enforces (pydantic < 2.8 wrote both).
        alone = {key, "type"} if key in ("enum", "const") else {key}
        enum = node.get("enum")
        if key in ("enum", "const") and isinstance(enum, list) and node.get("const") in enum:
            alone |= {"enum", "const"}
        # Vendor extensions and OpenAPI's nullable only widen what the schema admits:
        # outputs that ignore them still conform.
        others = sorted(
            k
            for k in set(node) - _ANNOTATIONS - alone
            if k != "nullable" and not k.startswith("x-")
        )
        if others:
            raise _refuse(
                f"the JSON schema keyword {key!r} beside {others[0]!r} is not supported "
                "(only the first would be enforced)."
            )
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise _refuse(f"the JSON schema's $ref {ref!r} is not local (only '#...' is supported).")
    for key in _COUNTS:
        value = node.get(key)
        if key in node and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise _refuse(f"the JSON schema's {key} must be a non-negative integer.")
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    shaped = [k for k in ("pattern", "format") if k in node]
    if lengths and shaped:
        raise _refuse(
            f"the JSON schema keyword {lengths[0]!r} beside {shaped[0]!r} is not supported "
            "(the length would not be enforced)."
        )


def _check_schema(node: Any, depth: int = 0) -> tuple[int, int]:
    """Refuse what xgrammar would not enforce and what would take long to compile; returns
    the number of enum/const values under ``node`` and the sum of its patterns' repetition
    counts."""
    if depth > MAX_SCHEMA_DEPTH:
        raise _refuse(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep.")
    if isinstance(node, list):  # anyOf, oneOf, prefixItems: lists of subschemas
        sums = [_check_schema(item, depth + 1) for item in node]
        return sum(v for v, _ in sums), sum(r for _, r in sums)
    if not isinstance(node, dict):
        return 0, 0
    unsupported = UNSUPPORTED_SCHEMA_KEYWORDS.intersection(node)
    if unsupported:
        raise _refuse(
            f"the JSON schema keyword {sorted(unsupported)[0]!r} is not supported (its "
            "outputs could break it)."
        )
    _check_exclusive(node)
    for key in ("anyOf", "oneOf"):
        if node.get(key) == []:
            raise _refuse(f"the JSON schema's {key!r} is empty: it admits no value.")
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list) and required:
        described = properties if isinstance(properties, dict) else {}
        missing = [r for r in required if r not in described]
        if missing:
            raise _refuse(
                f"the JSON schema requires {missing[0]!r}, which its properties do not "
                "describe (not supported)."
            )
    values = len(node["enum"]) if isinstance(node.get("enum"), list) else 0
    values += "const" in node
    repeats = _check_pattern(node["pattern"]) if isinstance(node.get("pattern"), str) else 0
    if isinstance(node.get("patternProperties"), dict):
        repeats += sum(_check_pattern(p) for p in node["patternProperties"])
    for key, value in node.items():
        if key in _DATA_KEYWORDS or (key in _ANNOTATIONS and key not in _SCHEMA_MAPS):
            continue  # data, not subschemas (discriminator's mapping, examples, ...)
        subs = value.values() if key in _SCHEMA_MAPS and isinstance(value, dict) else [value]
        for sub in subs:
            if isinstance(sub, dict | list):
                v, r = _check_schema(sub, depth + 1)
                values, repeats = values + v, repeats + r
    return values, repeats


# Cached like the compile check: the server checks a request's constraint, then the input
# processor does again.
@lru_cache(maxsize=256)
def _check_schema_text(text: str) -> None:
    if len(text) > MAX_SCHEMA_CHARS:
        raise _refuse(f"the JSON schema is longer than {MAX_SCHEMA_CHARS} characters.")
    try:
        schema = json.loads(text)
    except RecursionError:  # json.loads gives up around a thousand levels
        raise _refuse(
            f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep."
        ) from None
    except ValueError as e:
        raise _refuse(f"invalid JSON schema: {e}") from None
    values, repeats = _check_schema(schema)
    if values > MAX_ENUM_VALUES:
        raise _refuse(f"the JSON schema lists more than {MAX_ENUM_VALUES} enum values.")
    if repeats > MAX_REPEAT_TOTAL:
        raise _refuse(
            f"the JSON schema's patterns repeat more than {MAX_REPEAT_TOTAL} times in all."
        )


def _check_unicode(params: StructuredOutputsParams) -> None:
    texts = [params.regex, params.grammar, *(params.choice or ())]
    if isinstance(params.json, str):
        texts.append(params.json)
    for text in texts:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise _refuse("the constraint is not valid Unicode (a lone surrogate).") from None


def _check_size(params: StructuredOutputsParams) -> None:
    _check_unicode(params)
    if params.json is not None:
        _check_schema_text(str(params.json))
    if params.regex is not None:
        if len(params.regex) > MAX_REGEX_CHARS:
            raise _refuse(f"the regex is longer than {MAX_REGEX_CHARS} characters.")
        if _check_pattern(params.regex) > MAX_REPEAT_TOTAL:
            raise _refuse(f"the regex repeats more than {MAX_REPEAT_TOTAL} times in all.")
    if params.grammar is not None and len(params.grammar) > MAX_GRAMMAR_CHARS:
        raise _refuse(f"the grammar is longer than {MAX_GRAMMAR_CHARS} characters.")
    if params.choice is not None and (
        len(params.choice) > MAX_CHOICES or sum(map(len, params.choice)) > MAX_GRAMMAR_CHARS
    ):
        raise _refuse(
            f"choice takes at most {MAX_CHOICES} strings of {MAX_GRAMMAR_CHARS} characters in all."
        )


def _reason(error: Exception) -> str:
    """xgrammar's message without its log prefix (``[time] file.cc:line: ``), its assertion
    text (``Check failed: (...) is false: ``) and its echo of the whole input."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)
    return text.split(". The JSON string is:", 1)[0]


def validate(params: StructuredOutputsParams) -> None:
    """Check that the constraint is within the size bounds, uses nothing xgrammar would not
    enforce, and compiles (no tokenizer needed; cached by its text).

    Raises:
        SamplingParamsError: a constraint too large, an unsupported JSON Schema keyword, or
            an invalid JSON schema, regular expression or grammar (xgrammar's reason).
    """
    _check_size(params)
    kind, spec = constraint_source(params)
    try:
        _check_source(kind, spec)
    except SamplingParamsError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with its reason
        name = {"json": "JSON schema", "regex": "regular expression", "ebnf": "grammar"}
        raise _refuse(f"invalid {name.get(kind, kind)}: {_reason(e)}") from None


def compile_failure_reason(error: Exception) -> str:
    """The message for a constraint that failed to compile in the engine."""
    return str(_refuse(f"the constraint does not compile: {_reason(error)}"))

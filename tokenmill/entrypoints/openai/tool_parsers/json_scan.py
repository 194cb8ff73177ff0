"""Reading JSON that is still being generated: where a value ends (if it has ended yet), and
the members of an object or the objects of an array seen so far (RFC 8259's grammar).

A scan never needs the rest of the text: given a prefix of a JSON document, it reports what
is complete and where the text ran out, so a streamed tool call can send each piece as soon
as it is known.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WS = " \t\r\n"
_CLOSERS = {"{": "}", "[": "]"}
_LITERAL_CHARS = frozenset("0123456789+-.eEtrufalsn")


class MalformedJSON(ValueError):
    """The text cannot be (the start of) the JSON expected there."""


def skip_ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after ``i`` (or ``len(text)``)."""
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


# The rest of a JSON string after its opening quote, through its closing quote (escapes
# skipped), and the characters that matter inside an object or array: regexes run in C,
# which keeps re-reading a long argument at every streamed token cheap.
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_STRUCTURE = re.compile(r'[{}\[\]"]')
_LITERAL = re.compile(r"[0-9+\-.eEtrufalsn]*")


def _string_end(text: str, i: int) -> int | None:
    """Past the closing quote of the string opening at ``text[i]``; None if unterminated."""
    match = _STRING_REST.match(text, i + 1)
    return match.end() if match else None


def value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value that starts at ``text[i]``, or None when the text
    ends first (a number or literal touching the end may go on, so it is not ended).

    Raises:
        MalformedJSON: ``text[i]`` cannot start a value, or the brackets do not match.
    """
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in _CLOSERS:
        stack = [_CLOSERS[c]]
        j = i + 1
        while (match := _STRUCTURE.search(text, j)) is not None:
            j = match.start()
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in _CLOSERS:
                stack.append(_CLOSERS[c])
            elif c != stack.pop():
                raise MalformedJSON(f"unmatched {c!r} at {j}")
            elif not stack:
                return j + 1
            j += 1
        return None
    if c in _LITERAL_CHARS:
        j = _LITERAL.match(text, i).end()
        return j if j < n else None
    raise MalformedJSON(f"no JSON value starts with {c!r}")


@dataclass
class ObjectScan:
    """The members of a JSON object seen so far.

    Attributes:
        members: key -> (start of its value, end of its value or None while it is open).
        end: the index just past the closing brace, or None while the object is open.
    """

    members: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None

    def complete_value(self, text: str, key: str) -> object:
        """The parsed value of a member whose text has ended, else None."""
        span = self.members.get(key)
        if span is None or span[1] is None:
            return None
        return json.loads(text[span[0] : span[1]])


def scan_object(text: str, i: int) -> ObjectScan:
    """The members of the object whose ``{`` is at ``text[i]``, as far as the text goes.

    Raises:
        MalformedJSON: the text cannot be the start of an object.
    """
    if i >= len(text) or text[i] != "{":
        raise MalformedJSON("expected '{'")
    scan = ObjectScan()
    n = len(text)
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "}":
        scan.end = j + 1
        return scan
    while j < n:
        if text[j] != '"':
            raise MalformedJSON(f"expected a key at {j}")
        key_end = _string_end(text, j)
        if key_end is None:
            return scan
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= n:
            return scan
        if text[j] != ":":
            raise MalformedJSON(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        if j >= n:
            return scan
        if key in scan.members:
            # Parsers disagree on which of two values wins; a call must not be read
            # differently streamed and whole.
            raise MalformedJSON(f"duplicate key {key!r} at {j}")
        end = value_end(text, j)
        scan.members[key] = (j, end)
        if end is None:
            return scan
        j = skip_ws(text, end)
        if j >= n:
            return scan
        if text[j] == "}":
            scan.end = j + 1
            return scan
        if text[j] != ",":
            raise MalformedJSON(f"expected ',' or '}}' at {j}")
        j = skip_ws(text, j + 1)
    return scan


@dataclass
class ArrayScan:
    """The objects of a JSON array of objects seen so far (the last may be open).

    Attributes:
        objects: (start index, scan) of each object begun.
        end: the index just past the closing bracket, or None while the array is open.
    """

    objects: list[tuple[int, ObjectScan]] = field(default_factory=list)
    end: int | None = None


def scan_object_array(text: str, i: int) -> ArrayScan:
    """The objects of the array whose ``[`` is at ``text[i]``, as far as the text goes.

    Raises:
        MalformedJSON: the text cannot be the start of an array of objects.
    """
    if i >= len(text) or text[i] != "[":
        raise MalformedJSON("expected '['")
    scan = ArrayScan()
    n = len(text)
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "]":
        scan.end = j + 1
        return scan
    while j < n:
        obj = scan_object(text, j)
        scan.objects.append((j, obj))
        if obj.end is None:
            return scan
        j = skip_ws(text, obj.end)
        if j >= n:
            return scan
        if text[j] == "]":
            scan.end = j + 1
            return scan
        if text[j] != ",":
            raise MalformedJSON(f"expected ',' or ']' at {j}")
        j = skip_ws(text, j + 1)
    return scan


def is_json_object(text: str) -> bool:
    """Whether ``text`` is exactly one JSON object (surrounding whitespace allowed)."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False

"""Argument types of the engine's flags: sizes in bytes, vLLM's human-readable ints, and
dataclass fields that carry their CLI help (``flag``), and the argparse flags generated from
such fields."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import field
from typing import Any

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_bytes(value: str | int) -> int:
    """``"4GiB"``, ``"512M"``, ``"1e9"`` or an int -> bytes (k/M/G/T are powers of 1000,
    Ki/Mi/Gi/Ti of 1024).

    Raises:
        ValueError: not a size.
    """
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        try:
            return int(float(value))
        except (ValueError, OverflowError):  # OverflowError: inf, 1e400
            raise ValueError(
                f"not a size in bytes: {value!r} (e.g. 4GiB, 512MB, 1000000)"
            ) from None
    number, unit, binary = match.groups()
    power = " kmgt".index(unit.lower() or " ")
    return int(float(number) * ((1024 if binary else 1000) ** power))


def byte_size_arg(value: str) -> str:
    """argparse type of size flags (``--kv-cache-memory 4GiB``): checks the value at parsing,
    so a typo fails in one line before anything loads; the text itself is kept.

    Raises:
        argparse.ArgumentTypeError: not a positive size in bytes.
    """
    try:
        size = parse_bytes(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size in bytes, got {value!r}")
    return value


def add_dataclass_flags(
    group: Any,
    cls: type,
    defaults: dict[str, Any] | None = None,
    skip: Any = (),
) -> None:
    """Add one flag per field of a dataclass whose fields carry ``flag`` metadata
    (``--max-num-seqs`` for ``max_num_seqs``; booleans get ``--no-`` forms); ``defaults``
    replaces some fields' defaults (value and help text); ``skip`` names fields left out."""
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata)
        if not meta or f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        names = [flag, *meta.pop("aliases", [])]
        help_text = meta.pop("help")
        default = defaults.get(f.name, f.default)
        if default is not None and default is not dataclasses.MISSING:
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text, "default": default, **meta}
        if f.type in ("bool", bool, "bool | None"):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.setdefault("type", _arg_type(f.type))
        group.add_argument(*names, **kwargs)


def _arg_type(type_name: Any):
    text = str(type_name)
    if "int" in text and "str" not in text:
        return int
    if "float" in text:
        return float
    return str


def flag(help: str, **kw: Any) -> Any:
    """A dataclass field carrying its CLI help (and optional choices/aliases/nargs)."""
    default = kw.pop("default", None)
    meta = {"help": help, **kw}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


def human_readable_int(text: str) -> int:
    """An int, or one with a size suffix as vLLM reads ``--max-model-len``: ``k``/``m``/``g``
    multiply by 10**3/6/9 (a decimal is allowed: ``25.6k``), ``K``/``M``/``G`` by
    2**10/20/30 (whole numbers only).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    value = text.strip()
    decimal = {"k": 10**3, "m": 10**6, "g": 10**9}
    binary = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        if value and value[-1] in decimal:
            number = float(value[:-1]) * decimal[value[-1]]
            if number != int(number):
                raise ValueError
            return int(number)
        if value and value[-1] in binary:
            return int(value[:-1]) * binary[value[-1]]
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid int value: {text!r} (an integer, or one like 1k or 1K)"
        ) from None


def json_object(value: str | dict[str, Any] | None, flag_name: str) -> dict[str, Any]:
    """A flag given as a JSON object (text on the command line, a dict from ``LLM(...)``);
    None is ``{}``.

    Raises:
        ValueError: not valid JSON, or not an object (the message names ``flag_name``).
    """
    import json

    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag_name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag_name} must be a JSON object, got {value!r}")
    return value

"""CLI flags generated from dataclass fields: one ``--flag`` per field that carries ``_flag``
metadata (help text, aliases, choices), so a flag, its default and its help live in one
place."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


def add_dataclass_flags(
    group: Any,
    cls: type,
    defaults: dict[str, Any] | None = None,
    skip: Any = (),
) -> None:
    """Add one flag per field of a dataclass whose fields carry ``_flag`` metadata
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

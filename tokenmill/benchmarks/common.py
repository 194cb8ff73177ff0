"""Pieces shared by the benchmarks: the user-facing error, percentile names, result files."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any


class BenchmarkError(Exception):
    """A benchmark cannot run as configured (bad flag value, unreadable file or tokenizer).

    The CLI prints its message in one line and exits with a non-zero code; it never
    carries a traceback to the user.
    """


def percentile_name(p: float) -> str:
    """``99.0 -> "99"``, ``99.9 -> "99.9"``: the name used in result keys (``p99_ttft_ms``)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``.

    Raises:
        BenchmarkError: an entry is not a number in (0, 100].
    """
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise BenchmarkError(f"not a percentile: {item!r} (expected e.g. 50,90,99)") from None
        if not 0.0 < value <= 100.0:
            raise BenchmarkError(f"percentile {item} is outside (0, 100]")
        values.append(value)
    if not values:
        raise BenchmarkError("no percentile given (expected e.g. 50,90,99)")
    return values


def json_safe(value: Any) -> Any:
    """Replace NaN / infinity (not valid JSON) by None, and numpy scalars by Python numbers."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, creating the parent folder.

    Raises:
        BenchmarkError: the file cannot be written.
    """
    try:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(json_safe(data), f, indent=2)
            f.write("\n")
    except OSError as e:
        raise BenchmarkError(f"cannot write {path}: {e}") from e


def read_json(path: str) -> dict[str, Any]:
    """Read a result file.

    Raises:
        BenchmarkError: missing, unreadable, or not a JSON object.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BenchmarkError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise BenchmarkError(f"{path} does not hold a JSON object")
    return data


def flags_of(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags of a run, for its result file (plain values and lists only)."""
    plain = (str, int, float, bool, type(None))
    return {
        key: value
        for key, value in vars(args).items()
        if isinstance(value, plain)
        or (isinstance(value, list) and all(isinstance(v, plain) for v in value))
    }

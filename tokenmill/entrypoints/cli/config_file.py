"""``--config FILE.yaml``: a command's flags read from a YAML file, as ``vllm serve --config``.

The file is a mapping of flag names to values::

    model: /models/llama-3.1-8b
    tensor-parallel-size: 2
    enable-prefix-caching: true
    lora-modules: [sql=/adapters/sql, chat=/adapters/chat]
    speculative-config: {method: ngram, num_speculative_tokens: 4}

Each key becomes ``--key`` (underscores read as dashes); ``true`` gives the flag alone,
``false`` its ``--no-`` form where the command has one (and nothing otherwise: the flag's
default is off), a list the flag followed by each item, a mapping the flag followed by its
JSON. The file's flags go right after the command (and ``serve``'s positional model), before
the other flags of the command line, so a flag given on the command line wins over the
file's, and both over the defaults.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import yaml


class ConfigFileError(ValueError):
    """A ``--config`` file that cannot be read, or that is not a mapping of flags."""


def _subcommand_parser(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.ArgumentParser, int]:
    """The parser of the (sub)command ``argv`` names (``serve``, ``bench throughput``) and
    how many leading tokens name it."""
    depth = 0
    while depth < len(argv):
        # NOTE: argparse lists subcommands only in these private fields.
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or argv[depth] not in subs[0].choices:
            break
        parser = subs[0].choices[argv[depth]]
        depth += 1
    return parser, depth


def file_flags(
    path: str, known: dict[str, argparse.Action], skip: frozenset[str] = frozenset()
) -> list[str]:
    """The command-line tokens of a ``--config`` file (module docstring).

    Args:
        path: a ``.yaml``/``.yml`` file.
        known: the command's option strings and their actions (a key must name one; a
            flag without a value takes a boolean, one with a single value no list).
        skip: flags to leave out (``--model`` where the command line names the model).

    Raises:
        ConfigFileError: not a YAML file, unreadable, not a mapping, a key that is no flag
            of the command (``config`` included: files do not nest), or a value of the
            wrong kind for its flag.
    """
    if not path.endswith((".yaml", ".yml")):
        raise ConfigFileError(f"--config {path}: the file must be YAML (.yaml or .yml)")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigFileError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        reason = " ".join(str(e).split())
        raise ConfigFileError(f"--config {path}: not valid YAML: {reason}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag names to values")
    tokens: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if flag in skip:
            continue
        if flag == "--config":
            raise ConfigFileError(f"--config {path}: a config file cannot name another")
        action = known.get(flag)
        if action is None:
            raise ConfigFileError(f"--config {path}: {key} is not a flag of this command")
        if value is None:
            raise ConfigFileError(f"--config {path}: {key} has no value")
        takes_value = action.nargs != 0
        if not takes_value and not isinstance(value, bool):
            raise ConfigFileError(f"--config {path}: {key} takes true or false, got {value!r}")
        if action.nargs is None and isinstance(value, list):
            raise ConfigFileError(f"--config {path}: {key} takes one value, got a list")
        if isinstance(value, bool) and takes_value:
            tokens += [flag, str(value).lower()]
        elif isinstance(value, bool):
            negative = "--no-" + flag[2:]
            if value:
                tokens.append(flag)
            elif negative in known:
                tokens.append(negative)
        elif isinstance(value, list):
            tokens += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            tokens += [flag, json.dumps(value)]
        else:
            tokens += [flag, str(value)]
    return tokens


def expand_config_file(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--config FILE`` (or ``--config=FILE``) replaced by the file's flags,
    placed after the command's name and positional arguments (module docstring).

    Raises:
        ConfigFileError: ``--config`` twice or without a file, or a bad file.
    """
    argv = list(argv)
    where = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not where:
        return argv
    if len(where) > 1:
        raise ConfigFileError("--config given more than once")
    i = where[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
            raise ConfigFileError("--config needs a YAML file")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    else:
        path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1 :]
    command, depth = _subcommand_parser(parser, rest)
    # serve's positional MODEL stays where it is, before the file's flags, and wins over
    # the file's model (as vLLM's)
    named = depth
    while depth < len(rest) and not rest[depth].startswith("-"):
        depth += 1
    skip = frozenset({"--model"}) if depth > named else frozenset()
    return rest[:depth] + file_flags(path, command._option_string_actions, skip) + rest[depth:]

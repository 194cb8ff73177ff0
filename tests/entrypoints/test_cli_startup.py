"""``tokenmill serve`` fails fast and in one line: invalid flag values at argument parsing, a
busy port before the engine starts; unknown flags are reported by the subcommand's parser."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.entrypoints.conftest import SERVE_COMMAND
from tests.entrypoints.test_cli import run_main
from tokenmill.arg_types import byte_size_arg
from tokenmill.entrypoints.cli.main import build_parser
from tokenmill.entrypoints.cli.serve import bind_listeners


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--port", "99999"], "argument --port: port must be in 0-65535, got 99999"),
        (["--port", "-1"], "argument --port: port must be in 0-65535"),
        (["--kv-cache-memory", "4XB"], "argument --kv-cache-memory"),
        (["--kv-cache-memory-bytes", "0"], "must be a positive size"),
        (["--shutdown-timeout", "-1"], "argument --shutdown-timeout: must be 0 or more"),
        (["--shutdown-timeout", "soon"], "argument --shutdown-timeout"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_invalid_values_fail_at_parsing_in_one_line(capsys, argv, words):
    code, out, err = run_main(capsys, ["serve", *argv])
    assert code == 2 and out == ""
    assert err.startswith("tokenmill serve: error: ") and err.count("\n") == 1, err
    assert words in err


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["--no-such-flag"], "tokenmill"),
        (["version", "--no-such-flag"], "tokenmill version"),
        (["bench", "serve", "--no-such-flag"], "tokenmill bench serve"),
        (["serve", "model", "extra"], "tokenmill serve"),
    ],
)
def test_unknown_arguments_are_reported_by_their_subcommand(capsys, argv, prog):
    code, _, err = run_main(capsys, argv)
    assert code == 2
    assert err.startswith(f"{prog}: error: unrecognized arguments: ") and err.count("\n") == 1


def test_shutdown_timeout_defaults_to_abort_at_once_as_vllm():
    assert build_parser().parse_args(["serve"]).shutdown_timeout == 0
    assert build_parser().parse_args(["serve", "--shutdown-timeout", "30"]).shutdown_timeout == 30


def test_byte_size_arg_keeps_the_text():
    assert byte_size_arg("1GiB") == "1GiB"
    for bad in ("4XB", "0", "-1", ""):
        with pytest.raises(Exception, match="size"):
            byte_size_arg(bad)


def test_bind_listeners_binds_and_a_busy_port_raises():
    listeners = bind_listeners("127.0.0.1", 0)
    try:
        assert len(listeners) == 1
        port = listeners[0].getsockname()[1]
        # Already listening: a second server on the port fails at once (not after its
        # model loaded, when it would have failed to listen).
        with pytest.raises(OSError):
            bind_listeners("127.0.0.1", port)
    finally:
        for sock in listeners:
            sock.close()
    with pytest.raises(OSError):
        bind_listeners("no-such-host.invalid", 0)


def test_bind_listeners_covers_every_address_of_a_name():
    listeners = bind_listeners("localhost", 0)
    try:
        addresses = {sock.getsockname()[0] for sock in listeners}
        assert "127.0.0.1" in addresses
        assert len({sock.getsockname()[1] for sock in listeners}) == 1  # one port for all
    finally:
        for sock in listeners:
            sock.close()


def serve_on_a_busy_port(*flags: str) -> tuple[int, int, list[str]]:
    """``tokenmill serve ... --port P`` while P is held: ``(P, exit code, output lines)``."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [*SERVE_COMMAND, "--host", "127.0.0.1", "--port", str(port), *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
    return port, result.returncode, (result.stdout + result.stderr).strip().splitlines()


def test_busy_port_fails_before_the_engine_starts():
    port, code, output = serve_on_a_busy_port()
    assert code == 1
    assert output == [
        f"tokenmill serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ], output


def test_a_bad_flag_is_reported_even_on_a_busy_port():
    _port, code, output = serve_on_a_busy_port("--quantization", "bogus")
    assert code == 2
    assert len(output) == 1 and "--quantization bogus" in output[0], output

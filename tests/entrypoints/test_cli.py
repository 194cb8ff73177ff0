"""The ``tokenmill`` command line: versions, flag errors in one line with exit code 2,
start-up errors in one line with a non-zero exit code."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.entrypoints.conftest import SERVE_COMMAND
from tokenmill.config import ConfigError
from tokenmill.engine_args import EngineArgs
from tokenmill.entrypoints.cli.config_file import expand_config_file
from tokenmill.entrypoints.cli.main import build_parser, main, parse_args
from tokenmill.entrypoints.cli.serve import HUB_FLAGS, UNIMPLEMENTED_FLAGS
from tokenmill.version import __version__


def run_main(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_version_flag_and_command(capsys):
    assert run_main(capsys, ["--version"]) == (0, f"{__version__}\n", "")
    assert run_main(capsys, ["version"]) == (0, f"{__version__}\n", "")


@pytest.mark.parametrize("flag", UNIMPLEMENTED_FLAGS)
def test_unimplemented_vllm_flags_are_rejected(capsys, flag):
    code, out, err = run_main(capsys, ["serve", flag, "some-value"])
    assert code == 2
    assert err == f"tokenmill serve: error: tokenmill does not implement {flag} yet\n"


@pytest.mark.parametrize("flag", HUB_FLAGS)
def test_hub_flags_are_refused_with_the_reason(capsys, flag):
    code, out, err = run_main(capsys, ["serve", flag, "main"])
    assert code == 2
    assert err == (f"tokenmill serve: error: {flag}: tokenmill never downloads models; give a "
                   "local folder or .gguf file\n")


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "eighty"],
        ["serve", "--dtype", "float8"],
        ["serve", "--allowed-origins", "not json"],
        ["serve", "--no-such-flag"],
        ["serve", "--max-num-seqs"],
        ["serve", "a", "--model", "b"],
        ["serve", "--chat-template", "/no/such/template.jinja"],
        ["serve", "--max-log-len", "-1"],
        ["serve", "--kv-cache-dtype", "fp4"],
        ["serve", "--calculate-kv-scales"],
        ["serve", "--max-model-len", "1.5K"],
        ["serve", "--kv-cache-memory", "inf"],  # was an OverflowError traceback
        ["serve", "--kv-cache-memory", "1e400"],
        ["serve", "--enable-auto-tool-choice"],
        ["serve", "--tool-call-parser", "hermes"],
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "no_such_parser"],
        ["serve", "--reasoning-parser", "no_such_parser"],
        ["serve", "--tool-parser-plugin", "/no/such/plugin.py"],
        ["serve", "--max-stored-responses", "-1"],
    ],
)
def test_bad_flags_fail_in_one_line(capsys, argv):
    code, out, err = run_main(capsys, argv)
    assert code == 2
    assert err.count("\n") == 1 and "error" in err and "Traceback" not in err


def test_serve_flags_and_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model_tag, args.model) == ("0.0.0.0", 8000, None, None)
    assert args.allowed_origins == ["*"] and args.api_key is None
    args = build_parser().parse_args(
        [
            "serve",
            "m",
            "--max-num-seqs",
            "4",
            "--no-enable-prefix-caching",
            "--allowed-origins",
            '["http://a"]',
            "-tp",
            "1",
            "--kv-cache-memory-bytes",
            "1GiB",
        ]
    )
    assert (args.model_tag, args.max_num_seqs, args.enable_prefix_caching) == ("m", 4, False)
    assert args.allowed_origins == ["http://a"] and args.kv_cache_memory == "1GiB"
    args = build_parser().parse_args(["serve", "m", "--served-model-name", "a", "b"])
    assert (args.model_tag, args.served_model_name) == ("m", ["a", "b"])
    args = build_parser().parse_args(
        ["serve", "--max-model-len", "2k", "--kv-cache-dtype", "auto", "--enable-log-requests"]
    )
    assert (args.max_model_len, args.disable_log_requests) == (2000, False)
    assert build_parser().parse_args(["serve", "--max-model-len", "1K"]).max_model_len == 1024


def test_several_served_names_resolve_to_one_model(tiny_model_dir):
    from tokenmill.engine_args import EngineArgs

    args = EngineArgs(model=tiny_model_dir, served_model_name=["a", "b", "a"], load_format="dummy")
    config = args.create_engine_config().model_config
    assert (config.served_model_name, config.served_model_names) == ("a", ("a", "b"))
    one = EngineArgs(model=tiny_model_dir, served_model_name="solo", load_format="dummy")
    assert one.create_engine_config().model_config.served_model_names == ("solo",)


def test_stream_interval_reaches_the_scheduler_config(tiny_model_dir):
    args = build_parser().parse_args(["serve", tiny_model_dir, "--stream-interval", "8"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.scheduler_config.stream_interval == 8


def test_kernel_config_reaches_the_engine_config(tiny_model_dir):
    from tokenmill.config import KernelConfig

    flag = '{"skinny_gemm": "off"}'
    assert build_parser().parse_args(["serve", "--kernel-config", flag]).kernel_config == flag
    for value in (flag, {"skinny_gemm": "off"}, KernelConfig(skinny_gemm="off")):
        args = EngineArgs(model=tiny_model_dir, load_format="dummy", kernel_config=value)
        assert args.create_engine_config().kernel_config == KernelConfig(skinny_gemm="off")
    default = EngineArgs(model=tiny_model_dir, load_format="dummy").create_engine_config()
    assert default.kernel_config == KernelConfig()


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("TOKENMILL_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["/no/such/model"], "does not exist"),
        (["--tensor-parallel-size", "2"], "tensor parallel"),
        (["{tiny}", "--max-model-len", "100000"], "max-model-len"),
    ],
)
def test_startup_errors_fail_in_one_line(tiny_model_dir, argv, words):
    """Invalid settings are reported before the engine starts: one line, exit code 1."""
    argv = [a.replace("{tiny}", tiny_model_dir) for a in argv]
    result = subprocess.run(
        # --port 0: the port is bound first; a busy default port must not mask the error.
        [*SERVE_COMMAND, *argv, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("tokenmill serve: error:") and words in lines[0]


def _quantized_copy(tiny_model_dir: str, folder, qc: dict) -> str:
    import json
    import shutil

    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_an_unsupported_quantization_exits_2_in_one_line(tiny_model_dir, tmp_path):
    """A checkpoint quantized with a method tokenmill does not run is refused before any
    weight is read: one line naming the method and what is supported, exit code 2."""
    folder = _quantized_copy(tiny_model_dir, tmp_path / "m", {"quant_method": "hqq", "nbits": 4})
    result = subprocess.run([*SERVE_COMMAND, folder, "--port", "0"], capture_output=True,
                            text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("tokenmill serve: error:")
    assert "'hqq' is not supported" in lines[0] and "supported: awq, gptq" in lines[0]


@pytest.mark.parametrize("qc", [{"quant_method": "fbgemm_fp8"}, {"quant_method": "mxfp4"}])
def test_unsupported_fp8_methods_raise_the_exit_2_error(tiny_model_dir, tmp_path, qc):
    from tokenmill.config import UnsupportedQuantizationError

    folder = _quantized_copy(tiny_model_dir, tmp_path / "m", qc)
    with pytest.raises(UnsupportedQuantizationError, match=qc["quant_method"]):
        EngineArgs(model=folder, load_format="dummy").create_engine_config("server")


def test_a_max_num_seqs_beyond_host_memory_is_refused_before_loading(tiny_model_dir):
    # The worker's token table is max_num_seqs x max_model_len int32s: 2.9 PiB failed as a
    # MemoryError traceback after the model had loaded.
    args = EngineArgs(model=tiny_model_dir, max_num_seqs=99_999_999_999, load_format="dummy")
    with pytest.raises(ConfigError, match="table of token ids in host memory"):
        args.create_engine_config("server")


def test_bench_throughput_checks_its_dataset_flags_before_the_engine(monkeypatch, capsys):
    from tokenmill.benchmarks import throughput
    from tokenmill.entrypoints.cli.bench import main as bench_main

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(throughput, "make_llm", no_engine)
    argv = ["throughput", "--model", "/no/such/model", "--num-prompts", "0"]
    assert bench_main(argv) == 2
    assert "--num-prompts must be at least 1" in capsys.readouterr().err
    argv = ["throughput", "--model", "/no/such/model", "--random-input-len", "-1"]
    assert bench_main(argv) == 2
    assert "--random-input-len and --random-prefix-len must be" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_model_len": 0}, "--max-model-len must be positive"),
        ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization must be in"),
        ({"kv_cache_memory": "0"}, "--kv-cache-memory must be positive"),
        # torch.manual_seed failed on it in the engine process, after the model loaded.
        ({"seed": 2**80}, "--seed must be a 64-bit signed integer"),
        ({"served_model_name": [""]}, "a served model name cannot be empty"),
        ({"served_model_name": "  "}, "a served model name cannot be empty"),
        ({"kernel_config": '{"skinny_gemm": "fast"}'}, "skinny_gemm must be one of"),
        ({"kernel_config": "{"}, "--kernel-config is not valid JSON"),
        ({"stream_interval": 0}, "--stream-interval must be at least 1"),
    ],
)
def test_flag_ranges_are_checked_before_the_model_is_read(kwargs, words):
    # A missing model would be reported first if the model were read first.
    with pytest.raises(ConfigError, match=words):
        EngineArgs(model="/no/such/model", **kwargs).create_engine_config("server")


CONFIG_YAML = """\
model: /models/from-file
port: 9000
tensor_parallel_size: 1
enable-prefix-caching: false
enforce-eager: true
max-num-seqs: 8
lora-modules: [sql=/adapters/sql, chat=/adapters/chat]
speculative-config: {method: ngram, num_speculative_tokens: 4}
"""


def _parsed(argv: list[str]):
    parser = build_parser()
    return parse_args(parser, expand_config_file(parser, argv))


def test_config_file_flags_and_command_line_precedence(tmp_path):
    """``--config FILE.yaml`` as vllm's: keys are flags (underscores read as dashes), true a
    bare flag, false the --no- form, lists and mappings as the flag's values; a flag on the
    command line wins over the file's, and a positional model over the file's model."""
    path = tmp_path / "serve.yaml"
    path.write_text(CONFIG_YAML)
    args = _parsed(["serve", "--config", str(path), "--port", "9100"])
    assert (args.model, args.port, args.tensor_parallel_size) == ("/models/from-file", 9100, 1)
    assert args.enable_prefix_caching is False and args.enforce_eager is True
    assert args.max_num_seqs == 8
    assert args.lora_modules == ["sql=/adapters/sql", "chat=/adapters/chat"]
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 4}
    args = _parsed(["serve", "/models/cli", f"--config={path}"])
    assert (args.model_tag, args.model, args.port) == ("/models/cli", None, 9000)


@pytest.mark.parametrize(
    "text, name, words",
    [
        ("port: [1", "bad.yaml", "not valid YAML"),
        ("- port\n- 1\n", "list.yaml", "expected a mapping"),
        ("port:\n", "null.yaml", "port has no value"),
        ("port: 1\n", "flags.json", "must be YAML"),
        (None, "missing.yaml", "No such file"),
        ("config: other.yaml\n", "nested.yaml", "a config file cannot name another"),
        ("base: 1\n", "unknown.yaml", "base is not a flag of this command"),
        ("512: 1\n", "number.yaml", "512 is not a flag of this command"),
        ("stream-interval: [4, 2]\n", "list.yaml", "stream-interval takes one value"),
        ("enforce-eager: 1\n", "int.yaml", "enforce-eager takes true or false, got 1"),
    ],
)
def test_bad_config_files_fail_in_one_line(capsys, tmp_path, text, name, words):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    code, out, err = run_main(capsys, ["serve", "--config", str(path)])
    assert code == 2 and out == ""
    assert err.startswith(f"tokenmill: error: --config {path}: ") and words in err
    assert err.count("\n") == 1


def test_config_flag_given_twice_or_without_a_file(capsys, tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("port: 1\n")
    assert run_main(capsys, ["serve", "--config", str(path), "--config", str(path)])[:2] == (
        2, "")  # fmt: skip
    code, _, err = run_main(capsys, ["serve", "--config"])
    assert code == 2 and "--config needs a YAML file" in err


def test_config_file_flags_reach_bench_commands(tmp_path):
    """The file's flags go after a nested command's name (``bench throughput``)."""
    path = tmp_path / "bench.yaml"
    path.write_text("num-prompts: 7\ninput-len: 16\n")
    args = _parsed(["bench", "throughput", "--config", str(path), "--input-len", "32"])
    assert (args.num_prompts, args.random_input_len) == (7, 32)

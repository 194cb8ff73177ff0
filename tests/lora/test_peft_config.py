"""PEFT adapter folders and the LoRA flags: what is served and what is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tokenmill.config import ConfigError
from tokenmill.engine_args import EngineArgs
from tokenmill.lora.config import create_lora_config, parse_lora_module
from tokenmill.lora.peft import (
    LoRAAdapterError,
    is_targeted,
    load_peft_weights,
    read_peft_config,
)


def _folder(tmp_path, config: dict, tensors: dict | None = None):
    base = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps({**base, **config}))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = tensors or {f"{key}.lora_A.weight": torch.ones(8, 4),
                          f"{key}.lora_B.weight": torch.ones(4, 8)}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    return str(tmp_path)


def test_scale_and_rslora(tmp_path):
    assert read_peft_config(_folder(tmp_path, {}), 16).scale == 2.0
    assert read_peft_config(_folder(tmp_path, {"use_rslora": True, "r": 16,
                                                "lora_alpha": 8}), 16).scale == 2.0


@pytest.mark.parametrize(
    "config, message",
    [
        ({"r": 32}, "rank 32 is greater than max_lora_rank 16"),
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
        ({"bias": "all"}, "biases"),
        ({"peft_type": "IA3"}, "IA3"),
        ({"r": True}, "r must be a positive integer"),
        ({"lora_alpha": "16"}, "lora_alpha must be a number"),
        ({"lora_alpha": None}, "lora_alpha must be a number"),
        ({"lora_alpha": float("nan")}, "not a finite number"),
        ({"lora_alpha": float("inf")}, "not a finite number"),
        ({"lora_alpha": 10**400}, "not a finite number"),
        ({"use_rslora": "yes"}, "use_rslora must be true or false"),
        ({"target_modules": [["q_proj"]]}, "target_modules must list module names"),
        ({"target_modules": "[unclosed"}, "is not a regular expression"),
        # peft variants whose forward differs from B A x
        ({"alora_invocation_tokens": [1, 2]}, "activated LoRA"),
        ({"arrow_config": {"top_k": 2}}, "Arrow"),
        ({"kasa_config": {}}, "KaSA"),
    ],
)
def test_refused_configs(tmp_path, config, message):
    with pytest.raises(LoRAAdapterError, match=message):
        read_peft_config(_folder(tmp_path, config), 16)


def test_target_modules_as_peft_reads_them(tmp_path):
    """Entries naming a module by a dotted suffix, and peft's "all-linear" shorthand, target
    the projections as peft's own loader reads them (peft writes both forms)."""
    q = "model.layers.0.self_attn.q_proj"
    for targets, hit, miss in [
        (["self_attn.q_proj", "mlp.down_proj"], [q, "model.layers.3.mlp.down_proj"],
         ["model.layers.0.self_attn.v_proj", "model.layers.0.mlp.xdown_proj"]),
        ([q], [q], ["model.layers.10.self_attn.q_proj"]),
        ("ALL-LINEAR", [q, "model.layers.2.mlp.up_proj"], []),
        (r".*\.0\..*q_proj", [q], ["model.layers.1.self_attn.q_proj"]),
    ]:  # fmt: skip
        config = read_peft_config(_folder(tmp_path, {"target_modules": targets}), 16)
        assert all(is_targeted(config, m) for m in hit), targets
        assert not any(is_targeted(config, m) for m in miss), targets
    with pytest.raises(LoRAAdapterError, match=r"\['mlp.fc1'\] are not supported"):
        read_peft_config(_folder(tmp_path, {"target_modules": ["q_proj", "mlp.fc1"]}), 16)


def test_layers_to_transform_and_exclude_modules_as_peft_reads_them(tmp_path):
    """peft gives a listed target a LoRA layer only in ``layers_to_transform`` (the first
    number after ``layers_pattern``, or after any name part) and never in
    ``exclude_modules``: a weight elsewhere is one peft would not load."""
    layer = "model.layers.{}.self_attn.q_proj".format
    for extra, hit, miss in [
        ({"layers_to_transform": [0, 2]}, [layer(0), layer(2)], [layer(1), layer(12)]),
        ({"layers_to_transform": 1, "layers_pattern": "layers"}, [layer(1)], [layer(0)]),
        ({"layers_to_transform": [3], "layers_pattern": ["blocks"]}, [], [layer(3)]),
        ({"layers_to_transform": []}, [layer(0), layer(7)], []),
        ({"exclude_modules": ["layers.1.self_attn.q_proj"]}, [layer(0)], [layer(1)]),
        ({"exclude_modules": r".*\.1\..*"}, [layer(0), layer(11)], [layer(1)]),
    ]:  # fmt: skip
        config = read_peft_config(_folder(tmp_path, {"target_modules": ["q_proj"], **extra}), 16)
        assert all(is_targeted(config, m) for m in hit), extra
        assert not any(is_targeted(config, m) for m in miss), extra
    for extra in ({"layers_to_transform": "0"}, {"layers_to_transform": [True]},
                  {"layers_pattern": 3}, {"layers_pattern": ["layers", "(x"]},
                  {"exclude_modules": "[x"}):  # fmt: skip
        with pytest.raises(LoRAAdapterError, match=next(iter(extra))):
            read_peft_config(_folder(tmp_path, extra), 16)


def test_rank_and_alpha_patterns_give_each_module_its_scale(tmp_path):
    """peft's ``rank_pattern``/``alpha_pattern``: the first key matching the end of a
    module's name (after a dot) gives its r / alpha, in the file's order."""
    from tokenmill.lora.peft import module_rank_scale

    q, v = "model.layers.{}.self_attn.q_proj".format, "model.layers.{}.self_attn.v_proj".format
    config = read_peft_config(_folder(tmp_path, {
        "target_modules": ["q_proj", "v_proj"],
        "rank_pattern": {"layers.1.self_attn.v_proj": 2, "q_proj": 4, "v_proj": 16},
        "alpha_pattern": {r"layers\.[23]\.self_attn\.q_proj": 32},
    }), 16)  # fmt: skip
    assert module_rank_scale(config, q(0)) == (4, 16 / 4)
    assert module_rank_scale(config, q(2)) == (4, 32 / 4)
    assert module_rank_scale(config, v(1)) == (2, 16 / 2)
    assert module_rank_scale(config, v(0)) == (16, 16 / 16)
    assert module_rank_scale(config, "model.layers.0.mlp.xq_proj") == (8, 2.0)  # no dot
    config = read_peft_config(_folder(tmp_path, {"use_rslora": True, "lora_alpha": 8,
                                                 "rank_pattern": {"q_proj": 16}}), 16)  # fmt: skip
    assert module_rank_scale(config, q(0)) == (16, 8 / 4)
    for extra, message in [
        ({"rank_pattern": {"q_proj": 32}}, "from 1 to max_lora_rank 16, got 32"),
        ({"rank_pattern": {"q_proj": 2.0}}, "must be a rank"),
        ({"rank_pattern": {"(q": 2}}, "not a regular expression"),
        ({"alpha_pattern": {"q_proj": "8"}}, "must be an alpha"),
        ({"alpha_pattern": {"q_proj": 10**400}}, "not a finite number"),
        ({"alpha_pattern": ["q_proj"]}, "must map module patterns"),
    ]:
        with pytest.raises(LoRAAdapterError, match=message):
            read_peft_config(_folder(tmp_path, extra), 16)


def test_refused_folders_and_tensors(tmp_path):
    with pytest.raises(LoRAAdapterError, match="no adapter folder"):
        read_peft_config(str(tmp_path / "missing"), 16)
    with pytest.raises(LoRAAdapterError, match="adapter_config.json"):
        read_peft_config(str(tmp_path), 16)
    # A config that is not UTF-8, or nests past the parser's depth, is an adapter that
    # cannot be served like any other (not an error that ends the engine's step).
    folder = _folder(tmp_path, {})
    config = tmp_path / "adapter_config.json"
    for text in (b'{"r": 8, "base_model_name_or_path": "caf\xe9"}', b"[" * 100_000):
        config.write_bytes(text)
        with pytest.raises(LoRAAdapterError, match="cannot read .*adapter_config.json"):
            read_peft_config(folder, 16)
    folder = _folder(tmp_path, {}, {
        "base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(8, 4)})
    with pytest.raises(LoRAAdapterError, match="embedding"):
        load_peft_weights(folder)


def test_lora_module_forms():
    assert parse_lora_module("sql=/a/sql").path == "/a/sql"
    m = parse_lora_module('{"name": "chat", "path": "/a/chat", "base_model_name": "llama"}')
    assert (m.name, m.path, m.base_model_name) == ("chat", "/a/chat", "llama")
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_module("nopath")
    # refused with the flag's message, not when the engine reads the adapter after start-up
    with pytest.raises(ValueError, match="--lora-modules: a JSON entry needs string fields"):
        parse_lora_module('{"name": "chat", "path": "/a/chat", "base_model_name": 5}')


def test_flag_checks():
    assert create_lora_config(False, None, 1, 16, None, "auto", False) is None
    config = create_lora_config(True, ["a=/x"], 2, 64, None, "auto", False)
    assert (config.max_loras, config.max_cpu_loras, config.max_lora_rank) == (2, 2, 64)
    for args, message in [
        ((False, ["a=/x"], 1, 16, None, "auto", False), "needs --enable-lora"),
        ((False, None, 1, 16, None, "auto", True), "--fully-sharded-loras needs --enable-lora"),
        ((True, None, 1, 15, None, "auto", False), "--max-lora-rank"),
        ((True, None, 4, 16, 2, "auto", False), "--max-cpu-loras"),
        ((True, ["a=/x", "a=/y"], 1, 16, None, "auto", False), "repeat"),
    ]:
        with pytest.raises(ValueError, match=message):
            create_lora_config(*args)
    # --fully-sharded-loras splits each slot's ranks over the tensor-parallel ranks.
    assert create_lora_config(True, None, 1, 16, None, "auto", True, 2).fully_sharded_loras
    with pytest.raises(ValueError, match=r"--max-lora-rank \(16\) .* --tensor-parallel-size \(3\)"):
        create_lora_config(True, None, 1, 16, None, "auto", True, 3)
    # No rank vLLM allows divides 3: the message says so instead of asking for one.
    with pytest.raises(ValueError, match="no allowed rank is: drop --fully-sharded-loras"):
        create_lora_config(True, None, 1, 8, None, "auto", True, 3)
    with pytest.raises(ValueError, match=r"\(4\); e.g. 8$"):
        create_lora_config(True, None, 1, 1, None, "auto", True, 4)


def test_lora_on_a_quantized_model_is_refused(smollm2_gguf_path):
    with pytest.raises(ConfigError, match="unquantized.*--gguf-dequantize"):
        EngineArgs(model=smollm2_gguf_path, device="cpu", enable_lora=True).create_engine_config()


def test_a_wrong_lora_modules_folder_fails_before_the_model_loads(smollm2_gguf_path, tmp_path):
    args = EngineArgs(model=smollm2_gguf_path, device="cpu", gguf_dequantize=True,
                      enable_lora=True, lora_modules=[f"bad={tmp_path}"])  # fmt: skip
    with pytest.raises(ConfigError, match="--lora-modules bad=.*adapter_config.json"):
        args.create_engine_config()


def test_an_adapter_named_as_the_base_model_is_refused(smollm2_gguf_path, tmp_path):
    """An adapter given the served name would take the base model's place in requests: a
    start-up error, as the run-time load's 400."""
    args = EngineArgs(model=smollm2_gguf_path, device="cpu", gguf_dequantize=True,
                      served_model_name=["smol", "alias"], enable_lora=True,
                      lora_modules=[f"alias={tmp_path}"])  # fmt: skip
    with pytest.raises(ConfigError, match="'alias' is the base model's served name"):
        args.create_engine_config()


def test_repeated_lora_modules_flags_add_up():
    from tokenmill.entrypoints.cli.main import build_parser

    args = build_parser().parse_args(
        ["serve", "m", "--lora-modules", "a=/x", "--lora-modules", "b=/y", "c=/z"]
    )
    assert args.lora_modules == ["a=/x", "b=/y", "c=/z"]


def test_adapter_slots_that_do_not_fit_are_refused_before_allocation(monkeypatch):
    """Slots are sized for every wrapped layer before any is allocated: more than the free
    memory is a one-line error naming the flags."""
    import psutil

    from tokenmill.config import LoRAConfig
    from tokenmill.lora import manager
    from tokenmill.model.layers.linear import ColumnParallelLinear

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.o_proj = ColumnParallelLinear(64, 64, bias=False)

    class Mem:
        available = 10_000  # bytes: less than 3 slots of A [16, 64] and B [16, 64] in fp32

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem)
    config = LoRAConfig(2, 16, 2, "auto", [], False)
    batch = manager.LoRABatch(torch.zeros(8, dtype=torch.int32))
    model = Tiny()
    with pytest.raises(ValueError, match=r"--max-loras 2, --max-lora-rank 16\) need"):
        manager.wrap_lora_layers(model, config, torch.float32, batch)
    assert isinstance(model.o_proj, ColumnParallelLinear)  # nothing replaced
    Mem.available = 10**9
    layers = manager.wrap_lora_layers(model, config, torch.float32, batch)
    assert layers["o_proj"].lora_a.shape == (3, 16, 64)

"""Weight loading: safetensors (single, sharded), dummy, and the errors users see."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill.config import ConfigError, LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.hf_config import ModelLoadError, load_hf_config, normalize_rope
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.loader.model_loader import get_model
from tokenmill.model.registry import UnsupportedArchitectureError

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny")
    cfg = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**cfg)).save_pretrained(path)
    return str(path)


def _load(path: str, **kw):
    cfg = EngineArgs(model=path, dtype="float32", device="cpu", **kw).create_engine_config()
    return get_model(
        cfg.model_config,
        LoadConfig(kw.get("load_format", "auto")),
        torch.device("cpu"),
        TorchAttentionBackend,
    )


def _copy_folder(src: str, dst, skip=()):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name not in skip:
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    return str(dst)


def test_loads_single_file(hf_folder):
    model = _load(hf_folder)
    ref = load_file(os.path.join(hf_folder, "model.safetensors"))
    q = ref["model.layers.1.self_attn.q_proj.weight"]
    torch.testing.assert_close(model.model.layers[1].self_attn.qkv_proj.weight[: q.shape[0]], q)


def test_loads_sharded_with_index(hf_folder, tmp_path):
    folder = _copy_folder(hf_folder, tmp_path / "sharded", skip=("model.safetensors",))
    tensors = load_file(os.path.join(hf_folder, "model.safetensors"))
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(folder, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    model = _load(folder)
    torch.testing.assert_close(model.lm_head.weight, tensors["lm_head.weight"])


def test_dummy_reads_no_weight_file(hf_folder, tmp_path, monkeypatch):
    folder = _copy_folder(hf_folder, tmp_path / "dummy", skip=("model.safetensors",))
    import tokenmill.model.loader.safetensors_loader as st

    def fail(*a, **k):
        raise AssertionError("a weight file was read")

    monkeypatch.setattr(st, "safe_open", fail)
    model = _load(folder, load_format="dummy")
    w = model.model.layers[0].mlp.gate_up_proj.weight
    assert w.abs().max() <= 1e-3 and w.abs().max() > 0
    # same seed, same weights
    torch.testing.assert_close(
        _load(folder, load_format="dummy").lm_head.weight, model.lm_head.weight
    )


def test_truncated_file_names_the_tensor(hf_folder, tmp_path):
    folder = _copy_folder(hf_folder, tmp_path / "truncated")
    path = os.path.join(folder, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*tensor '[^']+' is truncated"):
        _load(folder)


def test_wrong_shape_names_the_tensor(hf_folder, tmp_path):
    folder = _copy_folder(hf_folder, tmp_path / "shape")
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(32, 60)
    save_file(tensors, path)
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*\(32, 60\)"
    ):
        _load(folder)


def test_missing_tensor_is_named(hf_folder, tmp_path):
    folder = _copy_folder(hf_folder, tmp_path / "missing")
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=r"qkv_proj.*shards \['k'\]"):
        _load(folder)


@pytest.mark.parametrize("rows", [16, 48])
def test_merged_part_of_the_wrong_size_is_a_shape_error(hf_folder, tmp_path, rows):
    """A part of a merged weight (q of qkv) with fewer or more rows than the config gives it
    is refused as a wrong shape: not an IndexError of the narrowing, and not cut down to
    its first rows."""
    folder = _copy_folder(hf_folder, tmp_path / "wrong")
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(rows, 32)
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=rf"q_proj\.weight.*\({rows}, 32\), expected 32"):
        _load(folder)


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**CONFIG, "architectures": ["FooForCausalLM"]})
    )
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        _load(str(tmp_path), load_format="dummy")


def test_max_model_len_over_model_limit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ConfigError, match="maximum context length of 128"):
        EngineArgs(model=str(tmp_path), max_model_len=129, device="cpu").create_engine_config()
    cfg = EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()
    assert cfg.model_config.max_model_len == 128
    assert cfg.model_config.dtype == "float32"


def test_missing_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        EngineArgs(model="/nonexistent/model", device="cpu").create_engine_config()


def test_unimplemented_flags_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ConfigError, match="quantization"):
        EngineArgs(model=str(tmp_path), quantization="awq").create_engine_config()


def test_rope_normalisation_both_formats():
    old = normalize_rope({"rope_theta": 500000, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old["rope_theta"] == 500000.0 and old["rope_scaling"] == {
        "factor": 2.0,
        "rope_type": "linear",
    }
    new = normalize_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert new["rope_theta"] == 1e6 and new["rope_scaling"] is None


def test_gguf_config(smollm2_gguf_path):
    config, generation_config = load_hf_config(smollm2_gguf_path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (
        576,
        30,
        3,
    )
    assert config.tie_word_embeddings is True and config.eos_token_id == 2
    assert generation_config == {}


def test_safetensors_tensors_are_read_as_slices(tmp_path):
    """A rank reads only the region its weight loader narrows to (tensor parallelism)."""
    from safetensors.torch import save_file

    from tokenmill.model.loader.safetensors_loader import iterate_safetensors

    w = torch.arange(24.0).reshape(4, 6)
    save_file({"w": w, "s": torch.tensor(3.0)}, str(tmp_path / "model.safetensors"))
    tensors = dict(iterate_safetensors([str(tmp_path / "model.safetensors")]))
    sliced = tensors["w"].narrow(1, 2, 3).narrow(0, 1, 2)
    assert tuple(sliced.shape) == (2, 3)
    torch.testing.assert_close(sliced.read(), w[1:3, 2:5])
    target = torch.zeros(2, 3, dtype=torch.float64)
    target.copy_(sliced)  # a weight loader's copy reads the region (torch function protocol)
    torch.testing.assert_close(target, w[1:3, 2:5].double())
    assert float(tensors["s"].read()) == 3.0
    assert int(tensors["w"][-1][-1]) == 23 and len(tensors["w"]) == 4  # as a tensor's
    with pytest.raises(IndexError, match="outside a tensor of shape"):
        tensors["w"].narrow(0, 3, 2)


def test_tensor_slice_dtype_comes_from_the_header(tmp_path, monkeypatch):
    """Loaders that branch on a tensor's dtype (packed integers or floats) do not read it."""
    from safetensors.torch import save_file

    from tokenmill.model.loader.safetensors_loader import TensorSlice, iterate_safetensors

    save_file({"f": torch.ones(2, 2, dtype=torch.bfloat16), "q": torch.ones(4, dtype=torch.uint8)},
              str(tmp_path / "model.safetensors"))
    tensors = dict(iterate_safetensors([str(tmp_path / "model.safetensors")]))
    monkeypatch.setattr(TensorSlice, "read", lambda self: pytest.fail("read"))
    assert tensors["f"].dtype == torch.bfloat16 and tensors["f"].is_floating_point()
    assert tensors["q"].dtype == torch.uint8 and not tensors["q"].is_floating_point()


def _engine_config(path: str):
    return EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config()


def _reload(model, path: str, model_path: str) -> None:
    from tokenmill.model.loader.model_loader import reload_weights

    cfg = _engine_config(model_path)
    reload_weights(model, cfg.model_config, LoadConfig(), torch.device("cpu"),
                   TorchAttentionBackend, path=path)  # fmt: skip


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: p.clone() for name, p in model.named_parameters()}


def _shifted(folder: str) -> dict[str, torch.Tensor]:
    """``folder``'s tensors plus one: other weights of the same shapes."""
    return {n: t + 1 for n, t in load_file(os.path.join(folder, "model.safetensors")).items()}


def _assert_unchanged(model, before: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_reload_checks_the_whole_checkpoint_before_writing(hf_folder, tmp_path):
    """Weights loaded in place are checked from the file's header first: a wrong shape after
    good tensors (in the file's order), an unknown tensor and a missing one are all named in
    one error, and no weight was written."""
    model = _load(hf_folder)
    before = _weights(model)
    tensors = _shifted(hf_folder)
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 32)  # transposed
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(4)
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    with pytest.raises(ModelLoadError) as e:
        _reload(model, path, hf_folder)
    message = str(e.value)
    assert "model.layers.1.mlp.down_proj.weight" in message and "(64, 32)" in message
    assert "'model.layers.1.mlp.extra.weight' does not belong to any parameter" in message
    assert "qkv_proj.weight (shards ['v'])" in message
    _assert_unchanged(model, before)


def test_dry_run_reads_no_values_and_writes_nothing(hf_folder, tmp_path, monkeypatch):
    """``load_weights(dry_run=True)`` works from the file's header: no tensor's values are
    read and no weight is written."""
    import tokenmill.model.loader.safetensors_loader as st
    from tokenmill.model.loader.model_loader import load_weights

    class HeaderOnly:  # a tensor's handle whose values cannot be read
        def __init__(self, handle) -> None:
            self.get_shape, self.get_dtype = handle.get_shape, handle.get_dtype

        def __getitem__(self, index):
            pytest.fail("a tensor's values were read")

    model = _load(hf_folder)
    before = _weights(model)
    path = str(tmp_path / "model.safetensors")
    save_file(_shifted(hf_folder), path)
    init = st.TensorSlice.__init__
    monkeypatch.setattr(st.TensorSlice, "__init__",
                        lambda self, handle, *a, **k: init(self, HeaderOnly(handle), *a, **k))
    load_weights(model, _engine_config(hf_folder).model_config, "safetensors", path,
                 dry_run=True)  # fmt: skip
    _assert_unchanged(model, before)


def _write_gguf(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` (Hugging Face names) as a Llama GGUF file, llama.cpp's names, in order."""
    import gguf

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, CONFIG["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(CONFIG["num_hidden_layers"])
    for name, tensor in tensors.items():
        writer.add_tensor(name_map.get_name(name, try_suffixes=(".weight",)), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_reload_checks_a_gguf_file_before_writing(hf_folder, tmp_path):
    """The same check for a GGUF file (from its tensor infos): a tensor of the wrong shape
    written last leaves the weights as they were; the file without it loads."""
    model = _load(hf_folder)
    before = _weights(model)
    tensors = _shifted(hf_folder)
    down = "model.layers.1.mlp.down_proj.weight"
    good = {**{n: t for n, t in tensors.items() if n != down}, down: tensors[down]}
    bad = {**good, down: tensors[down].T.contiguous()}
    _write_gguf(str(tmp_path / "bad.gguf"), bad)
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight.*\(64, 32\)"):
        _reload(model, str(tmp_path / "bad.gguf"), hf_folder)
    _assert_unchanged(model, before)
    _write_gguf(str(tmp_path / "good.gguf"), good)
    _reload(model, str(tmp_path / "good.gguf"), hf_folder)
    embed = model.model.embed_tokens.weight
    torch.testing.assert_close(embed, tensors["model.embed_tokens.weight"])
    torch.testing.assert_close(model.model.layers[1].mlp.down_proj.weight, tensors[down])


@pytest.mark.parametrize("heads, kv_heads, words", [
    (4, 0, "num_key_value_heads must be a positive integer, got 0"),
    (0, None, "num_attention_heads must be a positive integer, got 0"),
    (4, 3, r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
])  # fmt: skip
def test_head_counts_are_checked_with_the_config(tmp_path, heads, kv_heads, words):
    """Head counts the attention layers cannot be built from: one error when the config is
    read, not a ZeroDivisionError in the engine."""
    config = {**CONFIG, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=words):
        load_hf_config(str(tmp_path))

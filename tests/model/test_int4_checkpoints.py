"""AWQ, GPTQ and compressed-tensors W4A16 checkpoints: the unpacked weights equal the exactly
dequantized ones, and logits match transformers on the same (dequantized) weights; for
compressed-tensors also transformers loading the compressed checkpoint itself.

The AWQ/GPTQ reference is a float32 model carrying the exactly dequantized weights: transformers
runs those formats only through GPU kernel packages (autoawq, gptqmodel) that do not install
on a CPU-only machine. The products run in bfloat16 on the CPU (torch's int4 kernel), so the
logits agree to bfloat16 precision, not float32's.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.paged import PagedRunner
from tests.model.quant_checkpoints import _quant_config, make_int4_checkpoint
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.kernels.quant import int4_cpu
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.layers.quantization import int4 as int4_module
from tokenmill.model.loader.model_loader import get_model

CASES = [
    ("gptq", 32, True, False),
    ("gptq", 64, False, True),
    ("gptq_v2", 128, False, False),
    ("awq", 32, False, False),
    ("awq", -1, True, False),
    ("ct", 64, True, False),
    ("ct", 32, False, True),
    ("ct", -1, False, False),
]
# bfloat16 products: max |difference| relative to the largest |logit|.
BF16_RELATIVE = 2e-2


def _load(path: str, monkeypatch, cpu_bf16_weights: str = "auto"):
    captured = {}
    original = int4_module.set_device_form

    def capture(layer, w, *args):
        captured[id(layer)] = w.dequantize()
        original(layer, w, *args)

    monkeypatch.setattr(int4_module, "set_device_form", capture)
    cfg = EngineArgs(model=path, dtype="float32", device="cpu",
                     kernel_config={"cpu_bf16_weights": cpu_bf16_weights}).create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend,
                      cfg.kernel_config)
    return cfg, model, captured


def _logits(model, cfg, ids):
    runner = PagedRunner(model, cfg.model_config.hf_config, num_blocks=32)
    return runner.step({"a": ids}, {"a": ids})


@pytest.mark.parametrize("cpu_bf16_weights", ["off", "on"])
@pytest.mark.parametrize("fmt, group, sym, act_order", CASES)
def test_int4_checkpoint_matches_dequantized_reference(tmp_path, monkeypatch, fmt, group, sym,
                                                       act_order, cpu_bf16_weights):
    """The 42-token prompt's products run on the int4 kernel ("off") or on the bfloat16 copy
    ("on": prompt rows), the act-order permutation included."""
    from transformers import AutoModelForCausalLM

    folder = make_int4_checkpoint(str(tmp_path), fmt, group, sym, act_order)
    cfg, model, captured = _load(f"{folder}/quant", monkeypatch, cpu_bf16_weights)
    ref = AutoModelForCausalLM.from_pretrained(f"{folder}/reference").eval()
    state = ref.state_dict()
    for name, module in model.named_modules():
        if id(module) not in captured:
            continue
        parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj",
                                                                              "up_proj")}
        leaf = name.rsplit(".", 1)[1]
        names = [name.replace(leaf, p) for p in parts.get(leaf, (leaf,))]
        expected = torch.cat([state[f"{n}.weight"] for n in names])
        assert torch.equal(captured[id(module)], expected), name
    assert len(captured) == 2 * 4  # every projection of both layers
    ids = list(range(3, 45))
    # The model runner marks prompt rows; here every row of the pass is one.
    with int4_cpu.prompt_rows(int4_cpu.PromptRows(len(ids), None, None)):
        logits = _logits(model, cfg, ids)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (logits - expected).abs().max() <= BF16_RELATIVE * expected.abs().max()


@pytest.mark.parametrize("group", [32, -1])
def test_compressed_tensors_matches_transformers_loading_it(tmp_path, monkeypatch, group):
    """transformers decompresses the checkpoint with the compressed-tensors package
    (symmetric: its loader expects asymmetric zero points unpacked, unlike the compressor,
    so those are checked against the dequantized reference above)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    folder = make_int4_checkpoint(str(tmp_path), "ct", group, True)
    cfg, model, _ = _load(f"{folder}/quant", monkeypatch)
    hf = AutoModelForCausalLM.from_pretrained(f"{folder}/quant", dtype=torch.float32).eval()
    ids = list(range(5, 40))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
    logits = _logits(model, cfg, ids)
    assert (logits - expected).abs().max() <= BF16_RELATIVE * expected.abs().max()


@pytest.mark.parametrize("fmt", ["gptq", "ct"])
def test_dummy_weights_of_an_act_order_checkpoint_load(tmp_path, fmt):
    """``--load-format dummy`` on an act-order checkpoint: the group index, not filled at
    random, keeps its groups in order, so the layers build (it was left uninitialised)."""
    folder = make_int4_checkpoint(str(tmp_path), fmt, 32, False, act_order=True)
    cfg = EngineArgs(model=f"{folder}/quant", dtype="float32", device="cpu",
                     load_format="dummy").create_engine_config()  # fmt: skip
    model = get_model(cfg.model_config, cfg.load_config, torch.device("cpu"),
                      TorchAttentionBackend, cfg.kernel_config)  # fmt: skip
    logits = _logits(model, cfg, [1, 2, 3])
    assert torch.isfinite(logits).all()


def test_compressed_tensors_older_spellings_load_the_same(tmp_path, monkeypatch):
    """compressed-tensors' own reader takes ``"actorder": true`` (its older form of
    ``"group"``) and strategy names in any case: so does tokenmill, with the same logits."""
    import json

    folder = make_int4_checkpoint(str(tmp_path), "ct", 32, False, act_order=True)
    cfg, model, _ = _load(f"{folder}/quant", monkeypatch)
    want = _logits(model, cfg, [1, 2, 3])
    path = f"{folder}/quant/config.json"
    config = json.load(open(path))
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights.update(actorder=True, strategy="GROUP")
    json.dump(config, open(path, "w"))
    cfg, model, _ = _load(f"{folder}/quant", monkeypatch)
    torch.testing.assert_close(_logits(model, cfg, [1, 2, 3]), want, rtol=0, atol=0)


@pytest.mark.parametrize("qc", [{}, None])
def test_quantized_tensors_without_a_quantization_config_say_so_first(tmp_path, qc):
    """A GPTQ folder whose config.json lost its quantization_config (or has an empty one)
    is built unquantized: the error's first problem says the tensors are quantized, before
    the tensors that match no parameter."""
    import json

    from tokenmill.hf_config import ModelLoadError

    folder = make_int4_checkpoint(str(tmp_path), "gptq", 32, True)
    path = f"{folder}/quant/config.json"
    config = json.load(open(path))
    if qc is None:
        del config["quantization_config"]
    else:
        config["quantization_config"] = qc
    json.dump(config, open(path, "w"))
    cfg = EngineArgs(model=f"{folder}/quant", dtype="float32", device="cpu").create_engine_config()
    with pytest.raises(ModelLoadError, match=r"problems: tensors such as '.*\.(qweight|qzeros|"
                       r"g_idx)' are quantized, but the model was built without"):  # fmt: skip
        get_model(cfg.model_config, cfg.load_config, torch.device("cpu"),
                  TorchAttentionBackend, cfg.kernel_config)  # fmt: skip


def test_marlin_spelling_loads_the_same_checkpoint(tmp_path):
    folder = make_int4_checkpoint(str(tmp_path), "gptq", 32, True)
    cfg = EngineArgs(model=f"{folder}/quant", quantization="gptq_marlin").create_engine_config()
    assert cfg.model_config.quantization == "gptq"


@pytest.mark.parametrize("fmt, file, legacy", [
    ("gptq", "quantize_config.json", {}),
    # AutoAWQ's own keys, without quant_method
    ("awq", "quant_config.json", {"w_bit": 4, "q_group_size": 32, "version": "GEMM"}),
])  # fmt: skip
def test_quantization_settings_in_a_separate_file(tmp_path, monkeypatch, fmt, file, legacy):
    """Older AutoGPTQ / AutoAWQ checkpoints keep their settings in quantize_config.json /
    quant_config.json beside a config.json without quantization_config (vLLM reads them):
    the same logits as the checkpoint with them in config.json."""
    import json
    import shutil

    folder = make_int4_checkpoint(str(tmp_path), fmt, 32, True)
    cfg, model, _ = _load(f"{folder}/quant", monkeypatch)
    ids = list(range(5, 30))
    expected = _logits(model, cfg, ids)
    moved = tmp_path / "moved"
    shutil.copytree(f"{folder}/quant", moved)
    config = json.loads((moved / "config.json").read_text())
    qc = config.pop("quantization_config")
    if legacy:
        qc = {"zero_point": True, **legacy}
    else:
        qc.pop("quant_method")
    (moved / "config.json").write_text(json.dumps(config))
    (moved / file).write_text(json.dumps(qc))
    cfg, model, _ = _load(str(moved), monkeypatch)
    assert cfg.model_config.quantization == fmt
    torch.testing.assert_close(_logits(model, cfg, ids), expected)


@pytest.mark.parametrize("kind, fmt", [("qwen3-moe", "gptq"), ("mixtral", "awq")])
def test_moe_experts_stay_int4(tmp_path, monkeypatch, kind, fmt):
    """Per-expert int4 tensors of an MoE checkpoint (routers unquantized, as the formats
    leave them) against transformers on the dequantized weights."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    from tests.model.quant_checkpoints import TINY_LLAMA, quantize_folder
    from tests.model.test_qwen3_parity import save_random_model

    common = {k: v for k, v in TINY_LLAMA.items() if k != "intermediate_size"}
    if kind == "qwen3-moe":
        config = Qwen3MoeConfig(**common, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=128, intermediate_size=128,
                                norm_topk_prob=True)
    else:
        config = MixtralConfig(**common, intermediate_size=128, num_local_experts=4,
                               num_experts_per_tok=2)
    save_random_model(config, tmp_path / "float", {"gate.weight": 40.0})
    quant, reference = quantize_folder(str(tmp_path / "float"), str(tmp_path), fmt, 32, False)
    cfg, model, captured = _load(quant, monkeypatch)
    assert any(m.quant_method is not None for m in model.modules()
               if type(m).__name__ == "FusedMoE")
    ids = list(range(3, 40))
    logits = _logits(model, cfg, ids)
    ref = AutoModelForCausalLM.from_pretrained(reference).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (logits - expected).abs().max() <= BF16_RELATIVE * expected.abs().max()


@pytest.mark.parametrize("fmt, leaf, dtype", [
    ("gptq", "qweight", torch.float32),  # int32 words would lose bits in a conversion
    ("gptq", "qweight", torch.uint8),  # narrower integers lost their upper nibbles
    ("awq", "qweight", torch.int16),
    ("ct", "weight_packed", torch.int16),
    ("awq", "scales", torch.int32),  # integer scales: written wrongly
    ("ct", "weight_scale", torch.int32),
])
def test_tensors_of_the_wrong_dtype_are_refused(tmp_path, monkeypatch, fmt, leaf, dtype):
    """A packed or scale tensor stored in a dtype its layout cannot take losslessly is refused
    with the tensor's name and both dtypes."""
    import os

    from safetensors.torch import load_file, save_file

    from tokenmill.hf_config import ModelLoadError

    folder = make_int4_checkpoint(str(tmp_path), fmt, 32, sym=True)
    path = os.path.join(folder, "quant", "model.safetensors")
    tensors = load_file(path)
    name = next(k for k in tensors if k.endswith(f"o_proj.{leaf}"))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=rf"{leaf}.* is {dtype}; this layout keeps it"):
        _load(os.path.join(folder, "quant"), monkeypatch)


@pytest.mark.parametrize("column, part", [(0, "k_proj"), (1, "q_proj"), (0, "down_proj")])
def test_compressed_tensors_weight_shape_must_match_the_layer(tmp_path, monkeypatch, column,
                                                              part):
    """A ``weight_shape`` that disagrees with the layer's part (output or input features) is
    refused with the tensor's name."""
    import os

    from safetensors.torch import load_file, save_file

    from tokenmill.hf_config import ModelLoadError

    folder = make_int4_checkpoint(str(tmp_path), "ct", 32, sym=True)
    path = os.path.join(folder, "quant", "model.safetensors")
    tensors = load_file(path)
    name = next(k for k in tensors if k.endswith(f"{part}.weight_shape"))
    tensors[name][column] += 8
    save_file(tensors, path)
    what = "output" if column == 0 else "input"
    with pytest.raises(ModelLoadError, match=rf"{part}\.weight_shape.* says \d+ {what} features"):
        _load(os.path.join(folder, "quant"), monkeypatch)


ATTENTION = "model.layers.0.self_attn"


def _assert_matches_reference(model, cfg, folder: str) -> None:
    """Logits of ``model`` against transformers on ``folder/reference``'s float weights."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(f"{folder}/reference").float().eval()
    ids = [3, 17, 92, 5, 44, 8]
    logits = _logits(model, cfg, ids)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (logits - expected).abs().max() <= BF16_RELATIVE * expected.abs().max()


@pytest.mark.parametrize("fmt", ["ct", "awq"])
def test_merged_layer_left_unquantized_by_its_parts(tmp_path, monkeypatch, fmt):
    """An ignore list naming q_proj, k_proj and v_proj leaves the merged qkv_proj in float:
    the logits match the reference with those layers' float weights."""
    skip = tuple(f"{ATTENTION}.{p}" for p in ("q_proj", "k_proj", "v_proj"))
    folder = make_int4_checkpoint(str(tmp_path), fmt, 32, sym=True, skip=skip)
    cfg, model, captured = _load(f"{folder}/quant", monkeypatch)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert id(qkv) not in captured and len(captured) > 0
    _assert_matches_reference(model, cfg, folder)


@pytest.mark.parametrize("fmt", ["ct", "awq"])
def test_merged_layer_with_one_part_unquantized_is_refused(tmp_path, monkeypatch, fmt):
    """One layer holds one precision: an ignore list naming only k_proj is refused at
    start-up, naming the part."""
    from tokenmill.hf_config import ModelLoadError
    from tokenmill.model.layers.quantization.base import QuantizationError

    folder = make_int4_checkpoint(str(tmp_path), fmt, 32, sym=True, skip=(f"{ATTENTION}.k_proj",))
    with pytest.raises((ModelLoadError, QuantizationError),
                       match=r"qkv_proj: the checkpoint leaves k_proj unquantized"):
        _load(f"{folder}/quant", monkeypatch)


@pytest.mark.parametrize("targets", [["re:.*self_attn.*"], ["q_proj", "k_proj", "v_proj",
                                                           "o_proj"]])
def test_compressed_tensors_targets_pick_the_quantized_layers(tmp_path, monkeypatch, targets):
    """A config group whose targets name only the attention projections leaves the MLP in
    float (as llm-compressor writes such checkpoints): the logits match the reference."""
    import json


    mlp = tuple(f"model.layers.{i}.mlp.{p}" for i in range(2)
                for p in ("gate_proj", "up_proj", "down_proj"))
    folder = make_int4_checkpoint(str(tmp_path), "ct", 32, sym=True, skip=mlp)
    config_path = f"{folder}/quant/config.json"
    config = json.load(open(config_path))
    qc = config["quantization_config"]
    qc["ignore"] = ["lm_head"]
    qc["config_groups"]["group_0"]["targets"] = targets
    json.dump(config, open(config_path, "w"))
    cfg, model, captured = _load(f"{folder}/quant", monkeypatch)
    assert len(captured) == 2 * 2  # qkv_proj and o_proj of each layer
    _assert_matches_reference(model, cfg, folder)


@pytest.mark.parametrize("key, value", [("ignore", "lm_head"), ("modules_to_not_convert", "q")])
def test_an_ignore_list_that_is_not_a_list_is_refused(key, value):
    from tokenmill.model.layers.quantization import get_quantization_config
    from tokenmill.model.layers.quantization.base import QuantizationError

    fmt = "ct" if key == "ignore" else "awq"
    qc = _quant_config(fmt, 32, True, False)
    qc[key] = value
    name = "compressed-tensors" if fmt == "ct" else "awq"
    with pytest.raises(QuantizationError, match=f"{key} must be a list of layer names"):
        get_quantization_config(name, {"quantization_config": qc}, "cpu")


def test_a_gptq_g_idx_of_the_wrong_length_is_named(tmp_path, monkeypatch):
    import os

    from safetensors.torch import load_file, save_file

    from tokenmill.hf_config import ModelLoadError

    folder = make_int4_checkpoint(str(tmp_path), "gptq", 32, sym=True, act_order=True)
    path = os.path.join(folder, "quant", "model.safetensors")
    tensors = load_file(path)
    name = next(k for k in tensors if k.endswith("k_proj.g_idx"))
    tensors[name] = tensors[name][:-8].contiguous()
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=r"k_proj\.g_idx.*has shape \(120,\), expected"):
        _load(os.path.join(folder, "quant"), monkeypatch)


@pytest.mark.parametrize("shift", [1, -1])
def test_a_gptq_g_idx_outside_the_groups_is_refused(shift):
    """A g_idx whose groups lie past the last group or below 0 is refused with one line,
    not re-based or left to a torch error."""
    from tokenmill.model.layers.quantization.base import QuantizationError
    from tokenmill.model.layers.quantization.int4 import sort_by_group

    k, group = 64, 16
    g_idx = torch.arange(k)[torch.randperm(k, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(QuantizationError, match=r"g_idx holds groups outside 0\.\.3"):
        sort_by_group(torch.zeros(8, k, dtype=torch.uint8), g_idx // group + shift, group)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct"])
def test_a_layer_whose_inputs_do_not_split_into_groups_is_named(tmp_path, monkeypatch, fmt):
    """A layer whose input features are not a multiple of the group size is refused with
    the layer's name in the model and both sizes."""
    import json

    from tokenmill.hf_config import ModelLoadError

    folder = make_int4_checkpoint(str(tmp_path), fmt, 64, sym=True)
    config_path = f"{folder}/quant/config.json"
    config = json.load(open(config_path))
    config["intermediate_size"] = 160  # down_proj's input: not a multiple of 64
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ModelLoadError, match=r"layer model\.layers\.0\.mlp\.down_proj has 160 "
                                             r"input features, not a multiple of the group "
                                             r"size 64"):
        _load(f"{folder}/quant", monkeypatch)

"""bitsandbytes 4-bit and 8-bit through the bitsandbytes library: a checkpoint transformers
quantized and saved, and an unquantized one quantized while loading, against transformers
running the same bitsandbytes layers."""

from __future__ import annotations

import pytest
import torch

from tests.model.paged import PagedRunner
from tests.model.quant_checkpoints import TINY_LLAMA
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.loader.model_loader import get_model

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).float().eval()
    path = str(tmp_path_factory.mktemp("bnb") / "float")
    hf.save_pretrained(path)
    return path


def _hf_bnb(path: str, **kw):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.float32, **kw)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config,
                                                device_map="cpu", dtype=torch.float32).eval()


def _logits(path: str, **engine) -> torch.Tensor:
    cfg = EngineArgs(model=path, dtype="float32", device="cpu", **engine).create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    runner = PagedRunner(model, cfg.model_config.hf_config, num_blocks=32)
    return runner.step({"a": IDS}, {"a": IDS})


IDS = list(range(7, 40))


def _expected(hf, float_folder: str) -> torch.Tensor:
    """transformers' float32 model carrying the bitsandbytes layers' dequantized weights
    (transformers' own 4-bit product on the CPU runs in bfloat16, which tokenmill's does
    not: it agrees with that one to bfloat16 precision only)."""
    import bitsandbytes.functional as F
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    modules = dict(hf.named_modules())
    with torch.no_grad():
        for name, module in ref.named_modules():
            layer = modules.get(name)
            if isinstance(layer, bnb.nn.Linear4bit):
                state = layer.weight.quant_state
                module.weight.copy_(F.dequantize_4bit(layer.weight.data, state).float())
        expected = ref(torch.tensor([IDS])).logits[0]
        bnb_logits = hf(torch.tensor([IDS])).logits[0].float()
    assert (bnb_logits - expected).abs().max() <= 2e-2 * expected.abs().max()
    return expected


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_prequantized_4bit_checkpoint(float_folder, tmp_path, quant_type):
    hf = _hf_bnb(float_folder, load_in_4bit=True, bnb_4bit_quant_type=quant_type)
    hf.save_pretrained(tmp_path / "q")
    torch.testing.assert_close(_logits(str(tmp_path / "q")), _expected(hf, float_folder),
                               rtol=1e-4, atol=1e-4)


def test_online_4bit_from_an_unquantized_checkpoint(float_folder):
    hf = _hf_bnb(float_folder, load_in_4bit=True, bnb_4bit_quant_type="nf4")
    logits = _logits(float_folder, quantization="bitsandbytes")
    torch.testing.assert_close(logits, _expected(hf, float_folder), rtol=1e-4, atol=1e-4)


def test_prequantized_8bit_checkpoint(float_folder, tmp_path):
    """LLM.int8() rows and their absmax: tokenmill multiplies the int8 weights exactly
    (transformers' Linear8bitLt also quantizes the activations, so it agrees to ~1%)."""
    from transformers import AutoModelForCausalLM

    hf = _hf_bnb(float_folder, load_in_8bit=True)
    hf.save_pretrained(tmp_path / "q8")
    ref = AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    modules = dict(hf.named_modules())
    with torch.no_grad():
        for name, module in ref.named_modules():
            layer = modules.get(name)
            if isinstance(layer, bnb.nn.Linear8bitLt):
                w = layer.weight.data.float() * layer.weight.SCB.float()[:, None] / 127
                module.weight.copy_(w)
        expected = ref(torch.tensor([IDS])).logits[0]
        int8_logits = hf(torch.tensor([IDS])).logits[0].float()
    logits = _logits(str(tmp_path / "q8"))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert (logits - int8_logits).abs().max() <= 3e-2 * int8_logits.abs().max()


@pytest.fixture(scope="module")
def nf4_double(float_folder, tmp_path_factory):
    """A transformers NF4 checkpoint with double quantization (nested absmax)."""
    path = tmp_path_factory.mktemp("bnb") / "nf4_double"
    _hf_bnb(float_folder, load_in_4bit=True, bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True).save_pretrained(path)  # fmt: skip
    return path


def _broken_copy(src, dst, edit) -> str:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize(
    "edit, words",
    [
        # a layer of one part: nothing else would notice it (its output went wrong silently)
        (lambda t: t.pop(f"{DOWN}.nested_absmax"), "lacks weight.nested_absmax"),
        (lambda t: t.pop(f"{DOWN}.absmax"), "lacks weight.absmax"),
        (lambda t: t.pop(f"{DOWN}.quant_map"), "lacks weight.quant_map"),
        (lambda t: [t.pop(k) for k in list(t) if k.startswith(f"{DOWN}.")],
         "lacks weight.absmax, weight.quant_map, weight.quant_state"),
        (lambda t: t[f"{DOWN}.quant_state.bitsandbytes__nf4"].zero_(), "not valid JSON"),
        (lambda t: t.update({DOWN: t[DOWN][: t[DOWN].shape[0] // 2]}), "cannot read"),
    ],
)  # fmt: skip
def test_broken_4bit_state_is_refused_naming_the_tensor(nf4_double, tmp_path, edit, words):
    from tokenmill.model.layers.quantization.base import QuantizationError

    folder = _broken_copy(nf4_double, tmp_path / "broken", edit)
    with pytest.raises(QuantizationError, match=words) as e:
        _logits(folder)
    assert "down_proj" in str(e.value)


def test_broken_8bit_state_is_refused(float_folder, tmp_path):
    from tokenmill.model.layers.quantization.base import QuantizationError

    _hf_bnb(float_folder, load_in_8bit=True).save_pretrained(tmp_path / "q8")
    scb = DOWN.removesuffix(".weight") + ".SCB"  # LLM.int8() names it beside the weight
    folder = _broken_copy(tmp_path / "q8", tmp_path / "no_scb", lambda t: t.pop(scb))
    with pytest.raises(QuantizationError, match="down_proj.*without its SCB"):
        _logits(folder)
    folder = _broken_copy(tmp_path / "q8", tmp_path / "short_scb",
                          lambda t: t.update({scb: t[scb][:3]}))
    with pytest.raises(QuantizationError, match=r"SCB has shape \(3,\)"):
        _logits(folder)


@pytest.mark.parametrize(
    "qc, words",
    [
        ({"load_in_4bit": True, "bnb_4bit_blocksize": 100}, "bnb_4bit_blocksize 100: one of 64"),
        ({"load_in_4bit": True, "bnb_4bit_blocksize": "big"}, "bnb_4bit_blocksize 'big'"),
        ({"load_in_4bit": True, "load_in_8bit": True}, "both load_in_4bit and load_in_8bit"),
        ({"load_in_4bit": True, "llm_int8_skip_modules": "lm_head"}, "must be a list"),
        ({"load_in_4bit": True, "llm_int8_skip_modules": ["q_proj"]},
         "leaves q_proj unquantized but not the other parts"),
    ],
)  # fmt: skip
def test_bad_bitsandbytes_configs_are_refused(float_folder, tmp_path, qc, words):
    import json
    import shutil

    from tokenmill.config import UnsupportedQuantizationError
    from tokenmill.model.layers.quantization.base import QuantizationError

    folder = tmp_path / "cfg"
    shutil.copytree(float_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", **qc}
    (folder / "config.json").write_text(json.dumps(config))
    # refused with the config (exit code 2), or the partial skip when the layer is built
    with pytest.raises((UnsupportedQuantizationError, QuantizationError), match=words):
        _logits(str(folder), load_format="dummy")


def test_skipping_every_part_of_a_merged_layer_keeps_it_16_bit(float_folder, tmp_path):
    """llm_int8_skip_modules naming q, k and v: the merged q/k/v layer is left unquantized
    (transformers saves those weights as floats), so logits match transformers' model."""
    skip = ["q_proj", "k_proj", "v_proj", "lm_head"]
    hf = _hf_bnb(float_folder, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                 llm_int8_skip_modules=skip)  # fmt: skip
    hf.save_pretrained(tmp_path / "skip")
    torch.testing.assert_close(_logits(str(tmp_path / "skip")), _expected(hf, float_folder),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("qc, words", [
    ({"bnb_4bit_quant_type": "fp4"}, "stores bitsandbytes 4-bit nf4, block size 64, its "
     "quantization_config says 4-bit fp4, block size 64"),
    ({"bnb_4bit_blocksize": 128}, "says 4-bit nf4, block size 128"),
    ({"load_in_4bit": False, "load_in_8bit": True}, "stores bitsandbytes 4-bit nf4.* says 8-bit"),
])  # fmt: skip
def test_a_config_that_disagrees_with_the_stored_state_is_refused(nf4_double, tmp_path, qc,
                                                                   words):
    """The weights are quantized again in the format ``quantization_config`` names: a
    config that disagrees with the checkpoint's stored state (edited, or copied from another
    model) is refused instead of re-quantizing in the wrong format (other tokens)."""
    import json
    import shutil

    from tokenmill.model.layers.quantization.base import QuantizationError

    folder = shutil.copytree(nf4_double, tmp_path / "edited")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(qc)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match=words) as e:
        _logits(str(folder))
    assert "cannot read" not in str(e.value)

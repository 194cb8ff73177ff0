"""Kernel choices: ``KernelConfig`` from ``--kernel-config`` / ``LLM(kernel_config=...)``,
and the linear layers that follow it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tokenmill.config import ConfigError, KernelConfig, current_kernel_config, kernel_config_scope
from tokenmill.kernels.gemm import skinny as sg
from tokenmill.model.layers import dense, linear


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, KernelConfig()),
        ('{"skinny_gemm": "off"}', KernelConfig(skinny_gemm="off")),
        ({"skinny_gemm": "all"}, KernelConfig(skinny_gemm="all")),
        (KernelConfig(skinny_gemm="off"), KernelConfig(skinny_gemm="off")),
        ("{}", KernelConfig()),
    ],
)
def test_kernel_config_parses(value, expected):
    assert KernelConfig.parse(value) == expected
    assert KernelConfig().skinny_gemm == "auto"  # the measured winner by default


@pytest.mark.parametrize(
    "value,words",
    [
        ("skinny", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"skiny_gemm": "off"}', "unknown field(s) ['skiny_gemm']; known: skinny_gemm"),
        ('{"skinny_gemm": "fast"}', "skinny_gemm must be one of auto, all, off, got 'fast'"),
    ],
)
def test_kernel_config_rejects_in_one_line(value, words):
    with pytest.raises(ConfigError) as e:
        KernelConfig.parse(value)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_layers_take_the_choice_of_the_model_being_built():
    assert linear.LinearBase(8, 4, bias=False).skinny_gemm == "auto"
    with kernel_config_scope(KernelConfig(skinny_gemm="off")):
        assert current_kernel_config().skinny_gemm == "off"
        layer = linear.MergedColumnParallelLinear(8, [4, 4])
    assert layer.skinny_gemm == "off"
    assert current_kernel_config() == KernelConfig()


@pytest.mark.parametrize(
    "mode,tuned,used",
    [("auto", True, True), ("auto", False, False), ("all", False, True), ("off", True, False)],
)
def test_dense_routes_by_the_choice(monkeypatch, mode, tuned, used):
    monkeypatch.setattr(sg, "use_skinny_gemm", lambda x, w: True)
    monkeypatch.setattr(sg, "has_tuned_config", lambda x, w: tuned)
    monkeypatch.setattr(sg, "skinny_linear", lambda x, w, b: "skinny")
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    out = dense.dense(x, w, skinny=mode)
    assert (out == "skinny") if used else torch.allclose(out, F.linear(x, w))



@pytest.mark.parametrize("mode", ["all", "off"])
def test_unquantized_layers_run_dense_by_their_choice(monkeypatch, mode):
    """Unquantized linear layers (the default ``LinearMethod``) take the skinny GEMM, and a
    gate/up pair its gated epilogue, exactly where ``dense`` / ``gated_dense`` would."""
    launches = []

    def skinny_linear(x, w, b, config=None, gated=False):
        launches.append(gated)
        return torch.zeros(x.shape[0], w.shape[0] // 2 if gated else w.shape[0])

    monkeypatch.setattr(sg, "use_skinny_gemm", lambda x, w: True)
    monkeypatch.setattr(sg, "has_tuned_config", lambda x, w: False)
    monkeypatch.setattr(sg, "launch_config", lambda *a: SimpleNamespace(block_n=16))
    monkeypatch.setattr(sg, "skinny_linear", skinny_linear)
    with kernel_config_scope(KernelConfig(skinny_gemm=mode)):
        gate_up = linear.MergedColumnParallelLinear(8, [4, 4])
        down = linear.RowParallelLinear(4, 8)
    x = torch.randn(1, 8)
    gated = gate_up.forward_gated(x)
    gate_up(x), down(torch.randn(1, 4))
    if mode == "all":
        assert gated is not None and launches == [True, False, False]
    else:
        assert gated is None and launches == []


def test_quantized_layers_leave_the_gate_to_the_caller():
    from tokenmill.model.layers.quantization.gguf import GGUFLinearMethod
    from tokenmill.model.layers.quantization.int4 import AWQLinearMethod

    for method in (GGUFLinearMethod(), AWQLinearMethod(32)):
        assert method.apply_gated(None, torch.randn(1, 8)) is None


def test_moe_layers_take_the_prompt_experts_choice(monkeypatch):
    """``moe_prompt_experts`` reaches the fused MoE call of an MoE layer built in its
    scope; the default is the measured loop."""
    from tokenmill.model.layers import fused_moe as layer_mod

    assert KernelConfig().moe_prompt_experts == "auto"
    with kernel_config_scope(KernelConfig(moe_prompt_experts="grouped_gemm")):
        moe = layer_mod.FusedMoE(4, 2, 16, 24, renormalize=True)
    seen = []

    def fake(hidden, *args, large_batch="auto", **kwargs):
        seen.append(large_batch)
        return torch.zeros_like(hidden)

    monkeypatch.setattr(layer_mod, "fused_experts", fake)
    moe(torch.randn(3, 16), torch.randn(3, 4))
    assert seen == ["grouped_gemm"]
    assert KernelConfig.parse('{"moe_prompt_experts": "loop"}').moe_prompt_experts == "loop"

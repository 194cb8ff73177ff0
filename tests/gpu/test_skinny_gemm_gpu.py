"""The skinny GEMM kernel on CUDA in bf16/fp16 against an fp32 reference, at Llama-3.1-8B's
decode shapes.

Inputs are rounded to the kernel dtype before both runs and the reference is the fp32 product
of the rounded values, so the error measured is the kernel's own: fp32 accumulation in another
order (~1e-6 relative) and one rounding of the output (bf16 keeps 8 mantissa bits: relative
error <= 2**-9). Weights are scaled by 1/sqrt(K) so outputs are ~N(0, 1) and |y| < ~6:
tolerance ``atol = rtol = 1e-2``.

The kernel module is imported inside the tests: defining Triton kernels at collection time on
a machine without CUDA would stop the interpreter-mode CPU tests from running in the session.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

ATOL = RTOL = 1e-2
DEVICE = "cuda"
LLAMA_8B = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
MS = [1, 2, 3, 4, 8, 16, 32]


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=DEVICE) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype)
    return x, w, b


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.fixture(scope="module", params=sorted(LLAMA_8B), ids=sorted(LLAMA_8B))
def llama_weight(request) -> torch.Tensor:
    """One Llama-3.1-8B weight in bf16 (up to 1 GB for the LM head), made once per module."""
    n, k = LLAMA_8B[request.param]
    return _operands(1, n, k, torch.bfloat16, seed=1)[1]


@pytest.mark.parametrize("m", MS)
def test_llama_shapes_bf16(llama_weight, m):
    from tokenmill.kernels.gemm.skinny import skinny_linear, use_skinny_gemm

    x = _operands(m, 1, llama_weight.shape[1], torch.bfloat16, seed=m)[0]
    assert use_skinny_gemm(x, llama_weight)
    got = skinny_linear(x, llama_weight)
    assert got.dtype == torch.bfloat16 and got.shape == (m, llama_weight.shape[0])
    torch.testing.assert_close(got.float(), _reference(x, llama_weight), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("split_k", [1, 3, 16])
def test_both_paths_ragged_shape_with_bias(dtype, use_dot, split_k):
    """N and K not multiples of any tile, uneven splits, bias, strided rows of x."""
    from tokenmill.kernels.gemm.skinny import default_config, skinny_linear

    x, w, b = _operands(4, 4100, 4104, dtype, seed=split_k)
    wide = torch.zeros(8, 4200, dtype=dtype, device=DEVICE)
    wide[::2, 8:4112] = x
    cfg = default_config(8 if use_dot else 2, 4100, 4104)
    cfg = dataclasses.replace(cfg, split_k=split_k)
    got = skinny_linear(wide[::2, 8:4112], w, b, config=cfg)
    torch.testing.assert_close(got.float(), _reference(x, w, b), atol=ATOL, rtol=RTOL)


def test_split_k_is_deterministic_and_leaves_counters_zero():
    from tokenmill.kernels.gemm import skinny as sg
    from tokenmill.kernels.gemm import split_k

    x, w, b = _operands(8, 4096, 14336, torch.bfloat16)
    cfg = sg.launch_config(8, 4096, 14336)
    first = sg.skinny_linear(x, w, b)
    assert cfg.split_k > 1
    for _ in range(3):
        assert torch.equal(sg.skinny_linear(x, w, b), first)
    torch.cuda.synchronize()
    assert int(split_k._COUNTERS[first.device].abs().sum()) == 0


def _capture(fn, calls: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def test_cuda_graph_replay_with_new_inputs():
    """Split-K launches captured back to back replay correctly for inputs copied in later."""
    from tokenmill.kernels.gemm.skinny import skinny_linear

    x, w, b = _operands(2, 4096, 4096, torch.bfloat16)
    out = torch.empty(2, 4096, dtype=torch.bfloat16, device=DEVICE)
    skinny_linear(x, w, b, out=out)  # warm-up: compiles, creates the split-K counters
    torch.cuda.synchronize()
    graph = _capture(lambda: skinny_linear(x, w, b, out=out), calls=3)
    for seed in (5, 6):
        x.copy_(_operands(2, 1, 4096, torch.bfloat16, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), _reference(x, w, b), atol=ATOL, rtol=RTOL)


def test_capture_before_the_counters_exist_falls_back_to_one_split():
    from tokenmill.kernels.gemm import skinny as sg
    from tokenmill.kernels.gemm import split_k

    x, w, _ = _operands(2, 4096, 4096, torch.bfloat16)
    out = torch.empty(2, 4096, dtype=torch.bfloat16, device=DEVICE)
    assert sg.launch_config(2, 4096, 4096).split_k > 1
    unsplit = dataclasses.replace(sg.launch_config(2, 4096, 4096), split_k=1)
    sg.skinny_linear(x, w, out=out, config=unsplit)  # compile outside capture
    torch.cuda.synchronize()
    saved = split_k._COUNTERS.pop(x.device)
    try:
        graph = _capture(lambda: sg.skinny_linear(x, w, out=out), calls=1)
        assert x.device not in split_k._COUNTERS
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), _reference(x, w), atol=ATOL, rtol=RTOL)
    finally:
        split_k._COUNTERS[x.device] = saved


def test_use_skinny_gemm_on_cuda():
    from tokenmill.kernels.gemm.skinny import MAX_M, use_skinny_gemm

    w = torch.empty(4096, 4096, dtype=torch.bfloat16, device=DEVICE)
    assert use_skinny_gemm(torch.empty(8, 4096, dtype=torch.bfloat16, device=DEVICE), w)
    assert not use_skinny_gemm(torch.empty(MAX_M + 1, 4096, dtype=torch.bfloat16, device=DEVICE), w)
    assert not use_skinny_gemm(torch.empty(8, 4096, device=DEVICE), w.float())
    assert not use_skinny_gemm(torch.empty(8, 4096, dtype=torch.bfloat16), w)


@pytest.mark.parametrize("use_dot", [False, True])
def test_pdl_chain_in_a_graph_keeps_each_product_after_the_one_it_reads(use_dot):
    """A chain of programmatic dependent launches, captured and replayed: each product
    reads the previous one's output, so a product that read ``x`` before its predecessor
    finished would differ from the eager, ordered chain."""
    from tokenmill.kernels.gemm import skinny as sg

    k = 4096
    weights = [_operands(1, k, k, torch.bfloat16, seed=s)[1] for s in range(6)]
    m = 4 if use_dot else 1  # the default configurations' two main loops
    cfg = sg.default_config(m, k, k)
    assert cfg.use_dot == use_dot
    x = _operands(m, 1, k, torch.bfloat16, seed=7)[0]

    def chain(pdl: bool) -> torch.Tensor:
        y = x
        for w in weights:
            y = sg.skinny_linear(y, w, config=cfg, pdl=pdl)
            y = y / y.float().abs().amax().clamp_min(1e-3).to(y.dtype)  # a non-PDL kernel
            y = sg.skinny_linear(y, w, config=cfg, pdl=pdl)  # PDL after PDL
        return y

    ref = chain(pdl=False)
    chain(pdl=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(pdl=True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ref, atol=0, rtol=0)


@pytest.mark.parametrize("m", [1, 2, 4, 16])
def test_gated_gate_up_equals_the_product_then_silu_and_mul(m):
    """At Llama-3.1-8B's gate/up shape the gated launch is bit-equal to the product followed
    by ``silu_and_mul``'s kernel: the same sums, rounded alike, the same gate arithmetic."""
    from tokenmill.kernels.activation import silu_and_mul
    from tokenmill.kernels.gemm.skinny import skinny_linear

    x, w, _ = _operands(m, *LLAMA_8B["gate_up"], torch.bfloat16, seed=m)
    assert torch.equal(skinny_linear(x, w, gated=True), silu_and_mul(skinny_linear(x, w)))

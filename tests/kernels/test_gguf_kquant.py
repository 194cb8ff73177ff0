"""The Q4_K/Q5_K/Q6_K GEMV and tile kernels by Triton's interpreter on CPU, in float32, against
the product of the gguf package's dequantization: odd super-block counts (a partial last
iteration), a K split, rows past the last full tile, more than one row of ``x``; and the
one-pass dequantization of every block type, bit for bit. The interpreter is process-wide
and read when kernels are defined, so the check runs in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from tests.kernels.gguf_cases import random_blocks
    from tokenmill.kernels.gemm.gguf import gguf_dequantize, gguf_linear
    from tokenmill.kernels.gemm.gguf_kquant import gguf_gemv, kquant_mm
    from tokenmill.kernels.quant.gguf_blocks import BLOCK_TYPES, dequantize

    torch.manual_seed(0)
    for qtype in (12, 13, 14):
        for n, k, m, cfg in [(37, 768, 1, dict(BLOCK_N=16, SB=2, SPLIT_K=1, num_warps=4)),
                             (40, 1280, 3, dict(BLOCK_N=8, SB=2, SPLIT_K=2, num_warps=4)),
                             (16, 512, 2, dict(BLOCK_N=16, SB=1, SPLIT_K=2, num_warps=4)),
                             (24, 256, 1, None)]:
            raw = random_blocks(qtype, n, k, seed=qtype + n)
            x = torch.randn(m, k)
            expected = x.double() @ dequantize(raw, qtype).double().t()
            y = gguf_gemv(x, raw, qtype, cfg) if cfg else gguf_linear(x, raw, qtype)
            err = (y.double() - expected).abs().max().item()
            assert y.shape == (m, n), (qtype, y.shape)
            assert err <= 1e-4 * expected.abs().max().item(), (qtype, n, k, m, err)
        for n, k, m, cfg in [(37, 768, 5, dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=2, num_warps=4,
                                                num_stages=1)),
                             (20, 512, 17, None)]:
            raw = random_blocks(qtype, n, k, seed=qtype + m)
            x = torch.randn(m, k)
            expected = x.double() @ dequantize(raw, qtype).double().t()
            y = kquant_mm(x, raw, qtype, cfg) if cfg else gguf_linear(x, raw, qtype)
            err = (y.double() - expected).abs().max().item()
            assert y.shape == (m, n), (qtype, y.shape)
            assert err <= 1e-4 * expected.abs().max().item(), ("mm", qtype, n, k, m, err)
    for qtype, (_name, qk, _size, _group) in BLOCK_TYPES.items():
        k = 2 * 256
        raw = random_blocks(qtype, 40, k, seed=qtype)
        assert torch.equal(gguf_dequantize(raw, qtype, k, torch.float32),
                           dequantize(raw, qtype)), qtype
    print("OK")
""")


def test_gemv_kernels_by_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600, cwd=root)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_gemv_refuses_other_types_and_row_sizes():
    import torch

    from tokenmill.kernels.gemm.gguf_kquant import gguf_gemv

    x = torch.zeros(1, 256)
    with pytest.raises(ValueError, match="Q4_K, Q5_K and Q6_K"):
        gguf_gemv(x, torch.zeros(4, 18, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="does not match"):
        gguf_gemv(x, torch.zeros(4, 210, dtype=torch.uint8), 12)

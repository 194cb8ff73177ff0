"""The native CPU RMSNorm with the residual add (``csrc/rms_norm.cpp``, through ``RMSNorm``)
against the unfused float32 formula."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.cpu.native import native_ops
from tokenmill.model.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(native_ops() is None, reason="native CPU kernels not built")


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 64), (33, 100)])
def test_add_rms_norm_matches_the_formula(offset, rows, hidden):
    torch.manual_seed(rows)
    norm = RMSNorm(hidden, 1e-5, offset)
    norm.weight.data = torch.rand(hidden)
    x, residual = torch.randn(rows, hidden), torch.randn(rows, hidden)
    y, s = norm(x, residual)
    want_s = x + residual
    scale = torch.rsqrt(want_s.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    want = (want_s.double() * scale * (norm.weight.double() + offset)).float()
    assert torch.equal(s, want_s)
    torch.testing.assert_close(y, want, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(norm(x), norm._norm(x), rtol=2e-6, atol=2e-6)
    # each row alone gives the same bits
    assert torch.equal(norm(x[-1:], residual[-1:])[0], y[-1:])


def test_bad_inputs_raise_clear_errors():
    ops = native_ops()
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.add_rms_norm(torch.randn(2, 8), torch.empty(0), torch.ones(4), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="residual must be"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6, 0.0)

"""torch's CPU int4 kernel (and the native block product where it runs) with a bfloat16 copy
for prompt rows: each row's result depends only on its own role (prompt or generated), not on
the other rows of the product."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.cpu import block_gemm
from tokenmill.kernels.quant import int4_cpu


@pytest.fixture(autouse=True, params=["native", "torch"])
def kernel(request, monkeypatch):
    """Each test on the native block product and on torch's int4 kernel."""
    if request.param == "native" and not block_gemm.available():
        pytest.skip("native block product not built")
    if request.param == "torch":
        monkeypatch.setattr(block_gemm, "available", lambda: False)
    return request.param


def _weight(n: int = 64, k: int = 128, group: int = 32):
    torch.manual_seed(0)
    q = torch.randint(0, 16, (n, k), dtype=torch.int16)
    scale = torch.rand(n, k // group) * 0.02 + 0.01
    offset = torch.randn(n, k // group) * 0.01
    planes = int4_cpu.make_planes(q, scale, offset, group)
    dense = (q.float().view(n, k // group, group) * scale[..., None] + offset[..., None])
    return planes, dense.view(n, k).to(torch.bfloat16)


def test_rows_take_their_role_product_whatever_the_rest_of_the_batch():
    planes, copy = _weight()
    x = torch.randn(9, 128)
    is_prompt = torch.tensor([True, False, True, True, False, False, True, False, True])
    with int4_cpu.prompt_rows(int4_cpu.PromptRows.from_mask(is_prompt)):
        mixed = int4_cpu.planes_mm(x, planes, copy)
    with int4_cpu.prompt_rows(int4_cpu.PromptRows(int(is_prompt.sum()), None, None)):
        prompt_only = int4_cpu.planes_mm(x[is_prompt], planes, copy)
    generated_only = int4_cpu.planes_mm(x[~is_prompt], planes, copy)  # no roles: int4 kernel
    assert torch.equal(mixed[is_prompt], prompt_only)
    assert torch.equal(mixed[~is_prompt], generated_only)
    # Each alone, one row at a time, gives the same bits.
    for i in range(len(x)):
        role = int4_cpu.PromptRows.from_mask(is_prompt[i : i + 1])
        with int4_cpu.prompt_rows(role):
            assert torch.equal(int4_cpu.planes_mm(x[i : i + 1], planes, copy)[0], mixed[i])
    # Both products compute the same weights up to bfloat16 rounding.
    reference = x @ copy.float().t()
    assert (mixed - reference).abs().max() < 0.05 * reference.abs().max()


def test_roles_for_another_row_count_fall_back_to_the_int4_kernel():
    planes, copy = _weight()
    x = torch.randn(5, 128)
    with int4_cpu.prompt_rows(int4_cpu.PromptRows(7, None, None)):
        y = int4_cpu.planes_mm(x, planes, copy)
    assert torch.equal(y, int4_cpu.planes_mm(x, planes))
    assert int4_cpu.PromptRows.from_mask(torch.zeros(3, dtype=torch.bool)) is None

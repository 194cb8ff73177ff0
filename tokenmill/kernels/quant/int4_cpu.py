"""Quantized products on the CPU: tokenmill's native block product, or torch's int4 kernel.

Where the native kernels are built with AVX-512 VNNI (``tokenmill.kernels.cpu.block_gemm``),
weights whose integers fit int8 and whose groups are multiples of 32 are packed for it: the
activations are held as two int8 digits per block of 32 (exact to ~2^-16 of the block's
largest) and every row, prompt or generated, runs on it (2-4x faster than torch's int4
kernel from 1 to 64 rows), and each row's result is independent of the others.

Elsewhere, ``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)``
computes ``x @ W^T`` with ``W[n, k] = (q[n, k] - 8) * s[g, n] + z[g, n]`` for ``g = k //
group`` (``q`` in 0..15, groups of 32, 64, 128 or 256 along ``K``), reading four bits per
weight. It is vectorised (AVX2/AVX-512) for bfloat16 activations only; float32 activations
take a scalar loop 20-50x slower, so products run in bfloat16 and the scales and zeros are
stored in bfloat16 (the kernel's requirement), with float32 accumulation inside the kernel.
Integer values wider than four bits (5-, 6- and 8-bit quants) are split exactly into two
int4 planes, ``q = 16 * h + l`` with ``l = q & 15`` and ``h = q >> 4``, whose products add
up: ``s q + o = (16 s) h + (s l + o)``.

torch's kernel's cost grows with the rows of ``x`` (it expands the weights for each block
of rows), while a bfloat16 GEMM reads its weight once: on a CPU with native bfloat16 dot
products (AVX-512 BF16, AMX) and no native block product, the rows of prompt tokens run on
a bfloat16 copy of the weight where the layer keeps one (``KernelConfig.cpu_bf16_weights``,
two more bytes per weight), and the rows of generated tokens on the int4 kernel. The choice
follows each token's role, never the size of the step, so a request's greedy output does
not depend on what else is in the batch: the int4 kernel gives each row the same bits
whatever the other rows are, and the bfloat16 GEMM (oneDNN) does at a fixed row count but
not across row counts (its kernel and accumulation order change with the rows), so it
always runs on tiles of ``BF16_TILE_ROWS`` rows, the last one padded with zeros. The model
runner says which rows are prompt tokens (``prompt_rows``); a product without that (other
callers, padded batches) runs every row on the int4 kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from tokenmill.kernels.cpu import block_gemm
from tokenmill.kernels.cpu.block_gemm import BlockWeights

KERNEL_GROUPS = (32, 64, 128, 256)
# Rows of each bfloat16 product (see the module docstring): at 64 rows the GEMM is past the
# bandwidth-bound sizes (the 30 layers of SmolLM2-135M: 27.8 ms at 64 rows, 19.9 at 16).
BF16_TILE_ROWS = 64


@dataclass(frozen=True)
class PromptRows:
    """Which rows of a forward pass's products are prompt tokens.

    Attributes:
        num_rows: rows of the products this applies to (a product of another row count
            runs every row on the int4 kernel).
        prompt: ``[P]`` int64 indices of the prompt rows, None when every row is one.
        generated: ``[G]`` int64 indices of the other rows, None when there are none.
    """

    num_rows: int
    prompt: torch.Tensor | None
    generated: torch.Tensor | None

    @classmethod
    def from_mask(cls, is_prompt) -> PromptRows | None:
        """From a host boolean array ``[num_rows]``; None when no row is a prompt row."""
        is_prompt = torch.as_tensor(is_prompt, dtype=torch.bool)
        n = int(is_prompt.numel())
        if not bool(is_prompt.any()):
            return None
        if bool(is_prompt.all()):
            return cls(n, None, None)
        return cls(n, torch.nonzero(is_prompt).view(-1), torch.nonzero(~is_prompt).view(-1))


_PROMPT_ROWS: ContextVar[PromptRows | None] = ContextVar("prompt_rows", default=None)


def current_prompt_rows() -> PromptRows | None:
    """The prompt rows set by the innermost ``prompt_rows`` block, or None."""
    return _PROMPT_ROWS.get()


@contextmanager
def prompt_rows(rows: PromptRows | None) -> Iterator[None]:
    """Products inside the block take ``rows`` as their prompt rows (see module docstring)."""
    token = _PROMPT_ROWS.set(rows)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)


def native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (AVX-512 BF16 or AMX)."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return False
    return any(getattr(torch.cpu, probe, lambda: False)()
               for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def keeps_bf16_copy(choice: str) -> bool:
    """Whether quantized CPU weights keep a bfloat16 copy under ``choice``
    (``KernelConfig.cpu_bf16_weights``: "auto" where ``native_bf16()`` and the native block
    product is not available, "on", "off")."""
    if choice == "auto":
        return native_bf16() and not block_gemm.available()
    return choice == "on"


@dataclass
class Int4Plane:
    """One weight in torch's CPU int4 layout.

    Attributes:
        packed: ``[N, K / 2]`` uint8 from ``_convert_weight_to_int4pack_for_cpu``.
        scales_and_zeros: ``[K / group, N, 2]`` bfloat16.
        group: weights per group along ``K``.
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group: int

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, K]`` bfloat16 -> ``[M, N]`` bfloat16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group, self.scales_and_zeros
        )

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_and_zeros]


# A weight in the form the CPU's products read: the native block product's packing, or
# torch's int4 planes (one, or two for integers wider than four bits).
Planes = list[Int4Plane] | list[BlockWeights]


def supports(group: int, n: int, k: int) -> bool:
    """Whether a CPU kernel takes this shape: the native block product's (groups of a
    multiple of 32), or torch's (a kernel group size dividing ``K``); ``N`` a multiple of 16
    (both packings' requirement)."""
    if block_gemm.available() and block_gemm.supports(group, n, k):
        return True
    return group in KERNEL_GROUPS and k % group == 0 and n % 16 == 0


def make_plane(nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               group: int) -> Int4Plane:
    """Pack ``W = (nibbles - 8) * scale + zero`` for the CPU kernel.

    Args:
        nibbles: ``[N, K]`` integers in 0..15.
        scale, zero: ``[N, K / group]`` float32 (rounded to bfloat16 here).
        group: one of ``KERNEL_GROUPS``.
    """
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        nibbles.to(torch.int32).contiguous(), 1
    )
    sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return Int4Plane(packed, sz, group)


def make_planes(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                group: int) -> Planes:
    """``W = scale * q (+ offset)`` (``q`` integer ``[N, K]``, per-group ``[N, K / group]``)
    packed for the native block product where it runs and takes it, else as one int4 plane
    when ``q`` fits four bits, else two (see the module docstring)."""
    if block_gemm.available():
        packed = block_gemm.pack_blocks(q, scale, offset, group)
        if packed is not None:
            return [packed]
    q = q.to(torch.int16)
    offset = torch.zeros_like(scale) if offset is None else offset
    lo, hi = int(q.min()), int(q.max())
    if lo >= 0 and hi <= 15:
        return [make_plane(q, scale, offset + 8 * scale, group)]
    if lo >= -8 and hi <= 7:
        return [make_plane(q + 8, scale, offset, group)]
    low, high = q & 15, q >> 4
    return [
        make_plane(high + 8, 16 * scale, torch.zeros_like(scale), group),
        make_plane(low, scale, offset + 8 * scale, group),
    ]


def planes_mm(x: torch.Tensor, planes: Planes,
              bf16_copy: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T`` over the planes of ``W``: ``[M, K]`` -> ``[M, N]`` in ``x``'s dtype; the
    prompt rows (``prompt_rows``) on ``bf16_copy`` (``W`` as ``[N, K]`` bfloat16) when given."""
    rows = _PROMPT_ROWS.get() if bf16_copy is not None else None
    if rows is not None and rows.num_rows == x.shape[0]:
        xb = x.to(torch.bfloat16)
        if rows.prompt is None:
            return _bf16_mm(xb, bf16_copy).to(x.dtype)
        y = torch.empty(x.shape[0], bf16_copy.shape[0], dtype=x.dtype, device=x.device)
        y[rows.prompt] = _bf16_mm(xb[rows.prompt], bf16_copy).to(x.dtype)
        y[rows.generated] = _int4_mm(x[rows.generated], planes).to(x.dtype)
        return y
    return _int4_mm(x, planes).to(x.dtype)


def _bf16_mm(xb: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[M, K]`` bfloat16 ``@ weight^T`` in tiles of ``BF16_TILE_ROWS`` rows -> ``[M, N]``
    bfloat16."""
    m = xb.shape[0]
    pad = -m % BF16_TILE_ROWS
    if pad:
        xb = torch.cat([xb, xb.new_zeros(pad, xb.shape[1])])
    out = xb.new_empty(xb.shape[0], weight.shape[0])
    for start in range(0, xb.shape[0], BF16_TILE_ROWS):
        end = start + BF16_TILE_ROWS
        torch.nn.functional.linear(xb[start:end], weight, out=out[start:end])
    return out[:m]


def _int4_mm(x: torch.Tensor, planes: Planes) -> torch.Tensor:
    """``[M, K]`` through the planes -> ``[M, N]`` float32."""
    if isinstance(planes[0], BlockWeights):
        return planes[0].mm(x)
    xb = x.to(torch.bfloat16)
    y = planes[0].mm(xb).float()
    for plane in planes[1:]:
        y += plane.mm(xb)
    return y

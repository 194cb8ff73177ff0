"""Group-quantized int4 products on the CPU with torch's own weight-only kernel.

``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)`` computes
``x @ W^T`` with ``W[n, k] = (q[n, k] - 8) * s[g, n] + z[g, n]`` for ``g = k // group``
(``q`` in 0..15, groups of 32, 64, 128 or 256 along ``K``), reading four bits per weight. It
is vectorised (AVX2/AVX-512) for bfloat16 activations only; float32 activations take a
scalar loop 20-50x slower, so products run in bfloat16 and the scales and zeros are stored
in bfloat16 (the kernel's requirement), with float32 accumulation inside the kernel.

Integer values wider than four bits (5-, 6- and 8-bit quants) are split exactly into two
int4 planes, ``q = 16 * h + l`` with ``l = q & 15`` and ``h = q >> 4``, whose products add
up: ``s q + o = (16 s) h + (s l + o)``.

The kernel's cost grows with the rows of ``x`` (it expands the weights for each block of
rows), while a bfloat16 GEMM reads its weight once: on a CPU with native bfloat16 dot
products (AVX-512 BF16, AMX) a product of ``BF16_COPY_MIN_ROWS`` rows or more (prompt chunks,
large decode batches) runs on a bfloat16 copy of the weight where the layer keeps one
(``KernelConfig.cpu_bf16_weights``), at two more bytes per weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KERNEL_GROUPS = (32, 64, 128, 256)
# Rows from which the bfloat16 copy is faster: the two products cross at 13-14 rows on a
# 2-core AVX-512 BF16 machine (SmolLM2-135M's 30 layers: 17.9 vs 20.0 ms at 12 rows, 23.2 vs
# 19.9 ms at 16, two threads).
BF16_COPY_MIN_ROWS = 14


def native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (AVX-512 BF16 or AMX)."""
    cpu = torch.backends.cpu
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
                ) and cpu.get_cpu_capability() != "DEFAULT"


def keeps_bf16_copy(choice: str) -> bool:
    """Whether quantized CPU weights keep a bfloat16 copy under ``choice``
    (``KernelConfig.cpu_bf16_weights``: "auto" where ``native_bf16()``, "on", "off")."""
    return choice == "on" or (choice == "auto" and native_bf16())


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


def supports(group: int, n: int, k: int) -> bool:
    """Whether the CPU kernel takes this shape: a kernel group size dividing ``K`` and ``N``
    a multiple of 16 (the packing's requirement)."""
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
                group: int) -> list[Int4Plane]:
    """``W = scale * q (+ offset)`` (``q`` int8 ``[N, K]``, per-group ``[N, K / group]``) as
    one int4 plane when ``q`` fits four bits, else two (see the module docstring)."""
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


def planes_mm(x: torch.Tensor, planes: list[Int4Plane],
              bf16_copy: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T`` over the planes of ``W``: ``[M, K]`` -> ``[M, N]`` in ``x``'s dtype; on
    ``bf16_copy`` (``W`` as ``[N, K]`` bfloat16) when given and ``M >= BF16_COPY_MIN_ROWS``."""
    xb = x.to(torch.bfloat16)
    if bf16_copy is not None and x.shape[0] >= BF16_COPY_MIN_ROWS:
        return torch.nn.functional.linear(xb, bf16_copy).to(x.dtype)
    y = planes[0].mm(xb).float()
    for plane in planes[1:]:
        y += plane.mm(xb)
    return y.to(x.dtype)

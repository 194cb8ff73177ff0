"""Registers, spills and shared memory of the decode attention kernel's variants, compiled
for sm_90 (the H200) on any machine, CUDA or not.

The decode kernel is register-bound: how many programs an SM holds at once (its 64 Ki
registers over threads x registers a thread) decides how many waves a decode grid takes,
which ``triton_launch.decode_tile_config`` follows. This compiles the variants the engine
launches at head_dim 128, bf16 (Llama-3.1-8B's shapes): the plain kernel and the one that
rotates and writes the new K/V (``attend_decode_rotary``), at each tile of
``DECODE_TILES_D128`` and at ``DECODE_TILE_MANY_SPLITS_ROPE``, with the ptxas that ships
with Triton, and reads the cubin's resource usage with its cuobjdump. Nothing is launched.

Usage: python benchmarks/decode_kernel_registers.py
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class _CompileOnlyDriver:
    """Enough of a CUDA driver for Triton to specialise and compile for sm_90."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_device_interface(self):
        return torch.cuda

    def is_active(self) -> bool:
        return True


driver.set_active(_CompileOnlyDriver())

from tokenmill.kernels.attention import decode as triton_decode  # noqa: E402
from tokenmill.kernels.attention import paged  # noqa: E402
from tokenmill.kernels.attention.launch import (  # noqa: E402
    DECODE_TILE_MANY_SPLITS_ROPE,
    DECODE_TILES_D128,
)
from tokenmill.model.attention import triton_backend  # noqa: E402
from tokenmill.model.attention.backend import AttentionMetadata, DecodeRotary  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BATCH = 32, 8, 128, 16, 8


class _Compile:
    """Stands in for ``decode_attention_kernel[grid]``: compiles instead of launching."""

    def __init__(self, kernel) -> None:
        self.kernel, self.compiled = kernel, []

    def __getitem__(self, grid):
        def compile_only(*args, **kwargs):
            self.compiled.append((kwargs, self.kernel.warmup(*args, grid=grid, **kwargs)))

        return compile_only


def _resource_usage(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return next((line.strip() for line in out.splitlines() if "REG:" in line), out[-200:])


def main() -> None:
    compiled = _Compile(triton_decode.decode_attention_kernel)
    triton_decode.decode_attention_kernel = compiled
    bf16 = torch.bfloat16
    qsl = torch.arange(BATCH + 1, dtype=torch.int32)
    for tile in [tile for _, tile in DECODE_TILES_D128] + [DECODE_TILE_MANY_SPLITS_ROPE]:
        paged.decode_tile_config = lambda *_, tile=tile: tile
        for rope in (False, True):
            md = AttentionMetadata(
                num_actual_tokens=BATCH, num_reqs=BATCH, query_start_loc=qsl,
                seq_lens=torch.ones(BATCH, dtype=torch.int32),
                block_table=torch.zeros(BATCH, 8, dtype=torch.int32),
                slot_mapping=torch.zeros(BATCH, dtype=torch.int64), max_query_len=1,
                max_seq_len=128, query_start_loc_cpu=qsl,
                seq_lens_cpu=torch.ones(BATCH, dtype=torch.int32), num_decodes=BATCH,
            )  # fmt: skip
            query = torch.zeros(BATCH, NUM_HEADS * HEAD_DIM, dtype=bf16)
            key = torch.zeros(BATCH, NUM_KV_HEADS * HEAD_DIM, dtype=bf16)
            cache = torch.zeros(2, 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=bf16)
            impl = triton_backend.TritonAttentionImpl(
                NUM_HEADS, HEAD_DIM, HEAD_DIM**-0.5, NUM_KV_HEADS
            )
            if rope:
                table = torch.zeros(4096, HEAD_DIM, dtype=torch.float32)
                rotary = DecodeRotary(table, HEAD_DIM, True)
                impl.attend_decode_rotary(query, key, torch.zeros_like(key), cache, md, rotary)
            else:
                impl.attend(query, cache, md)
    for kwargs, kernel in compiled.compiled:
        print(
            f"keys {kwargs['BLOCK_N']:>3} warps {kwargs['num_warps']} stages "
            f"{kwargs['num_stages']} rope {kwargs['ROPE']!s:<5}  shared "
            f"{kernel.metadata.shared:>6} B  {_resource_usage(kernel.asm['cubin'])}"
        )


if __name__ == "__main__":
    main()

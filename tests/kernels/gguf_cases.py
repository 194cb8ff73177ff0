"""Random GGUF blocks with finite fp16 fields, for kernel tests."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.kernels.quant.gguf_blocks import BLOCK_TYPES

# Byte offsets of each block type's fp16 fields (d, and dmin/m where present).
FP16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,),
               12: (0, 2), 13: (0, 2), 14: (208,)}


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """``[n, row_bytes]`` uint8: random bits, fp16 scale fields set to small finite values."""
    _name, qk, size, _group = BLOCK_TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // qk, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        vals = (rng.standard_normal((n, k // qk)) * 0.01).astype(np.float16)
        raw[..., off : off + 2] = vals.view(np.uint8).reshape(n, k // qk, 2)
    return torch.from_numpy(raw.reshape(n, -1))

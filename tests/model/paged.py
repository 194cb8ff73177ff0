"""Test harness: run a model over a paged KV cache for hand-built batches."""

from __future__ import annotations

import torch

from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.attention.selector import get_attn_backend
from tokenmill.model.layers.attention import bind_kv_caches, kv_cache_specs


class PagedRunner:
    """Runs ``model`` step by step for several sequences with scattered block ids.

    Each sequence gets blocks from a shuffled pool, so block ids are non-contiguous.
    """

    def __init__(
        self,
        model,
        config,
        num_blocks: int = 64,
        block_size: int = 16,
        seed: int = 0,
        backend: type[AttentionBackend] | None = None,
        kv_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.device = next(model.parameters()).device
        self.block_size = block_size
        backend = backend or get_attn_backend("cpu", use_mla=bool(config.get("kv_lora_rank")))
        dtype = kv_dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.kv_caches = [
            torch.zeros(
                backend.get_kv_cache_shape(
                    num_blocks, block_size, spec.num_kv_heads, spec.head_size
                ),
                dtype=dtype,
                device=self.device,
            )
            for spec in kv_cache_specs(model)
        ]
        bind_kv_caches(model, self.kv_caches)
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]], all_tokens: dict[str, list[int]]) -> torch.Tensor:
        """Compute ``chunks[seq]`` (the next tokens of each sequence) in one forward pass.

        ``all_tokens[seq]`` is the whole sequence so far (for positions). Returns the
        logits of every scheduled token, ``[num_tokens, vocab]``.
        """
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        for seq, chunk in chunks.items():
            done = self.computed.get(seq, 0)
            total = done + len(chunk)
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * self.block_size < total:
                blocks.append(self.free.pop())
            for pos in range(done, total):
                positions.append(pos)
                slots.append(
                    blocks[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            ids += chunk
            starts.append(starts[-1] + len(chunk))
            seq_lens.append(total)
            tables.append(blocks)
            self.computed[seq] = total
        width = max(len(t) for t in tables)
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        qsl = torch.tensor(starts, dtype=torch.int32)
        sl = torch.tensor(seq_lens, dtype=torch.int32)
        d = self.device
        md = AttentionMetadata(
            num_actual_tokens=len(ids),
            num_reqs=len(chunks),
            query_start_loc=qsl.to(d),
            seq_lens=sl.to(d),
            block_table=block_table.to(d),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=d),
            max_query_len=max(len(c) for c in chunks.values()),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=sl,
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids, device=d), torch.tensor(positions, device=d), md)
            return self.model.compute_logits(hidden)

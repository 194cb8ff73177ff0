"""Forward passes that are not serving steps: the memory-profiling pass that sizes the KV
cache, and the warm-up passes that compile kernel variants no other start-up pass reaches.

Both run on the model runner's model and buffers before the first request.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.kernels.sampling import top_p as top_p_select
from tokenmill.kernels.sampling.gumbel import gumbel_argmax
from tokenmill.math_utils import cdiv
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.model.layers.attention import Attention, bind_kv_caches, unbind_kv_caches
from tokenmill.worker import sampler
from tokenmill.worker.cascade import CASCADE_MIN_DECODES, CASCADE_MIN_PREFIX_TOKENS
from tokenmill.worker.sampling_metadata import SamplingMetadata, uses_fused_sampler

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner


@torch.inference_mode()
def profile_run(runner: ModelRunner) -> int:
    """A forward pass at the full token budget, to measure peak activation memory.

    Uses a throw-away KV cache just large enough for the batch, unbound afterwards.

    Returns:
        On CUDA, the peak bytes allocated during the pass beyond what was allocated
        before it and beyond the throw-away cache; 0 on other devices.
    """
    assert runner.model is not None
    n = runner.max_num_tokens
    num_reqs = max(1, min(runner.max_num_reqs, n // max(1, runner.max_model_len)))
    per_req = [n // num_reqs + (1 if i < n % num_reqs else 0) for i in range(num_reqs)]
    saved, saved_arena, saved_blocks = runner.kv_caches, runner.kv_arena, runner.num_blocks
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        before = torch.cuda.memory_allocated(runner.device)
    runner.initialize_kv_cache(sum(cdiv(p, runner.block_size) for p in per_req))
    # What torch's allocator counted for the scratch cache (nothing when sleep mode puts it
    # in CUDA virtual memory, which torch's peak does not see either).
    scratch = torch.cuda.memory_allocated(runner.device) - before if cuda else 0
    try:
        slots, tables, block = [], [], 0
        for p in per_req:
            nb = cdiv(p, runner.block_size)
            tables.append(list(range(block, block + nb)))
            slots += [block * runner.block_size + j for j in range(p)]
            block += nb
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        qsl = torch.tensor(np.concatenate([[0], np.cumsum(per_req)]), dtype=torch.int32)
        seq = torch.tensor(per_req, dtype=torch.int32)
        d = runner.device
        md = AttentionMetadata(
            n,
            num_reqs,
            qsl.to(d),
            seq.to(d),
            table.to(d),
            torch.tensor(slots, device=d),
            max(per_req),
            max(per_req),
            qsl,
            seq,
        )
        ids = torch.zeros(n, dtype=torch.int64, device=d)
        pos = torch.cat([torch.arange(p) for p in per_req]).to(d)
        hidden = runner.model(ids, pos, md)
        if runner.is_last_stage:
            # A decode step of max_num_seqs requests samples that many rows: the logits and
            # the sampler's float32 copies of them are part of the peak.
            rows = min(n, runner.max_num_reqs)
            logits = runner.model.compute_logits(hidden[:rows])
            runner.sampler(
                logits,
                SamplingMetadata(
                    temperature=torch.ones(rows, device=d), all_greedy=False, all_random=True
                ),
            )
        if cuda:
            torch.cuda.synchronize(runner.device)
            return max(0, torch.cuda.max_memory_allocated(runner.device) - before - scratch)
        return 0
    finally:
        runner.kv_caches, runner.kv_arena, runner.num_blocks = saved, saved_arena, saved_blocks
        # Rebinding releases the scratch cache, which the layers still reference (its memory
        # must be free before the caller measures the device's free memory).
        unbind_kv_caches(runner.model)
        if saved:
            bind_kv_caches(runner.model, saved)


@torch.inference_mode()
def warm_up_sampler(runner: ModelRunner) -> None:
    """Compile the fused sampling kernels for the logits' two dtypes (the model's, and
    float32 after logits processors), and the top-p radix select when it is on; their other
    arguments are not specialised, so no batch size compiles another variant later. CUDA
    with the fused sampler only."""
    if not uses_fused_sampler(runner.device):
        return
    rows = 1
    t = torch.ones(rows, dtype=torch.float32, device=runner.device)
    for dtype in {runner.dtype, torch.float32}:
        logits = torch.zeros(rows, runner.vocab_size, dtype=dtype, device=runner.device)
        gumbel_argmax(logits, t, torch.zeros(rows, dtype=torch.int64, device=runner.device))
    if sampler._sort_free(logits):
        top_p_select.top_p_threshold(logits.float(), t * 0.5)
    torch.cuda.synchronize(runner.device)


@torch.inference_mode()
def warm_up_attention(runner: ModelRunner) -> None:
    """Compile the attention variants that neither the profiling pass (a full-budget
    prompt step) nor the graph captures run: the prompt kernel's key splits and their
    merge, used when a short chunk follows a long context; the cascade attention kernel,
    used when decoding requests share a prompt prefix; and the decode kernel's variants
    at the decode counts and contexts that pick them (``decode_warm_up_cases``), for steps
    outside the graphs. A compile in the middle of serving would stall every request for most of a
    second. CUDA only."""
    if runner.device.type != "cuda":
        return
    ran = short_chunk_pass(runner)
    cases = decode_warm_up_cases(runner)
    sizes = [n for n, ctx in cases if ctx == 1]
    if runner.cascade_attn:
        # The decode kernel of a cascade step writes split partials: its own variants.
        for n in [CASCADE_MIN_DECODES] + [n for n in sizes if n > CASCADE_MIN_DECODES]:
            ran = shared_prefix_pass(runner, n) or ran
    ran = plain_decode_passes(runner, cases) or ran
    if ran:
        torch.cuda.synchronize(runner.device)


@torch.inference_mode()
def warm_up_multimodal(runner: ModelRunner) -> None:
    """Models that take images: compile what a step with images runs and no other start-up
    pass does. The vision encoder over one small blank image (its norms, rotary and gate
    kernels), and the eager step with image placeholders (input embeddings and M-RoPE's
    three position streams: the rotary and the cache write as separate kernels). CUDA
    only."""
    if runner.device.type != "cuda" or runner.mm is None or runner.model is None:
        return
    embed = getattr(getattr(runner.model, "visual", None), "patch_embed", None)
    if embed is not None and hasattr(embed, "temporal_patch_size"):
        side = 2 * int(getattr(runner.model, "spatial_merge_size", 2))
        width = embed.in_channels * embed.temporal_patch_size * embed.patch_size**2
        runner.model.encode_images([{
            "pixel_values": np.zeros((side * side, width), dtype=np.float32),
            "image_grid_thw": np.array([1, side, side], dtype=np.int64),
        }])  # fmt: skip
    short_chunk_pass(runner, with_images=True)
    torch.cuda.synchronize(runner.device)


@torch.inference_mode()
def short_chunk_pass(runner: ModelRunner, with_images: bool = False) -> bool:
    """An eager forward pass of 16 tokens after up to 2,048 positions over block ids
    0.., which writes nothing to the cache (slot -1) and leaves the input buffers as
    any step may (each step rewrites what it reads). Returns False when the cache or
    the model length is too small for one. ``with_images``: as a step with image
    placeholders runs it (input embeddings, and M-RoPE's three streams where the model
    has them)."""
    if runner.model is None or not runner.kv_caches:
        return False
    chunk = 16
    ctx = min(runner.max_model_len, 2048, runner.num_blocks * runner.block_size)
    if ctx <= chunk:
        return False
    num_blocks = cdiv(ctx, runner.block_size)
    runner.input_ids.device[:chunk].zero_()
    torch.arange(ctx - chunk, ctx, out=runner.positions.device[:chunk])
    runner.slot_mapping.device[:chunk].fill_(-1)
    metadata = runner.single_request_metadata(chunk, ctx)
    runner.query_start_loc.device[:2].copy_(metadata.query_start_loc_cpu)
    runner.seq_lens.device[:1].copy_(metadata.seq_lens_cpu)
    torch.arange(num_blocks, out=runner.block_table.device[0, :num_blocks])
    ids, pos = runner.input_ids.device[:chunk], runner.positions.device[:chunk]
    if not with_images:
        runner.model(ids, pos, metadata)
        return True
    kwargs = {"inputs_embeds": runner.model.embed_input_ids(ids)}
    if getattr(runner.model, "uses_mrope", False):
        kwargs["mrope_positions"] = pos.expand(3, -1).contiguous()
    runner.model(ids, pos, metadata, **kwargs)
    return True


def decode_warm_up_cases(runner: ModelRunner) -> list[tuple[int, int]]:
    """The (decode count, context tokens) pairs at which the attention backend's decode
    kernel variants first appear for this model (``AttentionBackend.decode_warm_up_cases``);
    none without a KV cache."""
    if not runner.kv_caches or runner.model is None:
        return []
    layer = next(m for m in runner.model.modules() if isinstance(m, Attention))
    return runner.attn_backend.decode_warm_up_cases(
        layer.num_kv_heads,
        max(1, layer.num_heads // max(1, layer.num_kv_heads)),
        layer.head_dim,
        runner.dtype,
        min(runner.max_num_reqs, runner.max_num_tokens),
        min(runner.max_model_len, runner.num_blocks * runner.block_size),
        runner.device,
    )


@torch.inference_mode()
def plain_decode_passes(
    runner: ModelRunner, cases: list[tuple[int, int]] | None = None
) -> bool:
    """Eager decode steps through the plain decode kernel (the one that steps outside the
    graphs run: with prompt chunks, images, or cascade), one per (decode count, context
    tokens) in ``cases`` (default: the backend's ``decode_warm_up_cases``, where its kernel
    variant changes), every request reading blocks 0.. of the cache. They write nothing
    to the cache (slot -1) and leave the input buffers as any step may. Returns False when
    there was nothing to run."""
    if runner.model is None or not runner.kv_caches:
        return False
    if cases is None:
        cases = decode_warm_up_cases(runner)
    for n, ctx in cases:
        num_blocks = cdiv(ctx, runner.block_size)
        runner.input_ids.device[:n].zero_()
        runner.positions.device[:n].fill_(ctx - 1)
        runner.slot_mapping.device[:n].fill_(-1)
        runner.seq_lens.device[:n].fill_(ctx)
        torch.arange(n + 1, out=runner.query_start_loc.device[: n + 1])
        runner.block_table.device[:n, :num_blocks].copy_(
            torch.arange(num_blocks, device=runner.device).expand(n, num_blocks)
        )
        # A query length of 2 as the longest keeps the layers off the decode-only kernel
        # that rotates and writes the new K/V itself (the graphs compile that one); every
        # request is still one of the ``n`` leading decodes.
        metadata = dataclasses.replace(
            runner.decode_metadata(n, max_seq_len=ctx),
            max_query_len=2,
            seq_lens_cpu=torch.full((n,), ctx, dtype=torch.int32),
        )
        runner.model(runner.input_ids.device[:n], runner.positions.device[:n], metadata)
    return bool(cases)


@torch.inference_mode()
def shared_prefix_pass(runner: ModelRunner, num_decodes: int = CASCADE_MIN_DECODES) -> bool:
    """An eager decode step of ``num_decodes`` requests whose contexts share their first
    blocks (block ids 0..), with cascade attention over the shared ones; writes nothing to
    the cache (slot -1) and leaves the input buffers as any step may. Returns False when
    the cache or the model length is too small for one."""
    if runner.model is None or not runner.kv_caches:
        return False
    bs = runner.block_size
    ctx = min(runner.max_model_len, 2 * CASCADE_MIN_PREFIX_TOKENS + 1)
    ctx = min(ctx, runner.num_blocks * bs)
    prefix = (ctx - 1) // bs * bs
    n = min(num_decodes, runner.max_num_reqs, runner.max_num_tokens)
    if prefix < CASCADE_MIN_PREFIX_TOKENS or n < 2:
        return False
    num_blocks = cdiv(ctx, bs)
    runner.input_ids.device[:n].zero_()
    runner.positions.device[:n].fill_(ctx - 1)
    runner.slot_mapping.device[:n].fill_(-1)
    runner.seq_lens.device[:n].fill_(ctx)
    torch.arange(n + 1, out=runner.query_start_loc.device[: n + 1])
    runner.block_table.device[:n, :num_blocks].copy_(
        torch.arange(num_blocks, device=runner.device).expand(n, num_blocks)
    )
    metadata = dataclasses.replace(
        runner.decode_metadata(n),
        max_seq_len=ctx,
        seq_lens_cpu=torch.full((n,), ctx, dtype=torch.int32),
        common_prefix_len=prefix,
    )
    runner.model(runner.input_ids.device[:n], runner.positions.device[:n], metadata)
    return True

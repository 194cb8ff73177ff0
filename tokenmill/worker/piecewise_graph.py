"""Piecewise CUDA graphs for steps that compute prompt tokens.

A decode-only step replays one graph of the whole forward pass (``cuda_graph.py``). A step
with prompt chunks cannot: how the attention kernels split its work (decodes against
prompt tiles, split counts, grids) is read from the batch layout on the host each step.
Everything else in a layer — norms, projections, rotary embedding, the MLP — depends only
on the number of tokens, and run eagerly it costs more host time than GPU time below about
a thousand tokens (``benchmarks/device/mixed_step_bench.py`` measures both).

So for each padded token count ``T`` the forward pass is captured in pieces split at its
attention calls — for ``L`` layers, ``L + 1`` graphs: up to the first attention, between
consecutive ones, after the last — and replayed in order with each layer's attention run
eagerly in between on the step's real layout. vLLM's piecewise mode splits the same way
(through torch.compile). A ``T``-token step replays the pieces of the smallest captured
size ``>= T``; the padding rows carry token 0 at position 0, and attention, which sees
the real ``num_actual_tokens``, neither writes them to the cache nor reads them.

Where the attention backend supports uniform grids, most such steps replay one whole-step
graph instead (``mixed_graph.py``); the pieces remain for steps with cascade attention or
with more prompt requests than those graphs take.

A vision-language model's steps that hold image placeholders take a second set, captured
over input embeddings instead of token ids (``embeds=True``): the step's embeddings, image
rows merged in, are computed eagerly into a static buffer, and for M-RoPE models the three
position streams into another (vLLM's piecewise graphs of multimodal models likewise take
``inputs_embeds``). Under serving load nearly every step of such a model holds some prompt's
placeholders, so without them it would run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.model.layers.attention import Attention, attention_hook
from tokenmill.worker.cuda_graph import GraphHost, PaddedGraphs

logger = logging.getLogger(__name__)

# Above this many tokens a step's GPU work hides its eager launches (measured: 2-3% gained
# by a whole-step graph at 576-1,088 tokens), so larger steps run eagerly.
MAX_PIECEWISE_TOKENS = 1024


def default_piecewise_sizes(max_num_tokens: int, max_size: int = MAX_PIECEWISE_TOKENS) -> list[int]:
    """Padded token counts to capture: 32-token steps to 256, 16-token steps to 512, then
    32-token steps, up to ``min(max_num_tokens, max_size)`` (always included).

    Padding a step costs GEMM rows, and past 256 tokens the products are compute-bound, so
    the steps between 256 and 512 tokens, where paced serving runs, are finest. Each size
    costs ``L + 1`` piecewise graphs, one whole-step graph and a little start-up time.
    """
    limit = min(max_num_tokens, max_size)
    sizes = (
        [8, 16]
        + list(range(32, 257, 32))
        + list(range(272, 513, 16))
        + list(range(544, max_size + 1, 32))
    )
    sizes = [s for s in sizes if s < limit]
    return sizes + [limit]


class PiecewiseCUDAGraphRunner(PaddedGraphs):
    """Captures the forward pass of ``runner.model`` in pieces split at attention, and
    replays them around eager attention.

    At each split the piece writes the layer's new K/V into the cache (the runner's slot
    mapping, padding rows -1) and copies its queries into a static buffer; the eager part
    is attention alone, whose output goes to another static buffer the next piece reads.
    The buffers are shared by every layer and size, so a size keeps nothing alive in the
    graph pool beyond its pieces.

    Args:
        runner: the model runner whose input buffers the graphs read.
        capture_sizes: token counts to capture (default: ``default_piecewise_sizes``).
        pool: as for ``PaddedGraphs`` (the decode graphs' pool).
        embeds: capture the forward pass over static input embeddings (and, for a model
            with ``uses_mrope``, static ``[3, T]`` position streams), replayed by
            ``run_embeds``; the model takes ``inputs_embeds`` (a multimodal model).
    """

    def __init__(
        self,
        runner: GraphHost,
        capture_sizes: list[int] | None = None,
        pool: tuple[int, int] | None = None,
        embeds: bool = False,
    ) -> None:
        super().__init__(
            runner, capture_sizes or default_piecewise_sizes(runner.max_num_tokens), pool
        )
        self.embeds = embeds
        self._embeds: torch.Tensor | None = None  # the static "embeds" buffer, [max size, H]
        self._mrope: torch.Tensor | None = None  # [3, max size] int64
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # size -> its pieces
        # Per attention call, in forward order: the layer, its static query buffer and its
        # static output buffer (full size; a step uses the first rows).
        self.calls: list[tuple[Attention, torch.Tensor, torch.Tensor]] = []
        self.hidden: torch.Tensor | None = None  # the static output of the last piece
        # Static tensors, [max size, width] by (role, width, dtype).
        self._static: dict[tuple[str, int, torch.dtype], torch.Tensor] = {}
        self.num_replays = 0  # steps run through the pieces

    def _buffer(self, role: str, like: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """The static ``role`` buffer ``[max size, W]`` for tensors like ``like`` (``[T, W]``;
        ``width`` gives another ``W``)."""
        width = width or like.shape[-1]
        key = (role, width, like.dtype)
        if key not in self._static:
            self._static[key] = torch.zeros(
                self.sizes[-1], width, dtype=like.dtype, device=like.device
            )
        return self._static[key]

    def _forward(self, model: torch.nn.Module, size: int, metadata: AttentionMetadata):
        """The model over the first ``size`` rows of the static inputs."""
        ids = self.runner.input_ids.device[:size]
        pos = self.runner.positions.device[:size]
        if not self.embeds:
            return model(ids, pos, metadata)
        if self._embeds is None:
            self._embeds = self._buffer("embeds", model.embed_input_ids(ids[:1]))
            if getattr(model, "uses_mrope", False):
                self._mrope = torch.zeros(3, self.sizes[-1], dtype=torch.int64,
                                          device=self._embeds.device)  # fmt: skip
        kwargs = {"inputs_embeds": self._embeds[:size]}
        if self._mrope is not None:
            kwargs["mrope_positions"] = self._mrope[:, :size]
        return model(ids, pos, metadata, **kwargs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size's pieces, largest first, into the shared pool."""
        model = self.runner.model
        assert model is not None
        if not self.sizes:
            return
        start = time.perf_counter()
        pool = self._shared_pool()
        # Every slot -1: the captures' K/V writes (and the warm-ups') touch no cache block.
        self.runner.slot_mapping.device.fill_(-1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._capture_size(model, size, pool)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info(
            "Captured piecewise CUDA graphs for %d token counts (%d..%d, %d pieces each) in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            len(self.calls) + 1,
            time.perf_counter() - start,
        )

    @torch.inference_mode()
    def compile_pass(self) -> None:
        model = self.runner.model
        assert model is not None
        self.runner.slot_mapping.device.fill_(-1)
        for size in reversed(self.sizes):
            metadata = self.runner.single_request_metadata(size, size)
            with attention_hook(self._hand_off(size, metadata.slot_mapping)):
                self._forward(model, size, metadata)

    def _hand_off(self, size: int, slots: torch.Tensor):
        """The attention hook that ends a piece: RoPE, the K/V write into ``slots`` and the
        query hand-off to the static buffer, recorded into the piece; returns the static
        output buffer that the eager attention call will fill."""

        def hand_off(layer: Attention, query, key, value, md, positions) -> torch.Tensor:
            query = layer.store_kv(query, key, value, slots, size, positions)
            self._buffer("query", query)[:size].copy_(query)
            return self._buffer("attn_out", query, layer.output_size)[:size]

        return hand_off

    def _capture_size(self, model: torch.nn.Module, size: int, pool: tuple[int, int]) -> None:
        # Attention does not run during capture; the metadata only has to be well formed.
        metadata = self.runner.single_request_metadata(size, size)
        calls: list[tuple[Attention, torch.Tensor, torch.Tensor]] = []
        hand_off = self._hand_off(size, metadata.slot_mapping)

        def record(layer: Attention, query, key, value, md, positions) -> torch.Tensor:
            calls.append((
                layer,
                self._buffer("query", query),
                self._buffer("attn_out", query, layer.output_size),
            ))
            return hand_off(layer, query, key, value, md, positions)

        with attention_hook(record):
            for _ in range(2):  # warm up: Triton compiles, cuBLAS workspaces, static buffers
                calls.clear()
                self.hidden = self._buffer("hidden", self._forward(model, size, metadata))
        if not calls:
            raise RuntimeError(
                "the model's forward pass made no Attention call to split at; run it with "
                "--enforce-eager"
            )
        if self.calls and [c[0] for c in calls] != [c[0] for c in self.calls]:
            raise RuntimeError("the forward pass calls attention differently for another size")
        self.calls = calls

        pieces: list[torch.cuda.CUDAGraph] = []
        graph = torch.cuda.CUDAGraph()

        def split(layer: Attention, query, key, value, md, positions) -> torch.Tensor:
            nonlocal graph
            out = hand_off(layer, query, key, value, md, positions)
            graph.capture_end()
            pieces.append(graph)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)
            return out

        with attention_hook(split):
            graph.capture_begin(pool=pool)
            try:
                hidden = self._forward(model, size, metadata)
                self._buffer("hidden", hidden)[:size].copy_(hidden)
            finally:
                graph.capture_end()
        pieces.append(graph)
        self.graphs[size] = pieces

    def run(self, num_tokens: int, metadata: AttentionMetadata) -> torch.Tensor:
        """Replay for a step of ``num_tokens`` whose inputs are in the runner's buffers.

        Args:
            num_tokens: the step's real tokens (``metadata.num_actual_tokens``).
            metadata: the step's attention metadata, used by the eager attention calls.

        Returns:
            Hidden states ``[padded, H]`` (a static buffer, valid until the next step);
            rows past ``num_tokens`` are padding.
        """
        size = self.padded_size(num_tokens)
        self.runner.pad_token_inputs(num_tokens, size)
        pieces = self.graphs[size]
        for graph, (layer, query, out) in zip(pieces, self.calls, strict=False):
            graph.replay()
            layer.attend(query[:size], metadata, out=out[:size])
        pieces[-1].replay()
        self.num_replays += 1
        assert self.hidden is not None
        return self.hidden[:size]

    def run_embeds(
        self,
        num_tokens: int,
        metadata: AttentionMetadata,
        embeds: torch.Tensor,
        mrope_positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """Replay the pieces captured over embeddings (``embeds=True``), as ``run``.

        Args:
            num_tokens: the step's real tokens.
            metadata: the step's attention metadata.
            embeds: ``[num_tokens, H]`` the step's input embeddings, image rows merged in.
            mrope_positions: ``[3, num_tokens]`` int64 position streams of an M-RoPE model,
                or None where every token's streams equal its position (the runner's
                position buffer).
        """
        assert self.embeds and self._embeds is not None
        self._embeds[:num_tokens].copy_(embeds[:num_tokens])
        if self._mrope is not None:
            size = self.padded_size(num_tokens)
            if mrope_positions is None:
                positions = self.runner.positions.device[:num_tokens]
                self._mrope[:, :num_tokens].copy_(positions.expand(3, -1))
            else:
                self._mrope[:, :num_tokens].copy_(mrope_positions)
            self._mrope[:, num_tokens:size].zero_()
        return self.run(num_tokens, metadata)

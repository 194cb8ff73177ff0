"""The CUDA graphs of a model runner, and the one place that picks which of them runs a
step (``StepGraphs.try_run``).

- whole-pass decode graphs per padded batch size (``cuda_graph.py``);
- whole-step graphs per padded token count for steps that mix prompt chunks with decodes,
  where the attention backend has uniform grids (``mixed_graph.py``);
- piecewise graphs around eager attention for the other steps with prompt tokens
  (``piecewise_graph.py``);
- a speculative proposer's graphs of its single-token passes
  (``worker/proposers/draft_passes.py``), replayed by the proposer itself.

All share one memory pool: no two of them replay at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.worker.cuda_graph import (
    CUDAGraphRunner,
    GraphHost,
    PaddedGraphs,
    garbage_collection_paused,
)
from tokenmill.worker.mixed_graph import MixedCUDAGraphRunner
from tokenmill.worker.piecewise_graph import PiecewiseCUDAGraphRunner
from tokenmill.worker.step_io import StepInputs


class StepGraphs:
    """The graph sets of one runner; an uncaptured set runs nothing (``can_run`` is False).

    Args:
        decode: whole-pass graphs of decode-only steps, or None.
        mixed: whole-step graphs of steps with prompt tokens, or None.
        piecewise: piecewise graphs of steps with prompt tokens, or None.
        images: piecewise graphs over input embeddings, of a multimodal model's steps
            that hold image placeholders (``try_run_images``), or None.
        uniform_max_prefills: the most requests after the leading decodes that a mixed
            graph takes (the attention backend's).
        pool: the memory pool the sets share.
    """

    def __init__(
        self,
        decode: CUDAGraphRunner | None = None,
        mixed: MixedCUDAGraphRunner | None = None,
        piecewise: PiecewiseCUDAGraphRunner | None = None,
        uniform_max_prefills: int = 0,
        pool: tuple[int, int] | None = None,
        images: PiecewiseCUDAGraphRunner | None = None,
    ) -> None:
        self.decode = decode
        self.mixed = mixed
        self.piecewise = piecewise
        self.images = images
        self.uniform_max_prefills = uniform_max_prefills
        self.pool = pool
        # A speculative proposer's graphs (``add_proposer``); the proposer replays them.
        self.proposer: PaddedGraphs | None = None
        # Steps by the path that ran them ("decode", "mixed", "piecewise", "eager",
        # "images": piecewise over image embeddings, "images eager"), for the step log
        # (``TOKENMILL_LOG_STEP_STATS``), which empties it.
        self.paths: Counter[str] = Counter()

    @classmethod
    def plan(
        cls, runner: GraphHost, backend: type[AttentionBackend], takes_images: bool = False
    ) -> StepGraphs:
        """The sets start-up captures for ``runner``'s model, uncaptured, in one new pool:
        mixed graphs where ``backend`` has uniform grids, embedding pieces for a model that
        ``takes_images``."""
        pool = torch.cuda.graph_pool_handle()
        mixed = None
        if backend.supports_uniform_grids:
            mixed = MixedCUDAGraphRunner(runner, pool=pool)
        images = None
        if takes_images:
            images = PiecewiseCUDAGraphRunner(runner, pool=pool, embeds=True)
        return cls(
            decode=CUDAGraphRunner(runner, pool=pool),
            mixed=mixed,
            piecewise=PiecewiseCUDAGraphRunner(runner, pool=pool),
            uniform_max_prefills=backend.uniform_max_prefills,
            pool=pool,
            images=images,
        )

    def add_proposer(self, plan: Callable[[tuple[int, int] | None], PaddedGraphs | None]) -> None:
        """Plan a speculative proposer's graphs in the shared pool: ``plan(pool)``
        (``Proposer.plan_graphs``), captured after the runner's own."""
        self.proposer = plan(self.pool)

    @property
    def sets(self) -> list[PaddedGraphs]:
        """The sets in capture order: piecewise (over ids, then embeddings), mixed, decode,
        the proposer's."""
        sets = (self.piecewise, self.images, self.mixed, self.decode, self.proposer)
        return [g for g in sets if g is not None]

    def compile_passes(self) -> None:
        """Each set's warm-up passes (``PaddedGraphs.compile_pass``)."""
        for graphs in self.sets:
            graphs.compile_pass()

    def capture(self) -> None:
        """Capture each set in order, with Python's garbage collector paused."""
        with garbage_collection_paused():
            for graphs in self.sets:
                graphs.capture()

    def has_decode_graph(self, num_reqs: int) -> bool:
        """Whether a decode-only step of ``num_reqs`` requests replays a decode graph."""
        return self.decode is not None and self.decode.can_run(num_reqs)

    def try_run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Replay the graphs that take this step, whose inputs are in the runner's buffers;
        returns the hidden states ``[>= num_tokens, H]`` (a static buffer, rows past the
        step's tokens are padding), or None when no graph takes the step (it runs eagerly).

        Steps with cascade attention (uniform grids know no shared prefix), or whose
        attention must not read the cache before the step's KV writes (captured decode
        kernels do: ``AttentionMetadata.reads_step_kv``), take no whole-step graph.
        """
        metadata = inputs.metadata
        whole_step = not (metadata.common_prefix_len or metadata.reads_step_kv)
        n, num_reqs = inputs.num_tokens, metadata.num_reqs
        if whole_step and inputs.is_decode_only and self.has_decode_graph(num_reqs):
            self.paths["decode"] += 1
            return self.decode.run(num_reqs)  # type: ignore[union-attr]
        if (
            whole_step
            and self.mixed is not None
            and self.mixed.can_run(n)
            and num_reqs - metadata.num_decodes <= self.uniform_max_prefills
        ):
            self.paths["mixed"] += 1
            return self.mixed.run(n, num_reqs)
        if self.piecewise is not None and self.piecewise.can_run(n):
            self.paths["piecewise"] += 1
            return self.piecewise.run(n, metadata)
        self.paths["eager"] += 1
        return None

    def try_run_images(
        self,
        num_tokens: int,
        metadata: AttentionMetadata,
        embeds: torch.Tensor,
        mrope_positions: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Replay the embedding pieces for a step with image placeholders (arguments as
        ``PiecewiseCUDAGraphRunner.run_embeds``); None when they do not take it (it runs
        eagerly)."""
        if self.images is None or not self.images.can_run(num_tokens):
            self.paths["images eager"] += 1
            return None
        self.paths["images"] += 1
        return self.images.run_embeds(num_tokens, metadata, embeds, mrope_positions)

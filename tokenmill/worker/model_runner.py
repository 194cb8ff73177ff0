"""ModelRunner: turns a SchedulerOutput into input tensors, runs the model, samples.

The only place where scheduler decisions become tensors. Per step it applies the scheduler's
diff to the persistent InputBatch, builds the flat batch with vectorised numpy (positions,
token ids, slot mapping, block table, the sampler's parameters), packs it into one pinned
buffer copied to the device in one call and scattered into persistent device buffers by one
kernel (``step_staging.py``), runs the model (replaying the CUDA graphs that take the step,
``step_graphs.py``, or eagerly), and samples the requests whose context is
complete (a request still prefilling its prompt in chunks samples nothing). The one
host-device sync of a step is reading the sampled token ids.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.core.engine_io import LogprobsLists
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.scheduler_output import GrammarOutput, SchedulerOutput
from tokenmill.distributed.parallel_state import broadcast_from_first_tp_rank
from tokenmill.kernels.quant import int4_cpu
from tokenmill.math_utils import cdiv
from tokenmill.model.attention.backend import KVCacheSpec
from tokenmill.model.attention.selector import get_attn_backend
from tokenmill.model.layers.attention import (
    Attention,
    bind_kv_caches,
    describe_kv_cache,
    kv_cache_specs,
)
from tokenmill.model.loader.model_loader import (
    check_weights,
    get_model,
    reload_weights,
    torch_dtype,
)
from tokenmill.worker.buffer_metadata import BufferMetadata, StagedBuffer
from tokenmill.worker.cascade import common_prefix_len
from tokenmill.worker.cuda_graph import next_size
from tokenmill.worker.host_memory import zeroed_tensor
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.kv_blocks import allocate_kv_arena, copy_kv_blocks, kv_cache_torch_dtype
from tokenmill.worker.kv_offload import KVOffloadStore
from tokenmill.worker.multimodal import MultiModalState, StepImages
from tokenmill.worker.pipeline_stage import PipelineStage
from tokenmill.worker.sampler import Sampler
from tokenmill.worker.sleep_mode import SleepMode
from tokenmill.worker.spec_decode_step import SpecDecodeStep
from tokenmill.worker.step_graphs import StepGraphs
from tokenmill.worker.step_io import (
    AsyncModelRunnerOutput,
    StepInputs,
    leading_ones,
    prompt_logprobs_of_step,
)
from tokenmill.worker.step_sampling import StepSampling
from tokenmill.worker.step_staging import DeviceArena, StepStaging

if TYPE_CHECKING:
    from tokenmill.lora.manager import LoRAManager
    from tokenmill.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class ModelRunner(StepSampling, BufferMetadata):
    """Owns the model, the KV cache tensors and the persistent batch of one device."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        mc, sc = config.model_config, config.scheduler_config
        self.dtype = torch_dtype(mc.dtype)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache_config.cache_dtype, self.dtype)
        self.block_size = config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_blocks_per_req = cdiv(self.max_model_len, self.block_size)
        self.vocab_size = mc.vocab_size
        self.attn_backend = get_attn_backend(device.type, use_mla=mc.use_mla)
        self.cascade_attn = self.attn_backend.supports_cascade and not config.disable_cascade_attn
        self.model: torch.nn.Module | None = None
        # Models that take images: the encoder cache and the step's placeholders.
        self.mm: MultiModalState | None = None
        self._step_images: StepImages | None = None
        # Pipeline parallelism: what the forward pass receives and sends (``load_model``).
        self.stage: PipelineStage | None = None
        # --enable-lora: the adapters' slots and host cache (``load_model``).
        self.lora: LoRAManager | None = None
        self.kv_caches: list[torch.Tensor] = []
        # The layers' KV caches are views of this one tensor (``[layers, *layer layout]``).
        self.kv_arena: torch.Tensor | None = None
        self.num_blocks = 0  # blocks of each cache tensor (``initialize_kv_cache``)
        # Sleep mode (``--enable-sleep-mode``): set once the model is loaded.
        self.sleep_mode: SleepMode | None = None
        # The KV offload tiers' host pool and disk file (``--kv-offloading-size``).
        self.kv_offload: KVOffloadStore | None = None
        self.sampler = Sampler(config.model_config.logprobs_mode)
        # The CUDA graphs (``plan_cuda_graphs``); None: every step runs eagerly.
        self.graphs: StepGraphs | None = None
        # Tests set these (ascending sizes) on CPU to run batches padded like CUDA-graph
        # batches: decode-only batches as the decode graphs do, others as the piecewise
        # graphs do.
        self.pad_decode_batches_to: list[int] | None = None
        self.pad_token_batches_to: list[int] | None = None
        self.input_batch = InputBatch(
            self.max_num_reqs, self.max_model_len, self.max_blocks_per_req
        )
        # Speculative decoding: drafts in, verification, the next drafts (None: off).
        self.spec_decode = SpecDecodeStep.create(config, device)
        self._init_buffers()

    def _init_buffers(self) -> None:
        # Persistent buffers: steps write into them in place, so CUDA graphs captured over
        # them stay valid and nothing is allocated per step. They share one device arena so
        # that one kernel scatters a step's staged inputs into all of them.
        d, n, r = self.device, self.max_num_tokens, self.max_num_reqs
        i64, i32 = torch.int64, torch.int32
        arena = DeviceArena(
            [
                ((n,), i64),  # input ids
                ((n,), i64),  # positions
                ((n,), i64),  # slot mapping
                ((r + 1,), i32),  # query start locations
                ((r,), i32),  # context lengths
                ((r, self.max_blocks_per_req), i32),  # block table
                ((2,), i32),  # whole-step graphs of mixed steps: the prompt requests
                ((n,), i32),  # LoRA: the adapter slot of each token
            ],
            d,
        )
        bufs = arena.buffers
        self.input_ids, self.positions, self.slot_mapping = (StagedBuffer(t) for t in bufs[:3])
        self.query_start_loc, self.seq_lens = StagedBuffer(bufs[3]), StagedBuffer(bufs[4])
        # A step stages its block-table rows straight from the InputBatch's table.
        self.block_table = StagedBuffer(bufs[5], host=False)
        self.prefill_range = StagedBuffer(bufs[6])
        self.lora_slots = StagedBuffer(bufs[7])
        # The most a step stages: its token arrays, request arrays, block-table rows, the
        # sampling rows and up to eight per-row sampling arrays of 8 bytes.
        capacity = 3 * n * 8 + n * 4 + (3 * r + 3) * 4 + r * self.max_blocks_per_req * 4 + 9 * r * 8
        self.staging = StepStaging(capacity, arena, d)
        self.sampled_host = [
            torch.zeros(r, dtype=torch.int64, pin_memory=d.type == "cuda") for _ in range(2)
        ]
        self._parity = 0
        self._prev_sampled: torch.Tensor | None = None
        # The sampled tokens go to the host on a side stream, so the next step's work does
        # not queue behind that copy.
        self._copy_stream = torch.cuda.Stream() if d.type == "cuda" else None
        self._arange = np.arange(max(n, r) + 1, dtype=np.int64)

    # ---- set-up ------------------------------------------------------------------------

    def load_model(self) -> None:
        c = self.config
        self.model = get_model(
            c.model_config, c.load_config, self.device, self.attn_backend, c.kernel_config
        )
        self.stage = PipelineStage(
            self.model, self.max_num_tokens, c.model_config.hf_config.hidden_size, self.dtype,
            self.device,
        )  # fmt: skip
        # Local layers (windows, chunks) keep plain attention: with one on every layer,
        # cascade would only cost decode-only steps their whole-step graph.
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if all(m.is_local for m in layers):
            self.cascade_attn = False
        if hasattr(self.model, "encode_images"):
            self.mm = MultiModalState(self.model, self.device)
        if c.enable_sleep_mode:
            self.sleep_mode = SleepMode(self)
        if self.spec_decode is not None:
            self.spec_decode.load_model(self.model)
        if c.lora_config is not None:
            from tokenmill.lora.manager import LoRAManager

            lora_dtype = torch_dtype(c.lora_config.resolved_dtype(c.model_config.dtype))
            self.lora = LoRAManager(self.model, c.lora_config, lora_dtype, self.lora_slots.device)

    def check_weights(self, path: str) -> None:
        """Check that ``path`` fits the model as ``reload_weights`` would load it, writing
        nothing (the loader's ``check_weights``).

        Raises:
            ModelLoadError: unreadable files, or tensors that do not fit the model.
        """
        assert self.model is not None
        c = self.config
        check_weights(self.model, c.model_config, c.load_config, path)

    def reload_weights(self, path: str | None = None, checked: bool = False) -> None:
        """Load the weights again, in place, from ``path`` (a model folder, ``.safetensors``
        or ``.gguf`` file; default: the model's own checkpoint, in its load format);
        ``checked``: ``check_weights`` has passed on ``path`` (not run again).

        Raises:
            ModelLoadError: unreadable files, or tensors that do not fit the model (then
                nothing was written).
        """
        assert self.model is not None
        c = self.config
        reload_weights(
            self.model, c.model_config, c.load_config, self.device, self.attn_backend,
            c.kernel_config, path, checked,
        )  # fmt: skip

    def add_lora(self, request: LoRARequest) -> None:
        """Load an adapter into host memory (``LoRAManager.add_lora``).

        Raises:
            LoRAAdapterError: the adapter cannot be served; ValueError: LoRA is off.
        """
        if self.lora is None:
            raise ValueError("LoRA adapters need --enable-lora")
        self.lora.add_lora(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False when it was not loaded."""
        return self.lora is not None and self.lora.remove_lora(lora_int_id)

    def model_weight_bytes(self) -> int:
        """Bytes of the model's parameters and buffers on the device."""
        assert self.model is not None
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def is_last_stage(self) -> bool:
        """Whether this runner computes logits and samples (the last pipeline stage)."""
        return self.stage is None or self.stage.is_last

    def attention_layers(self) -> list[Attention]:
        """The attention layers this rank holds (its pipeline stage's), by layer index."""
        assert self.model is not None
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        return sorted(layers, key=lambda m: m.layer_idx)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """What each attention layer of the model caches per token, by layer index."""
        assert self.model is not None
        return kv_cache_specs(self.model)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes over all layers (K and V, or MLA's latent, in the cache's
        dtype), plus a speculative proposer's own KV of the same tokens, which lives in the
        same block ids (in the model's dtype: only the target's cache follows
        ``--kv-cache-dtype``)."""
        specs = self.kv_cache_specs()
        size = sum(spec.bytes_per_token(self.kv_cache_dtype) for spec in specs) * self.block_size
        if self.spec_decode is not None:
            size += self.spec_decode.kv_cache_bytes_per_block(self.block_size, self.dtype)
        return size

    def describe_kv_cache(self) -> str:
        """What a token costs in the KV cache, for the start-up log."""
        assert self.model is not None
        return describe_kv_cache(self.model, self.kv_cache_dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one ``[layers, *layout]`` tensor, where ``layout`` is each layer's cache
        in its backend's layout (``[2, num_blocks, block_size, kv_heads, head_dim]``, or
        ``[num_blocks, block_size, latent]`` for MLA), and bind each layer its view. One
        tensor: sleep mode frees it at once, and the offload tiers move a block of every
        layer with one copy; zero-filled (see ``allocate_kv_arena``). With sleep mode on
        CUDA it lives in stable-address memory (``SleepMode.allocate``).

        Raises:
            ValueError: layers that cache different shapes (no model here does).
        """
        self.num_blocks = num_blocks
        allocate = self.sleep_mode.allocate if self.sleep_mode is not None else None
        self.kv_arena = allocate_kv_arena(
            self.kv_cache_specs(), self.attn_backend, num_blocks, self.block_size,
            self.kv_cache_dtype, self.device, allocate,
        )  # fmt: skip
        self.kv_caches = list(self.kv_arena.unbind(0))
        assert self.model is not None
        bind_kv_caches(self.model, self.kv_caches)
        if self.spec_decode is not None:
            self.spec_decode.initialize_kv_cache(
                num_blocks,
                lambda heads, head_dim: zeroed_tensor(
                    tuple(self.attn_backend.get_kv_cache_shape(
                        num_blocks, self.block_size, heads, head_dim
                    )),
                    self.dtype,
                    self.device,
                ),
            )  # fmt: skip

    def plan_cuda_graphs(self) -> StepGraphs | None:
        """The CUDA graphs start-up captures (``StepGraphs.plan``), uncaptured, planned once;
        None off CUDA."""
        if self.device.type == "cuda" and self.graphs is None:
            self.graphs = StepGraphs.plan(
                self, self.attn_backend,
                takes_images=self.mm is not None and self.mm.graph_image_steps,
            )
            if self.spec_decode is not None:
                self.graphs.add_proposer(self.spec_decode.proposer.plan_graphs)
        return self.graphs

    def capture_cuda_graphs(self) -> None:
        """Capture the planned graphs: piecewise graphs for steps with prompt tokens, then
        whole-pass graphs for mixed and decode-only batches, in one memory pool."""
        graphs = self.plan_cuda_graphs()
        if graphs is not None:
            graphs.capture()

    # ---- one step ----------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.remove(req_id)
            if self.mm is not None:
                self.mm.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            if new.lora_request is not None and self.lora is not None:
                # read from its folder when a step needs it (``LoRAManager.slots_for``,
                # where a folder gone since ends the request, not the step)
                self.lora.remember(new.lora_request)
            batch.add(new)
            if self.mm is not None:
                self.mm.add_request(new)
        if self.mm is not None:
            self.mm.run_encoder(so)
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=False
        ):
            batch.append_blocks(req_id, block_ids)
            batch.set_num_computed(req_id, num_computed)
        if so.kv_transfers:
            assert self.kv_offload is not None and self.kv_arena is not None
            self.kv_offload.apply(so.kv_transfers, self.kv_arena)
        for req_id, token_ids in cached.new_token_ids.items():
            batch.set_tokens(req_id, int(batch.requests[req_id].num_computed_tokens), token_ids)
        if so.block_copies:
            copy_kv_blocks(self.kv_caches, so.block_copies)
        if not self.is_last_stage:
            for req_id, token_ids in so.new_token_ids.items():
                batch.set_output_tokens(req_id, token_ids)
        if self.spec_decode is not None:
            self.spec_decode.write_drafts(batch, so.scheduled_spec_decode_tokens)

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        self._parity ^= 1
        staging = self.staging
        staging.begin()
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        num_reqs = len(req_ids)
        rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=num_reqs)
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        num_tokens = n = int(num_sched.sum())
        cu = self.query_start_loc.np[: num_reqs + 1]
        cu[0] = 0
        np.cumsum(num_sched, out=cu[1:])
        starts = cu[:-1].astype(np.int64)
        req_idx = np.repeat(self._arange[:num_reqs], num_sched)
        computed = batch.num_computed_tokens[rows].astype(np.int64)
        positions = self.positions.np[:num_tokens]
        np.add(computed[req_idx], self._arange[:num_tokens] - starts[req_idx], out=positions)
        token_rows = rows[req_idx]
        input_ids = self.input_ids.np[:num_tokens]
        input_ids[:] = batch.token_ids[token_rows, positions]
        prev_sampled = self._stage_pending_tokens(rows, starts, input_ids)
        block_ids = batch.block_table[token_rows, positions // self.block_size]
        slots = self.slot_mapping.np[:num_tokens]
        np.add(block_ids.astype(np.int64) * self.block_size, positions % self.block_size, out=slots)
        seq_lens = computed + num_sched
        self.seq_lens.np[:num_reqs] = seq_lens
        max_blocks = cdiv(int(seq_lens.max()), self.block_size)
        block_table = batch.block_table[rows, :max_blocks]
        # A request samples once its whole context is computed this step.
        sample_rows = np.nonzero(seq_lens >= batch.num_tokens[rows])[0]
        num_decodes = leading_ones(num_sched)
        self.prefill_range.np[:] = (num_decodes, num_reqs - num_decodes)

        staging.put_tokens(input_ids, self.input_ids.device[:n])
        rope_positions, mrope = positions, None
        if self.mm is not None:
            rope_positions, mrope = self.mm.rope_positions(req_ids, req_idx, positions)
            self._step_images = self.mm.step_images(req_ids, computed, num_sched, mrope)
        staging.put_into(rope_positions, self.positions.device[:n])
        staging.put_into(slots, self.slot_mapping.device[:n])
        staging.put_into(cu, self.query_start_loc.device[: num_reqs + 1])
        staging.put_into(self.seq_lens.np[:num_reqs], self.seq_lens.device[:num_reqs])
        staging.put_into(block_table, self.block_table.device[:num_reqs, :max_blocks])
        staging.put_into(self.prefill_range.np, self.prefill_range.device)
        failed: dict[str, str] = {}
        if self.lora is not None:
            req_slots, failed = self.lora.slots_for(batch.lora_id[rows], req_ids)
            staging.put_into(req_slots[req_idx], self.lora_slots.device[:n])
        if self.mm is not None and self.mm.failed_images:
            failed.update(self.mm.failed_requests(req_ids))
        last = cu[1:][sample_rows].astype(np.int64) - 1
        if so.scheduled_spec_decode_tokens:
            assert self.spec_decode is not None
            # Every position from a request's last known token on is verified.
            last = self.spec_decode.logits_indices(last, rows[sample_rows])
        logits_indices = staging.put(last)
        sampling_metadata = None
        if (
            len(sample_rows)
            and batch.simple_sampling[rows[sample_rows]].all()
            and not so.scheduled_spec_decode_tokens
        ):
            sampling_metadata = self._plain_sampling_metadata(rows[sample_rows], staging.put)
        staging.flush(prev_sampled)

        prefix_len = 0
        if self.cascade_attn:
            prefix_len = common_prefix_len(
                block_table, seq_lens, num_decodes, self.block_size,
                replaces_graph=num_decodes == num_reqs
                and self.graphs is not None
                and self.graphs.has_decode_graph(num_reqs),
            )  # fmt: skip
        metadata = self.buffer_metadata(
            n,
            num_reqs,
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=torch.from_numpy(cu.copy()),
            seq_lens_cpu=torch.from_numpy(self.seq_lens.np[:num_reqs].copy()),
            num_decodes=num_decodes,
            common_prefix_len=prefix_len,
            reads_step_kv=so.reads_step_kv,
        )
        prompt_rows = sample_prompt_rows = None
        if self.device.type == "cpu":  # which rows take the quantized weights' bf16 copy
            is_prompt = positions < batch.num_prompt_tokens[token_rows]
            prompt_rows = int4_cpu.PromptRows.from_mask(is_prompt)
            sample_prompt_rows = int4_cpu.PromptRows.from_mask(is_prompt[last])
        return StepInputs(
            req_ids,
            n,
            metadata,
            sample_rows.tolist(),
            logits_indices,
            num_sched,
            computed,
            rows,
            sampling_metadata,
            prompt_rows,
            sample_prompt_rows,
            failed,
        )

    def _stage_pending_tokens(
        self, rows: np.ndarray, starts: np.ndarray, input_ids: np.ndarray
    ) -> torch.Tensor | None:
        """Async scheduling: a request whose last sampled token is still only on the device
        takes it from there, as the input of its (single) scheduled token: its input id is
        staged as ``-(i + 1)`` for entry ``i`` of the previous step's sampled tokens, which
        are returned (None when no request takes one)."""
        src = self.input_batch.pending_idx[rows]
        self.input_batch.pending_idx[rows] = -1  # consumed by this step
        has = src >= 0
        if self._prev_sampled is None or not has.any():
            return None
        input_ids[starts[has]] = -(src[has] + 1)
        return self._prev_sampled

    def _run_model(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states ``[>= num_tokens, H]`` of the step (a graph's output is padded);
        on a pipeline stage other than the last, hidden states and residual ``[>= T, 2H]``,
        already on their way to the next stage."""
        with int4_cpu.prompt_rows(inputs.prompt_rows):
            return self._run_stage(inputs)

    def _run_stage(self, inputs: StepInputs) -> torch.Tensor:
        assert self.stage is not None
        self.stage.before_forward(inputs.num_tokens)
        if self._step_images is not None:  # image placeholders: over input embeddings
            assert self.mm is not None
            n, images, self._step_images = inputs.num_tokens, self._step_images, None
            ids = self.input_ids.device[:n]
            metadata = self.mm.step_metadata(inputs.metadata, images)
            embeds = self.mm.step_embeds(ids, images)
            hidden = None
            if self.graphs is not None:
                hidden = self.graphs.try_run_images(n, metadata, embeds, images.mrope_positions)
            if hidden is None:
                hidden = self.mm.forward(ids, self.positions.device[:n], metadata, images, embeds)
            self.stage.after_forward(hidden, n)
            return hidden
        hidden = self.graphs.try_run(inputs) if self.graphs is not None else None
        hidden = hidden if hidden is not None else self._run_eager(inputs)
        self.stage.after_forward(hidden, inputs.num_tokens)
        return hidden

    def _run_eager(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass, eagerly; padded as the CUDA graphs pad where a test set
        ``pad_decode_batches_to`` / ``pad_token_batches_to`` (CPU checks of that padding)."""
        assert self.model is not None
        n, metadata = inputs.num_tokens, inputs.metadata
        padded = None
        whole_step = not (metadata.common_prefix_len or metadata.reads_step_kv)
        if inputs.is_decode_only and whole_step and self.pad_decode_batches_to:
            padded = next_size(self.pad_decode_batches_to, metadata.num_reqs)
            if padded is not None:
                metadata = self.pad_decode_batch(metadata.num_reqs, padded)
        if padded is None and self.pad_token_batches_to:
            padded = next_size(self.pad_token_batches_to, n)
            if padded is not None:
                self.pad_token_inputs(n, padded)
        size = padded or n
        return self.model(self.input_ids.device[:size], self.positions.device[:size], metadata)

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch one step and return before its sampled tokens reach the host.

        Only for batches whose requests all sample on the fast path (no penalties, seeds or
        logprobs: ``SamplingParams.uses_full_sampler`` is False); the engine runs other
        steps with ``execute_model``. Not under pipeline parallelism (the stages overlap
        micro-batches instead).
        """
        self._update_states(so)
        assert self.model is not None and so.total_num_scheduled_tokens > 0
        assert self.is_last_stage, "async scheduling with pipeline parallelism"
        inputs = self._prepare_inputs(so)
        hidden = self._run_model(inputs)
        batch = self.input_batch
        host = self.sampled_host[self._parity][: len(inputs.sample_rows)]
        event = None
        if inputs.sample_rows:
            with int4_cpu.prompt_rows(inputs.sample_prompt_rows):
                logits = self.model.compute_logits(self._sample_hidden(hidden, inputs))
            rows = inputs.batch_rows[inputs.sample_rows]
            metadata = inputs.sampling_metadata or self._sampling_metadata(inputs, rows)
            sampled = self.sampler(logits, metadata).sampled_token_ids
            broadcast_from_first_tp_rank(sampled)
            batch.pending_idx[rows] = np.arange(len(rows))
            self._prev_sampled = sampled
            event = self._copy_sampled(sampled, host)
        self._advance_computed(inputs)
        return AsyncModelRunnerOutput(self.input_batch, inputs, host, event)

    @torch.inference_mode()
    def execute_model(
        self, so: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """Run one step; ``grammar_output`` holds the grammar bitmasks of its requests with
        structured outputs.

        Returns:
            The sampled token of every request that completed its context this step (an
            empty list for requests mid-prefill), plus logprobs and prompt logprobs; no
            tokens on a pipeline stage other than the last.
        """
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        assert self.model is not None
        inputs = self._prepare_inputs(so)
        hidden = self._run_model(inputs)
        if not self.is_last_stage:
            self._advance_computed(inputs)
            return ModelRunnerOutput(
                inputs.req_ids, [[] for _ in inputs.req_ids],
                failed_requests=inputs.failed_requests,
            )  # fmt: skip
        prompt_logprobs = prompt_logprobs_of_step(
            self.model, self.input_batch, inputs, hidden, self.device
        )
        bitmasks = grammar_output.bitmasks if grammar_output else {}
        if self.spec_decode is not None:
            return self.spec_decode.finish_step(self, bitmasks, inputs, hidden, prompt_logprobs)
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if inputs.sample_rows:
            token_ids, logprobs = self.sample_tokens(inputs, hidden, bitmasks)
            req_ids, batch = inputs.req_ids, self.input_batch
            for i, tok in zip(inputs.sample_rows, token_ids, strict=False):
                sampled[i] = [tok]
                batch.append_token(req_ids[i], tok)
        self._advance_computed(inputs)
        return ModelRunnerOutput(
            inputs.req_ids, sampled, logprobs, prompt_logprobs,
            failed_requests=inputs.failed_requests,
        )  # fmt: skip

    def _advance_computed(self, inputs: StepInputs) -> None:
        batch = self.input_batch
        new_computed = inputs.num_computed + inputs.num_scheduled
        batch.num_computed_tokens[inputs.batch_rows] = new_computed
        for req_id, c in zip(inputs.req_ids, new_computed.tolist(), strict=False):
            batch.requests[req_id].num_computed_tokens = c

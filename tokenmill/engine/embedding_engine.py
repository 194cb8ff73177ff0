"""The embedding engine: encoder models (BERT and kin) turn inputs into pooled vectors.

An encoder needs neither a KV cache nor a scheduler: each input is one bidirectional forward
pass. So embedding models get this small path instead of the generation engine:

- ``EmbeddingEngine`` (synchronous; ``LLM.embed``): tokenizes and validates inputs, sorts
  them by length and packs them into padded batches under the token budget
  (``max_num_batched_tokens`` padded tokens, at most ``max_num_seqs`` inputs), runs the
  model and the pooler.
- ``AsyncEmbeddingEngine`` (the server): requests that arrive within a few milliseconds of
  each other, or while a forward pass runs, are batched together; the forward pass runs in a
  worker thread so the event loop keeps serving HTTP.

NOTE: a thread, not an engine process as for generation: an encoder keeps no state between
requests, torch releases the GIL inside its kernels, and the results are small, so a
process would add start-up, serialization and a failure mode without freeing the loop more.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.engine.input_processor import InvalidRequestError
from tokenmill.engine_args import EngineArgs, UsageContext
from tokenmill.model.layers.pooler import Pooler
from tokenmill.outputs import EmbeddingOutput, EmbeddingRequestOutput
from tokenmill.tokenizer import get_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# An input: text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}.
EmbeddingPrompt = str | list[int] | dict[str, Any]


def plan_batches(lengths: Sequence[int], max_tokens: int, max_seqs: int) -> list[list[int]]:
    """Group input indices into padded batches under a token budget.

    Inputs are taken longest first, so each batch holds similar lengths and little padding;
    a batch holds at most ``max_seqs`` inputs and ``max_tokens`` padded tokens (its size
    times its longest input), or else a single input longer than the budget.

    Args:
        lengths: tokens of each input.
        max_tokens: padded tokens per batch (``max_num_batched_tokens``).
        max_seqs: inputs per batch (``max_num_seqs``).

    Returns:
        Index lists that together hold every index once.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        full = (len(current) + 1) * longest > max_tokens or len(current) >= max_seqs
        if current and full:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


class EmbeddingEngine:
    """Loads an embedding model and computes pooled embeddings in the caller's thread.

    Args:
        config: the resolved engine configuration of an embedding model
            (``model_config.pooler_config`` set).

    Raises:
        ValueError: the model is not an embedding model.
        ModelLoadError: the model's files cannot be read.
    """

    def __init__(self, config: EngineConfig) -> None:
        mc = config.model_config
        if mc.pooler_config is None:
            raise ValueError(f"{mc.model} ({mc.architecture}) is not an embedding model")
        self.config = config
        self.model_config = mc
        self.max_model_len = mc.max_model_len
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.tokenizer = get_tokenizer(mc.model, mc.tokenizer if mc.tokenizer != mc.model else None)
        self._init_device()
        self._init_model()
        self.pooler = Pooler(mc.pooler_config)
        self._counter = itertools.count()

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, usage_context: UsageContext = "llm"
    ) -> EmbeddingEngine:
        return cls(engine_args.create_engine_config(usage_context))

    def _init_device(self) -> None:
        if self.config.device_config.device == "cuda":
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            threads = envs.cpu_threads()
            if threads:
                torch.set_num_threads(threads)
        torch.manual_seed(self.model_config.seed)

    def _init_model(self) -> None:
        from tokenmill.model.attention.selector import get_attn_backend
        from tokenmill.model.loader.model_loader import get_model

        backend = get_attn_backend(self.device.type)
        self.model = get_model(self.model_config, self.config.load_config, self.device, backend)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    # ---- inputs ------------------------------------------------------------------------

    def tokenize(
        self,
        prompt: EmbeddingPrompt,
        truncate_prompt_tokens: int | None = None,
        add_special_tokens: bool = True,
        param: str = "input",
    ) -> list[int]:
        """Token ids of one input, validated against the model.

        Args:
            prompt: text (tokenized with the model's special tokens, e.g. [CLS] ... [SEP]),
                token ids (used as given) or a dict with "prompt" / "prompt_token_ids".
            truncate_prompt_tokens: keep at most this many tokens (-1: the model's maximum),
                cut on the tokenizer's truncation side; None: reject longer inputs.
            add_special_tokens: add the tokenizer's special tokens to text inputs.
            param: the request field named in errors.

        Raises:
            InvalidRequestError: an empty input, token ids outside the vocabulary, a bad
                ``truncate_prompt_tokens``, or an input longer than the model's maximum.
        """
        limit = self._truncation_limit(truncate_prompt_tokens)
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("An input is empty: give at least one character.", param)
            kwargs: dict[str, Any] = {"add_special_tokens": add_special_tokens}
            if limit is not None:
                kwargs.update(truncation=True, max_length=limit)
            ids = list(self.tokenizer(prompt, **kwargs)["input_ids"])
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            if limit is not None and len(ids) > limit:
                left = getattr(self.tokenizer, "truncation_side", "right") == "left"
                ids = ids[-limit:] if left else ids[:limit]
        else:
            raise InvalidRequestError(
                f"An input must be text or a list of token ids, got {type(prompt).__name__}.",
                param,
            )
        self._validate(ids, param)
        return ids

    def _truncation_limit(self, truncate_prompt_tokens: int | None) -> int | None:
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == -1:
            return self.max_model_len
        if not 1 <= truncate_prompt_tokens <= self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be -1 or between 1 and the model's maximum "
                f"input length ({self.max_model_len}), got {truncate_prompt_tokens}.",
                "truncate_prompt_tokens",
            )
        return truncate_prompt_tokens

    def _validate(self, ids: list[int], param: str) -> None:
        if not ids:
            raise InvalidRequestError("An input is empty: give at least one token.", param)
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"Token ids {bad[:5]} are out of the vocabulary [0, {vocab}).", param
            )
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum input length is {self.max_model_len} tokens. However, "
                f"an input has {len(ids)} tokens. Shorten it, or set truncate_prompt_tokens "
                f"to cut it.",
                param,
            )

    def check_dimensions(self, dimensions: int | None) -> None:
        """Reject ``dimensions`` unless the model is a Matryoshka model that has them.

        Raises:
            InvalidRequestError: the model does not support shortened embeddings, or the
                value is not one it supports.
        """
        if dimensions is None:
            return
        hf = self.model_config.hf_config
        supported = hf.get("matryoshka_dimensions")
        if not (hf.get("is_matryoshka") or supported):
            raise InvalidRequestError(
                "This model does not support the dimensions parameter: it was not trained "
                "for shortened (Matryoshka) embeddings.",
                "dimensions",
            )
        hidden = hf.hidden_size
        if supported and dimensions not in supported:
            raise InvalidRequestError(
                f"dimensions {dimensions} is not supported by this model; choose one of "
                f"{sorted(supported)}.",
                "dimensions",
            )
        if not 1 <= dimensions <= hidden:
            raise InvalidRequestError(
                f"dimensions must be between 1 and {hidden}, got {dimensions}.", "dimensions"
            )

    # ---- model -------------------------------------------------------------------------

    @torch.inference_mode()
    def pool(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Pooled, not yet normalized embeddings of validated inputs.

        Returns:
            ``[N, H]`` float32 on the CPU, row ``i`` for ``token_ids[i]``.
        """
        out = torch.empty(len(token_ids), self.model_config.hf_config.hidden_size)
        lengths = [len(t) for t in token_ids]
        for batch in plan_batches(lengths, self.max_num_batched_tokens, self.max_num_seqs):
            rows = [token_ids[i] for i in batch]
            longest = max(len(r) for r in rows)
            input_ids = torch.zeros(len(rows), longest, dtype=torch.long)
            mask = torch.zeros(len(rows), longest, dtype=torch.bool)
            for j, row in enumerate(rows):
                input_ids[j, : len(row)] = torch.tensor(row, dtype=torch.long)
                mask[j, : len(row)] = True
            input_ids, mask = input_ids.to(self.device), mask.to(self.device)
            hidden = self.model(input_ids, mask)
            out[batch] = self.pooler(hidden, mask).cpu()
        return out

    def postprocess(self, pooled: torch.Tensor, dimensions: int | None = None) -> list[float]:
        """One pooled row ``[H]`` -> the embedding returned to the user (truncated to
        ``dimensions``, L2-normalized if the model's pooling says so)."""
        return self.pooler.postprocess(pooled, dimensions).tolist()

    # ---- offline API -------------------------------------------------------------------

    def embed(
        self,
        prompts: Sequence[EmbeddingPrompt],
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every input; all are validated before any is run.

        Raises:
            InvalidRequestError: an input cannot be embedded (see ``tokenize``) or
                ``dimensions`` is not supported.
        """
        self.check_dimensions(dimensions)
        token_ids = [
            self.tokenize(p, truncate_prompt_tokens, param=f"prompts[{i}]")
            for i, p in enumerate(prompts)
        ]
        pooled = self.pool(token_ids) if token_ids else torch.empty(0)
        return [
            EmbeddingRequestOutput(
                request_id=str(next(self._counter)),
                prompt_token_ids=ids,
                outputs=EmbeddingOutput(self.postprocess(row, dimensions)),
            )
            for ids, row in zip(token_ids, pooled, strict=True)
        ]

    def shutdown(self) -> None:
        """Nothing to stop: the model is freed with the engine."""


@dataclass
class _Pending:
    """Inputs of one request waiting for the next batch, and where their result goes."""

    token_ids: list[list[int]]
    future: asyncio.Future


class AsyncEmbeddingEngine:
    """The asyncio front of an EmbeddingEngine (the server): batches concurrent requests.

    ``embed`` queues a request's inputs; one background task waits ``BATCH_WAIT_S`` for
    more to arrive, then runs everything queued as one ``pool`` call in a worker thread.
    Requests queued while a forward pass runs go in the next one.

    Args:
        config: the resolved configuration of an embedding model.
        engine: an already-built EmbeddingEngine (tests); built from ``config`` if None.

    Raises:
        ValueError, ModelLoadError: as EmbeddingEngine.
    """

    BATCH_WAIT_S = 0.002

    def __init__(self, config: EngineConfig, engine: EmbeddingEngine | None = None) -> None:
        self.engine = engine or EmbeddingEngine(config)
        self.config = config
        self.model_config = self.engine.model_config
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-embed")
        self._pending: list[_Pending] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def check_health(self) -> None:
        """Raises EngineDeadError once the engine has been shut down."""
        if self._closed:
            from tokenmill.engine.async_llm import EngineDeadError

            raise EngineDeadError("the embedding engine has been shut down")

    async def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """Pooled (not normalized) embeddings of validated inputs: ``[N, H]`` float32, CPU.

        Raises:
            EngineDeadError: the engine has been shut down.
            RuntimeError: the forward pass failed (the message says why).
        """
        self.check_health()
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = loop.create_task(self._batch_loop())
        pending = _Pending(token_ids, loop.create_future())
        self._pending.append(pending)
        assert self._wakeup is not None
        self._wakeup.set()
        return await pending.future

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(self.BATCH_WAIT_S)
            while self._pending:
                # A request whose client went away has a cancelled future: skip its inputs.
                batch = [p for p in self._pending if not p.future.done()]
                self._pending = []
                if not batch:
                    break
                flat = [ids for p in batch for ids in p.token_ids]
                try:
                    pooled = await loop.run_in_executor(self._executor, self.engine.pool, flat)
                except Exception as e:  # a failed forward fails its requests, not the server
                    logger.exception("embedding forward pass failed")
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(RuntimeError(f"embedding failed: {e}"))
                    continue
                start = 0
                for p in batch:
                    rows = pooled[start : start + len(p.token_ids)]
                    start += len(p.token_ids)
                    if not p.future.done():
                        p.future.set_result(rows)

    def shutdown(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        for p in self._pending:
            if not p.future.done():
                p.future.cancel()
        self._pending = []
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()

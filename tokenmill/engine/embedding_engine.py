"""The embedding front ends: encoder models (BERT and kin) turn inputs into pooled vectors
behind a ``PoolingEngineCore``, as generative models are served behind an ``EngineCore``.

- ``EmbeddingFrontEnd``: tokenizes and validates inputs, checks ``dimensions``, and turns a
  pooled vector into the embedding returned to the user (truncated, L2-normalized as the
  model's pooling says).
- ``EmbeddingEngine`` (synchronous; ``LLM.embed``): the front end over an in-process
  ``PoolingEngineCore``.
- ``AsyncEmbeddingEngine`` (the server): the front end over an engine process running a
  ``PoolingEngineCore`` (``engine/engine_core_proc.py``, the same process, sockets and
  failure handling as ``AsyncLLM``'s); requests that arrive together, or while a batch
  runs, are batched by the core's next steps.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.core.engine_io import EngineCoreOutputs, EngineCoreRequest
from tokenmill.engine.async_llm import AsyncLLM, EngineDeadError
from tokenmill.engine.engine_core_proc import MSG_ADD
from tokenmill.engine.input_processor import InvalidRequestError
from tokenmill.engine.pooling_core import PoolingEngineCore
from tokenmill.engine_args import EngineArgs, UsageContext
from tokenmill.model.layers.pooler import Pooler
from tokenmill.outputs import EmbeddingOutput, EmbeddingRequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import get_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# An input: text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}.
EmbeddingPrompt = str | list[int] | dict[str, Any]

_encoder = msgspec.msgpack.Encoder()


def _engine_request(request_id: str, token_ids: list[int]) -> EngineCoreRequest:
    """A pooling request for the core (its sampling parameters are unused)."""
    return EngineCoreRequest(request_id, list(token_ids), SamplingParams(), time.time())


class EmbeddingFrontEnd:
    """Inputs and outputs of an embedding model, on the front end's side of the core.

    Args:
        model_config: the embedding model's (``pooler_config`` set).
        tokenizer: its tokenizer.

    Raises:
        ValueError: the model is not an embedding model.
    """

    def __init__(self, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        mc = model_config
        if mc.pooler_config is None:
            raise ValueError(f"{mc.model} ({mc.architecture}) is not an embedding model")
        self.model_config = mc
        self.max_model_len = mc.max_model_len
        self.tokenizer = tokenizer
        self.pooler = Pooler(mc.pooler_config)

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

    def postprocess(self, pooled: Sequence[float] | torch.Tensor, dimensions: int | None = None
                    ) -> list[float]:  # fmt: skip
        """One pooled row ``[H]`` -> the embedding returned to the user (truncated to
        ``dimensions``, L2-normalized if the model's pooling says so)."""
        row = torch.as_tensor(pooled, dtype=torch.float32)
        return self.pooler.postprocess(row, dimensions).tolist()


class EmbeddingEngine:
    """Embeds inputs in the caller's thread, through an in-process ``PoolingEngineCore``.

    Args:
        config: the resolved engine configuration of an embedding model
            (``model_config.pooler_config`` set).

    Raises:
        ValueError: the model is not an embedding model.
        ModelLoadError: the model's files cannot be read.
    """

    def __init__(self, config: EngineConfig) -> None:
        mc = config.model_config
        self.config = config
        self.model_config = mc
        self.tokenizer = get_tokenizer(mc.model, mc.tokenizer if mc.tokenizer != mc.model else None)
        self.front_end = EmbeddingFrontEnd(mc, self.tokenizer)
        self.engine_core = PoolingEngineCore(config)
        self._counter = itertools.count()

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, usage_context: UsageContext = "llm"
    ) -> EmbeddingEngine:
        return cls(engine_args.create_engine_config(usage_context))

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def pool(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Pooled, not yet normalized embeddings of validated inputs, in the core's batches.

        Returns:
            ``[N, H]`` float32 on the CPU, row ``i`` for ``token_ids[i]``.

        Raises:
            RuntimeError: a forward pass failed (the message says why).
        """
        ids = [f"embd-{next(self._counter)}" for _ in token_ids]
        for request_id, tokens in zip(ids, token_ids, strict=True):
            self.engine_core.add_request(_engine_request(request_id, list(tokens)))
        rows: dict[str, list[float]] = {}
        while self.engine_core.has_unfinished_requests():
            for out in self.engine_core.step().outputs:
                if out.pooled is None:
                    self.engine_core.abort_requests(ids)
                    raise RuntimeError(str(out.stop_reason))
                rows[out.request_id] = out.pooled
        hidden = self.model_config.hf_config.hidden_size
        return torch.tensor([rows[i] for i in ids], dtype=torch.float32).view(len(ids), hidden)

    def embed(
        self,
        prompts: Sequence[EmbeddingPrompt],
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every input; all are validated before any is run.

        Raises:
            InvalidRequestError: an input cannot be embedded (``EmbeddingFrontEnd.tokenize``)
                or ``dimensions`` is not supported.
        """
        front = self.front_end
        front.check_dimensions(dimensions)
        token_ids = [
            front.tokenize(p, truncate_prompt_tokens, param=f"prompts[{i}]")
            for i, p in enumerate(prompts)
        ]
        pooled = self.pool(token_ids) if token_ids else torch.empty(0)
        return [
            EmbeddingRequestOutput(
                request_id=str(i),
                prompt_token_ids=ids,
                outputs=EmbeddingOutput(front.postprocess(row, dimensions)),
            )
            for i, (ids, row) in enumerate(zip(token_ids, pooled, strict=True))
        ]

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class AsyncEmbeddingEngine(AsyncLLM):
    """The server's embedding engine: ``AsyncLLM``'s engine process, running a
    ``PoolingEngineCore``, with ``embed`` in place of ``generate``.

    Args:
        config: the resolved configuration of an embedding model.
        start_timeout_s: how long to wait for the engine to load (seconds).

    Raises:
        EngineDeadError: the engine process failed to start (the message says why).
        ValueError: the model is not an embedding model.
    """

    def __init__(self, config: EngineConfig, start_timeout_s: float = 1800.0) -> None:
        super().__init__(config, start_timeout_s=start_timeout_s)
        self.front_end = EmbeddingFrontEnd(config.model_config, self.tokenizer)
        self._waiters: dict[str, asyncio.Future] = {}

    async def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """Pooled (not normalized) embeddings of validated inputs: ``[N, H]`` float32, CPU.
        Cancelling the call aborts its inputs in the engine.

        Raises:
            EngineDeadError: the engine is not running (or dies meanwhile).
            RuntimeError: the forward pass failed (the message says why).
        """
        self._ensure_background_tasks()
        self.check_health()
        loop = asyncio.get_running_loop()
        base = uuid.uuid4().hex
        ids = [f"embd-{base}-{i}" for i in range(len(token_ids))]
        futures = [loop.create_future() for _ in ids]
        self._waiters.update(zip(ids, futures, strict=True))
        try:
            for request_id, tokens in zip(ids, token_ids, strict=True):
                message = _encoder.encode(_engine_request(request_id, tokens))
                await self._input_sock.send_multipart([MSG_ADD, message])
            rows = await asyncio.gather(*futures)
        finally:
            pending = [i for i in ids if self._waiters.pop(i, None) is not None]
            if pending:
                self._send_abort(pending)
        hidden = self.model_config.hf_config.hidden_size
        return torch.tensor(rows, dtype=torch.float32).view(len(ids), hidden)

    def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.engine_error is not None:
            super()._process_outputs(outputs)
            return
        for out in outputs.outputs:
            future = self._waiters.pop(out.request_id, None)
            if future is None or future.done():
                continue
            if out.pooled is not None:
                future.set_result(out.pooled)
            else:
                future.set_exception(RuntimeError(str(out.stop_reason)))

    def _fail_all(self, error: str) -> None:
        super()._fail_all(error)
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(EngineDeadError(error))

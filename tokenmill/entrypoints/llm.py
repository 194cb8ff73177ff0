"""LLM: the offline Python API (``LLM(model=...).generate(prompts, params)``), as vLLM's."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from tokenmill.engine.embedding_engine import EmbeddingEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine_args import EngineArgs
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.media import split_chat_images
from tokenmill.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    EmbeddingRequestOutput,
    RequestOutput,
)
from tokenmill.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from tokenmill.tokenizer import encode_prompt, load_chat_template, render_chat_template

# vLLM keyword names that map onto a differently named EngineArgs field.
_KWARG_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}

PromptInput = str | list[int] | dict[str, Any]


class LLM:
    """An engine for offline batched generation, or embedding with an embedding model.

    An embedding (pooling) model, e.g. a BERT sentence encoder, gets the embedding engine:
    ``embed`` works and ``generate``/``chat`` raise; a generative model the reverse.

    Args:
        model: a model folder or ``.gguf`` file (default: the embedded SmolLM2-135M-Instruct).
        **kwargs: any EngineArgs field, by its vLLM name (``dtype``, ``max_model_len``,
            ``kv_cache_memory``, ``max_num_seqs``, ``enable_prefix_caching``,
            ``pooler_config``, ...).

    Raises:
        TypeError: an unknown keyword argument.
        ConfigError, ModelLoadError: invalid settings or an unreadable model.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        fields = {f.name for f in dataclasses.fields(EngineArgs)}
        args: dict[str, Any] = {}
        for key, value in kwargs.items():
            key = _KWARG_ALIASES.get(key, key)
            if key not in fields:
                raise TypeError(f"LLM() got an unexpected keyword argument {key!r}")
            args[key] = value
        self.engine_args = EngineArgs(model=model, **args)
        config = self.engine_args.create_engine_config("llm")
        self.model_config = config.model_config
        self.llm_engine: LLMEngine | None = None
        self.embedding_engine: EmbeddingEngine | None = None
        if config.model_config.is_pooling_model:
            self.embedding_engine = EmbeddingEngine(config)
        else:
            self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()

    def get_tokenizer(self):
        engine = self.embedding_engine or self.llm_engine
        assert engine is not None
        return engine.get_tokenizer()

    def _generation_engine(self) -> LLMEngine:
        if self.llm_engine is None:
            raise ValueError(
                f"{self.model_config.model} ({self.model_config.architecture}) is an embedding "
                "model: it cannot generate text; use LLM.embed"
            )
        return self.llm_engine

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
        use_tqdm: bool = True,  # noqa: ARG002 (vLLM's signature; one call needs no bar)
    ) -> list[EmbeddingRequestOutput]:
        """Embed ``prompts`` with an embedding model; one output per prompt, in order.

        ``out.outputs.embedding`` is the pooled vector (``list[float]``, L2-normalized when
        the model's pooling says so), ``out.prompt_token_ids`` the input's tokens.

        Args:
            prompts: a prompt or a list of prompts: text, token ids, or
                ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``.
            truncate_prompt_tokens: cut inputs to this many tokens (-1: the model's maximum
                input length); None: longer inputs raise.
            dimensions: shorten embeddings to this size (Matryoshka models only).

        Raises:
            ValueError: the model is not an embedding model, or an input is empty, longer
                than the model's maximum or has token ids outside the vocabulary (nothing
                is run then).
        """
        if self.embedding_engine is None:
            raise ValueError(
                f"{self.model_config.model} ({self.model_config.architecture}) is not an "
                "embedding model: LLM.embed needs one (e.g. a BERT sentence encoder)"
            )
        return self.embedding_engine.embed(
            self._as_prompt_list(prompts), truncate_prompt_tokens, dimensions
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """Sampling defaults from the model's generation_config.json (as vLLM)."""
        return self._generation_engine().input_processor.default_sampling_params()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts``; returns one RequestOutput per prompt, in order.

        Args:
            prompts: a prompt or a list of prompts: text, token ids, or
                ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``.
            sampling_params: one for all prompts, or one per prompt (default: the model's
                generation defaults).
            use_tqdm: show a progress bar with input/output token throughput.
            priority: per-prompt priority (``--scheduling-policy priority``).
            lora_request: the LoRA adapter for all prompts, or one per prompt (None: the
                base model); needs ``enable_lora=True``.

        Raises:
            ValueError: mismatched list lengths, an invalid prompt or an adapter that
                cannot be served (nothing is run then).
        """
        engine = self._generation_engine()
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"{len(prompt_list)} prompts but {len(params_list)} sampling params"
                )
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(priority)} priorities")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = [] if isinstance(lora_request, (str, bytes)) else list(lora_request)
            if not all(r is None or isinstance(r, LoRARequest) for r in loras) or not loras:
                raise ValueError(
                    "lora_request must be a LoRARequest, None or a list of them (one per "
                    f"prompt), got {type(lora_request).__name__}"
                )
            if len(loras) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(loras)} LoRA requests")
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=False)):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._counter))
                engine.add_request(
                    request_id, prompt, params, priority=priority[i] if priority else 0,
                    lora_request=loras[i],
                )  # fmt: skip
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's ``LLM.beam_search``); the prompts run
        together, their beams sharing KV blocks (see ``tokenmill.core.beam_group``).

        Args:
            prompts: a prompt or a list of prompts: text, token ids, or
                ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``.
            params: the beam width, length and scoring (``BeamSearchParams``).
            lora_request: accepted in vLLM's position; must be None (beam search does not combine
                with LoRA adapters yet).
            use_tqdm: show a progress bar.
            concurrency_limit: the most prompts searched at once (None: all of them);
                the others wait for a group to finish, as in vLLM.

        Returns:
            One BeamSearchOutput per prompt, in order: its ``params.beam_width`` best beams,
            best first. As in vLLM, ``.tokens`` holds the prompt's tokens and the beam's,
            and ``.text`` decodes them all (prompt and special tokens included).

        Raises:
            ValueError: an invalid prompt or parameter, a LoRA request or a
                ``concurrency_limit`` below 1 (nothing is run then).
        """
        engine = self._generation_engine()
        if lora_request is not None:
            raise ValueError(
                "beam_search: LoRA adapters are not implemented with beam search (lora_request)"
            )
        prompt_list = self._as_prompt_list(prompts)
        limit = max(1, len(prompt_list)) if concurrency_limit is None else concurrency_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"concurrency_limit must be a positive integer, got {limit!r}")
        if limit < len(prompt_list):
            for prompt in prompt_list:  # every prompt is checked before any runs
                engine.input_processor.process("check", prompt, params, validate_max_tokens=False)
        outputs: list[BeamSearchOutput] = []
        for start in range(0, len(prompt_list), limit):
            outputs += self._beam_search_group(prompt_list[start : start + limit], params, use_tqdm)
        return outputs

    def _beam_search_group(
        self, prompt_list: list[PromptInput], params: BeamSearchParams, use_tqdm: bool
    ) -> list[BeamSearchOutput]:
        engine = self._generation_engine()
        ids = []
        try:
            for prompt in prompt_list:
                request_id = str(next(self._counter))
                engine.add_request(request_id, prompt, params)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise
        tokenizer = self.get_tokenizer()
        outputs = []
        for out in self._run_engine(ids, use_tqdm):
            sequences = []
            for c in out.outputs:
                tokens = list(out.prompt_token_ids) + c.token_ids
                sequences.append(
                    BeamSearchSequence(
                        tokens=tokens,
                        cum_logprob=c.cumulative_logprob or 0.0,
                        text=tokenizer.decode(tokens),
                        finish_reason=c.finish_reason,
                        score=(c.cumulative_logprob or 0.0)
                        / max(1, len(c.token_ids)) ** params.length_penalty,
                    )
                )
            outputs.append(BeamSearchOutput(sequences))
        return outputs

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the chat template.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]`` or a list of such lists; a
                content list may hold ``{"type": "image_url", "image_url": {"url": ...}}``
                and ``{"type": "image_pil", "image_pil": PIL.Image}`` parts (models that
                take images).
            chat_template: a template (text or file path) replacing the model's own.
            lora_request: as ``generate``'s.

        Raises:
            ChatTemplateError: the model has no chat template and none was given.
            MediaError: an image that cannot be loaded.
        """
        engine = self._generation_engine()
        mm_config = engine.config.model_config.multimodal_config
        domains = mm_config.allowed_media_domains if mm_config else ()
        local_root = mm_config.allowed_local_media_path if mm_config else None
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        template = load_chat_template(chat_template) if chat_template else None
        tokenizer = self.get_tokenizer()
        prompts: list[PromptInput] = []
        for conv in conversations:  # type: ignore[union-attr]
            conv, images = split_chat_images(conv, domains, local_root)
            # The rendered text rides along, so outputs carry it as ``prompt`` (as vLLM's).
            text = render_chat_template(tokenizer, conv, template, add_generation_prompt)
            ids = encode_prompt(tokenizer, text, add_special_tokens=False)
            prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def reset_prefix_cache(self) -> bool:
        return self._generation_engine().reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the engine's memory (``LLM(..., enable_sleep_mode=True)``): level 1 keeps the
        weights in host memory (a temporary file on CPU), level 2 drops them; the KV cache
        is freed either way. ``generate`` raises until ``wake_up``.

        Raises:
            ValueError: sleep mode is off, or a level other than 1 or 2.
        """
        self._generation_engine().sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and the KV cache, or only those named in ``tags``
        (``["weights"]``, ``["kv_cache"]``). Weights dropped at level 2 are read again from
        the model's checkpoint unless ``update_weights`` loaded others.

        Raises:
            ValueError: an unknown tag.
        """
        self._generation_engine().wake_up(tags)

    def update_weights(self, path: str) -> None:
        """Load new weights into the running engine, in place: a model folder or a
        ``.safetensors`` file holding every parameter, or a ``.gguf`` file. The prefix cache
        is emptied, so later requests read only KV of the new weights.

        Raises:
            ValueError: the weights are asleep (``wake_up(["weights"])`` first).
            ModelLoadError: the checkpoint cannot be read or does not fit the model.
        """
        self._generation_engine().update_weights(path)

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list[PromptInput]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self._generation_engine()
        results: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            dynamic_ncols=True,
            disable=not use_tqdm,
        )
        start = time.perf_counter()
        prompt_tokens = output_tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
            stats = engine.last_iteration_stats
            if stats is not None:
                prompt_tokens += stats.num_prompt_tokens
                output_tokens += stats.num_generation_tokens
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(
                    f"est. speed input: {prompt_tokens / elapsed:.2f} toks/s, "
                    f"output: {output_tokens / elapsed:.2f} toks/s",
                    refresh=False,
                )
        bar.close()
        return [results[i] for i in request_ids]

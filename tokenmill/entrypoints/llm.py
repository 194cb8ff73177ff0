"""LLM: the offline Python API (``LLM(model=...).generate(prompts, params)``), as vLLM's."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine_args import EngineArgs
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.tokenizer import apply_chat_template, load_chat_template

# vLLM keyword names that map onto a differently named EngineArgs field.
_KWARG_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}

PromptInput = str | list[int] | dict[str, Any]


class LLM:
    """An engine for offline batched generation.

    Args:
        model: a model folder or ``.gguf`` file (default: the embedded SmolLM2-135M-Instruct).
        **kwargs: any EngineArgs field, by its vLLM name (``dtype``, ``max_model_len``,
            ``kv_cache_memory``, ``max_num_seqs``, ``enable_prefix_caching``, ...).

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
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args, usage_context="llm")
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """Sampling defaults from the model's generation_config.json (as vLLM)."""
        return self.llm_engine.input_processor.default_sampling_params()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts``; returns one RequestOutput per prompt, in order.

        Args:
            prompts: a prompt or a list of prompts: text, token ids, or
                ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``.
            sampling_params: one for all prompts, or one per prompt (default: the model's
                generation defaults).
            use_tqdm: show a progress bar with input/output token throughput.
            priority: per-prompt priority (``--scheduling-policy priority``).

        Raises:
            ValueError: mismatched list lengths, or an invalid prompt (nothing is run then).
        """
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
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._counter))
                self.llm_engine.add_request(
                    request_id, prompt, params, priority=priority[i] if priority else 0
                )
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the chat template.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]`` or a list of such lists.
            chat_template: a template (text or file path) replacing the model's own.

        Raises:
            ChatTemplateError: the model has no chat template and none was given.
        """
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        template = load_chat_template(chat_template) if chat_template else None
        tokenizer = self.get_tokenizer()
        prompts: list[PromptInput] = [
            {
                "prompt_token_ids": apply_chat_template(
                    tokenizer, conv, chat_template=template,
                    add_generation_prompt=add_generation_prompt,
                )
            }
            for conv in conversations  # type: ignore[union-attr]
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list[PromptInput]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm)
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

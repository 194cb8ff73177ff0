"""Structured outputs at run time: grammar worker processes and each request's matcher.

xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation Engine
for Large Language Models", arXiv:2411.15100) compiles a JSON schema, a regular expression or
an EBNF grammar against the tokenizer's vocabulary; a matcher then gives, token by token, the
bitmask of the tokens the grammar allows next.

Compiles and mask fills can take seconds for an ambiguous pattern and cannot be interrupted,
so both run in worker processes (``serve_grammars``) that the engine kills past a time limit
(``core/grammar_workers.py``). A compile worker returns the compiled grammar (serialized) and
its first mask; the engine keeps a matcher of its own per request (``RequestGrammar``), which
accepts each sampled token and says when the grammar is complete (cheap: well under a
millisecond a token), and a mask worker keeps a copy of that matcher to fill the request's
masks (``core/grammar_masks.py``), told the tokens accepted since its last fill. A
constraint that applies after a reasoning section wraps that matcher in an
``AfterReasoningGrammar`` (``structured_output_gate.py``): all-ones masks until the
reasoning's end marker, without a worker.

Such requests run synchronous steps (``SamplingParams.uses_full_sampler``): the bitmask of a
step depends on the token sampled by the step before.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import xgrammar  # noqa: F401 - imported once by the workers' fork server

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output import (
    GRAMMAR_CACHE_BYTES,
    compile_failure_reason,
    constraint_source,
    xgrammar_module,
)
from tokenmill.structured_output_gate import AfterReasoningGrammar

logger = logging.getLogger(__name__)

# What a compile worker is given: (xgrammar kind: json, regex or ebnf; its text; whether
# JSON may hold any whitespace). Also the key of the engine's compiled-grammar cache.
CompileKey = tuple[str, str, bool]


def compile_key(params: StructuredOutputsParams) -> CompileKey:
    kind, spec = constraint_source(params)
    return kind, spec, not params.disable_any_whitespace


class GrammarBackend:
    """The engine's side of grammar work for one tokenizer: what workers are started with,
    and the grammars compiled so far (an LRU of ``GRAMMAR_CACHE_BYTES``).

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: the model's vocabulary (logit columns), at least the tokenizer's.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = xgrammar_module()
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.worker_args = (self._info.serialize_json(), vocab_size)
        self._cache: OrderedDict[CompileKey, tuple[Any, str, np.ndarray, int]] = OrderedDict()
        self._cache_bytes = 0

    def cached(
        self, key: CompileKey, reasoning_end_token_ids: list[int] | None = None
    ) -> RequestGrammar | AfterReasoningGrammar | None:
        """A fresh grammar for ``key`` if it was compiled before, else None.

        Args:
            key: the constraint's ``compile_key``.
            reasoning_end_token_ids: the request's ``StructuredOutputsParams`` field: given,
                the grammar applies from the token after them (``AfterReasoningGrammar``).
        """
        entry = self._cache.get(key)
        if entry is None:
            return None
        self._cache.move_to_end(key)
        compiled, text, first_mask, _ = entry
        grammar = RequestGrammar(compiled, text, first_mask.copy())
        if reasoning_end_token_ids:
            return AfterReasoningGrammar(grammar, reasoning_end_token_ids, self.vocab_size)
        return grammar

    def key(self, params: StructuredOutputsParams) -> CompileKey:
        return compile_key(params)

    def store(self, key: CompileKey, text: str, first_mask: np.ndarray) -> None:
        """Keep the grammar a compile worker returned (``text``: the compiled grammar,
        serialized; ``first_mask``: its start's token mask) for ``cached``."""
        if key in self._cache:
            return
        compiled = xgrammar_module().CompiledGrammar.deserialize_json(text, self._info)
        size = int(compiled.memory_size_bytes) + len(text)
        self._cache[key] = (compiled, text, first_mask, size)
        self._cache_bytes += size
        while self._cache_bytes > GRAMMAR_CACHE_BYTES and len(self._cache) > 1:
            _, (_, _, _, dropped) = self._cache.popitem(last=False)
            self._cache_bytes -= dropped


class RequestGrammar:
    """One request's position in its grammar, in the engine.

    Args:
        compiled: an xgrammar ``CompiledGrammar``.
        text: the same, serialized (to give a mask worker its copy).
        first_mask: the ``[ceil(V / 32)]`` int32 mask of the grammar's start.

    Attributes:
        text: as given.
        accepted: every token the grammar has accepted, in order.
        failure: why the engine gave the grammar up (``fail``), or None.
    """

    def __init__(self, compiled: Any, text: str, first_mask: np.ndarray) -> None:
        self._matcher = xgrammar_module().GrammarMatcher(compiled)
        self.text = text
        self._first_mask: np.ndarray | None = first_mask
        self.accepted: list[int] = []
        self.failure: str | None = None

    def fail(self, reason: str) -> None:
        """Give the grammar up: its request finishes aborted with ``reason``."""
        self.failure = reason

    def take_first_mask(self) -> np.ndarray | None:
        """The grammar's first mask, once, if no token was accepted yet (else None)."""
        mask, self._first_mask = self._first_mask, None
        return mask

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it, or was given
        up (the request then cannot go on)."""
        if self.failure is not None:
            return False
        self._first_mask = None
        if not self._matcher.accept_token(token_id):
            return False
        self.accepted.append(token_id)
        return True

    @property
    def is_complete(self) -> bool:
        """True once the output is a whole sentence of the grammar and it was ended (the
        stop token accepted, or nothing can follow)."""
        return self.failure is None and bool(self._matcher.is_terminated())


# ---- the worker process --------------------------------------------------------------------


def serve_grammars(conn: Connection, tokenizer_info: str, vocab_size: int) -> None:
    """A grammar worker's loop (``core/grammar_workers.py``): answers the engine's messages
    until the pipe closes or None arrives.

    Messages and answers:
        ``("compile", job, kind, text, any_whitespace)``: ``("compiled", job, serialized,
        first_mask, mask_cpu_s)`` or ``("error", job, reason)``.
        ``("register", req_id, serialized)``: keep a matcher for ``req_id``:
        ``("registered", req_id)`` (its time does not count against a mask's bound).
        ``("fill", [(req_id, new_tokens), ...])``: for each in order, accept its new tokens
        and fill its mask: ``("mask", req_id, mask, cpu_s)`` or ``("mask_error", req_id,
        reason)``.
        ``("drop", [req_id, ...])``: forget those matchers (no answer).
    """
    xgr = xgrammar_module()
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info)
    # One thread: a compile takes one core, so the number of workers bounds their CPU.
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matchers: dict[str, Any] = {}

    def fill(matcher: Any) -> tuple[np.ndarray, float]:
        start = time.thread_time()
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask[0].numpy().copy(), time.thread_time() - start

    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        op = message[0]
        if op == "compile":
            _, job, kind, text, any_whitespace = message
            try:
                compiled = _compile(compiler, kind, text, any_whitespace)
                mask, cpu_s = fill(xgr.GrammarMatcher(compiled))
                conn.send(("compiled", job, compiled.serialize_json(), mask, cpu_s))
            except Exception as e:  # the request fails, not the worker
                conn.send(("error", job, compile_failure_reason(e)))
        elif op == "register":
            _, req_id, text = message
            compiled = xgr.CompiledGrammar.deserialize_json(text, info)
            matchers[req_id] = xgr.GrammarMatcher(compiled)
            conn.send(("registered", req_id))
        elif op == "fill":
            for req_id, tokens in message[1]:
                conn.send(_fill_one(matchers.get(req_id), req_id, tokens, fill))
        elif op == "drop":
            for req_id in message[1]:
                matchers.pop(req_id, None)


def _compile(compiler: Any, kind: str, text: str, any_whitespace: bool) -> Any:
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


def _fill_one(matcher: Any, req_id: str, tokens: list[int], fill: Any) -> tuple:
    """One request's answer to a ``fill`` message."""
    if matcher is None:
        return ("mask_error", req_id, "the grammar worker lost the request's matcher")
    try:
        for token in tokens:
            if not matcher.accept_token(token):
                return ("mask_error", req_id, f"the grammar worker's copy refused token {token}")
        mask, cpu_s = fill(matcher)
    except Exception as e:  # the request fails, not the worker
        return ("mask_error", req_id, str(e))
    return ("mask", req_id, mask, cpu_s)

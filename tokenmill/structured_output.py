"""Structured outputs: grammars compiled by xgrammar, and each request's matcher.

xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation Engine
for Large Language Models", arXiv:2411.15100) compiles a JSON schema, a regular expression
or an EBNF grammar against the tokenizer's vocabulary; a matcher then gives, token by token,
the bitmask of the tokens the grammar allows next. The engine core keeps one matcher per
request: it fills the request's bitmask before each step that samples it (the sampler
masks the other tokens) and feeds the sampled token back; the request finishes when the
grammar is complete.

Such requests run synchronous steps (``SamplingParams.uses_full_sampler``): the bitmask of a
step depends on the token sampled by the step before.
"""

from __future__ import annotations

import json
import logging
import threading
from functools import lru_cache
from typing import Any

import numpy as np

from tokenmill.sampling_params import SamplingParamsError, StructuredOutputsParams

logger = logging.getLogger(__name__)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pinned in pyproject.toml; a broken install says so
        raise SamplingParamsError(
            "structured outputs need the xgrammar package, which is not installed.",
            "structured_outputs",
        ) from e
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (JSON string escapes are valid
    in its string literals)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _source(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind xgrammar compiles: json, regex or ebnf; its text)."""
    kind, spec = params.kind_and_spec()
    if kind == "choice":
        return "ebnf", choice_grammar(params.choice or [])
    if kind == "grammar":
        return "ebnf", spec
    if kind == "json_object":
        # OpenAI's JSON mode: an object (xgrammar's built-in JSON grammar takes any value).
        return "json", '{"type": "object"}'
    return kind, spec


@lru_cache(maxsize=256)
def _check_source(kind: str, spec: str) -> None:
    xgr = _xgrammar()
    if kind == "json":
        xgr.Grammar.from_json_schema(spec)
    elif kind == "regex":
        xgr.Grammar.from_regex(spec)
    else:
        xgr.Grammar.from_ebnf(spec)


def validate(params: StructuredOutputsParams) -> None:
    """Check that the constraint compiles (no tokenizer needed; cached by its text).

    Raises:
        SamplingParamsError: an invalid JSON schema, regular expression or grammar (the
            message gives xgrammar's reason).
    """
    kind, spec = _source(params)
    try:
        _check_source(kind, spec)
    except SamplingParamsError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with its reason
        name = {"json": "JSON schema", "regex": "regular expression", "ebnf": "grammar"}
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SamplingParamsError(
            f"structured_outputs: invalid {name.get(kind, kind)}: {reason}",
            "structured_outputs",
        ) from None


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary size (compiled grammars are
    cached by xgrammar, keyed by their text).

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: the model's vocabulary (logit columns), at least the tokenizer's.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self._info)
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for ``params``.

        Raises:
            SamplingParamsError: the constraint does not compile.
        """
        kind, spec = _source(params)
        try:
            with self._lock:
                if kind == "json":
                    compiled = self._compiler.compile_json_schema(spec)
                elif kind == "regex":
                    compiled = self._compiler.compile_regex(spec)
                else:
                    compiled = self._compiler.compile_grammar(spec)
        except Exception as e:
            raise SamplingParamsError(
                f"structured_outputs: the constraint does not compile: {e}",
                "structured_outputs",
            ) from None
        return RequestGrammar(compiled, self.vocab_size)


class RequestGrammar:
    """One request's position in its grammar.

    Args:
        compiled: an xgrammar ``CompiledGrammar``.
        vocab_size: logit columns.
    """

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def token_bitmask(self) -> np.ndarray:
        """``[ceil(V / 32)]`` int32: bit ``t % 32`` of word ``t // 32`` set where token
        ``t`` may come next (a copy)."""
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask[0].numpy().copy()

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the request
        then cannot go on)."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_complete(self) -> bool:
        """True once the output is a whole sentence of the grammar and it was ended (the
        stop token accepted, or nothing can follow)."""
        return bool(self._matcher.is_terminated())

"""SamplingParams: how one request is decoded, validated on construction.

Field names, meanings and defaults follow vLLM's ``SamplingParams`` (and so the OpenAI API
fields they come from), so code written against vLLM keeps working.
"""

from __future__ import annotations

import copy
import enum
import json as json_module
import math
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are greedy decoding (vLLM uses the same epsilon).
SAMPLING_EPS = 1e-5
# The range of int64, the type the engine's messages carry seeds and priorities in.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_INT32_MAX = 2**31 - 1
_FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty",
)  # fmt: skip
_INT_FIELDS = ("n", "best_of", "top_k", "max_tokens", "min_tokens", "logprobs",
               "prompt_logprobs", "seed")  # fmt: skip


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_unicode(text: str) -> bool:
    """False for text that cannot be encoded (lone surrogates, e.g. from JSON's \\ud800)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


MAX_LOGPROBS_DEFAULT = 20
# The most sequences one request may ask for (n, best_of): OpenAI's limit on ``n``. Each
# copy is a request of its own; an unbounded count would let one request exhaust memory.
MAX_N = 128
# Most words in ``bad_words``, and most characters in all of them: each is tokenized (twice)
# on the server's event loop when the request arrives (~1.5 us per character, so the bound
# keeps that under ~0.1 s), and matched against the request's output at every step.
MAX_BAD_WORDS = 1024
MAX_BAD_WORDS_CHARS = 32768
# Most stop strings, and most characters in all of them: every step's new text is matched
# against each (~1 us per string per step on the event loop).
MAX_STOP_STRINGS = 1024
MAX_STOP_CHARS = 32768
_FLOAT32_MAX = 3.4028234663852886e38


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries."""

    CUMULATIVE = 0  # all text and tokens so far
    DELTA = 1  # only what is new since the last output (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes (offline generate)


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range. ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# Fields whose defaults may come from the model's generation_config.json (as in vLLM).
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass
class StructuredOutputsParams:
    """A constraint on the output's form (vLLM's ``StructuredOutputsParams``): exactly one of
    the fields. The sampler then only draws tokens the grammar allows, and the request
    finishes when the grammar is complete (xgrammar: Dong et al. 2024, arXiv:2411.15100).

    Args:
        json: a JSON schema (dict or its JSON text) the output must satisfy.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (GBNF, llama.cpp's dialect) with a ``root`` rule.
        json_object: any JSON object (OpenAI's ``response_format: json_object``).
        disable_any_whitespace: JSON without whitespace between its tokens (by default any
            whitespace may appear there, as JSON allows).
        reasoning_end_token_ids: the token ids that end a reasoning section (``</think>``):
            the constraint applies to the output after their first appearance, and any token
            may come before it. None: from the first token.

    Raises:
        SamplingParamsError: not exactly one field given, or a field of the wrong type.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    reasoning_end_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs takes exactly one of json, regex, choice, grammar and "
                f"json_object; got {given or 'none'}.",
                "structured_outputs",
            )
        if isinstance(self.json, dict | bool):  # a schema may be true or false
            self.json = json_module.dumps(self.json)
        ok = {
            "json": isinstance(self.json, str),
            "regex": isinstance(self.regex, str),
            "grammar": isinstance(self.grammar, str),
            "choice": isinstance(self.choice, list)
            and len(self.choice) > 0
            and all(isinstance(c, str) for c in self.choice),
            "json_object": self.json_object is True,
        }
        ids = self.reasoning_end_token_ids
        if ids is not None and not (
            isinstance(ids, list) and ids and all(_is_int(t) and t >= 0 for t in ids)
        ):
            raise SamplingParamsError(
                "structured_outputs.reasoning_end_token_ids must be a non-empty list of token ids.",
                "structured_outputs",
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise SamplingParamsError(
                "structured_outputs.disable_any_whitespace must be true or false.",
                "structured_outputs",
            )
        if not ok[given[0]]:
            raise SamplingParamsError(
                f"structured_outputs.{given[0]} has the wrong type: json takes a schema "
                "(object or text), regex and grammar a string, choice a non-empty list of "
                "strings, json_object true.",
                "structured_outputs",
            )


@dataclass
class SamplingParams:
    """Sampling parameters of one request.

    Args:
        n: number of output sequences returned for the prompt, at most ``MAX_N``.
        best_of: number of sequences generated, of which the ``n`` with the highest
            cumulative log-probability are returned (default ``n``; at most ``MAX_N``).
        presence_penalty: subtracted once from the logit of every token already
            generated (OpenAI semantics), in [-2, 2].
        frequency_penalty: subtracted from a token's logit once per earlier occurrence in
            the output, in [-2, 2].
        repetition_penalty: CTRL-style penalty (Keskar et al. 2019) on tokens of the
            prompt and output: positive logits divided by it, negative ones multiplied; > 0,
            1 disables it.
        temperature: logits are divided by it; 0 means greedy.
        top_p: nucleus sampling (Holtzman et al. 2019), in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the top one's, in [0, 1].
        seed: per-request random seed: the same seed and prompt give the same tokens.
        stop: strings that end generation when they appear in the output text; removed
            from the output unless ``include_stop_str_in_output``.
        stop_token_ids: token ids that end generation (kept in the token ids, not in text).
        ignore_eos: keep generating past the end-of-sequence token.
        max_tokens: most tokens to generate (None: up to the context length).
        min_tokens: fewest tokens to generate before EOS or stop tokens may end the output.
        logprobs: number of top log-probabilities returned per output token (plus the
            sampled token's); -1 means the whole vocabulary.
        prompt_logprobs: the same for each prompt token (after the first).
        detokenize: produce text (False returns token ids only).
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: kept for vLLM compatibility; the tokenizer decides.
        include_stop_str_in_output: keep the matched stop string in the text.
        logit_bias: token id -> value added to that token's logit (OpenAI, [-100, 100]).
        allowed_token_ids: if given, only these tokens can be sampled.
        bad_words: words that may not be generated: the token that would complete one is
            never sampled (each word as tokenized alone and after a space; the engine fills
            ``bad_words_token_ids``).
        structured_outputs: a constraint on the output's form (JSON schema, regex, choice,
            grammar); see ``StructuredOutputsParams``.
        truncate_prompt_tokens: keep only the prompt's last this many tokens (vLLM's left
            truncation); -1 keeps as many as leave room for ``max_tokens`` (or for one
            token when it is None). At most the context length minus one.
        output_kind: what each RequestOutput carries (see RequestOutputKind).

    Raises:
        SamplingParamsError: a field is out of its range (the message names the field).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine from the model (eos ids, bad words' token ids); not set by users.
    eos_token_ids: list[int] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown key
                raise SamplingParamsError(
                    f"structured_outputs: {e}", "structured_outputs"
                ) from None
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.output_kind = RequestOutputKind(self.output_kind)
        self._verify()
        if self.top_k > _INT32_MAX:
            self.top_k = 0  # more than any vocabulary: no truncation, as vLLM treats it
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation filters cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise SamplingParamsError(message, param)

        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            check(
                _is_real(value) and math.isfinite(value) and abs(value) <= _FLOAT32_MAX,
                name,
                f"{name} must be a finite number (float32), got {value!r}.",
            )
        for name in _INT_FIELDS:
            value = getattr(self, name)
            check(
                value is None or _is_int(value),
                name,
                f"{name} must be an integer, got {value!r}.",
            )
        check(1 <= self.n <= MAX_N, "n", f"n must be in [1, {MAX_N}], got {self.n}.")
        check(
            isinstance(self.best_of, int) and self.n <= self.best_of <= MAX_N,
            "best_of",
            f"best_of must be in [n, {MAX_N}], got n={self.n} and best_of={self.best_of}.",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}.")
        check(
            # float32 (the sampler's precision) must not round it to zero
            self.repetition_penalty >= _FLOAT32_TINY,
            "repetition_penalty",
            f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
        )
        check(
            self.temperature >= 0.0,
            "temperature",
            f"temperature must be non-negative, got {self.temperature}.",
        )
        check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        check(
            self.top_k >= 0 or self.top_k == -1,
            "top_k",
            f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.",
        )
        check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}.",
        )
        check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
        )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
            f"got {self.min_tokens}.",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None or (isinstance(value, int) and value >= -1),
                name,
                f"{name} must be non-negative or -1 (whole vocabulary), got {value}.",
            )
        check(
            all(isinstance(s, str) and s and _is_unicode(s) for s in self.stop),
            "stop",
            "stop strings must be non-empty strings of valid Unicode (no lone surrogates).",
        )
        num_stop_chars = sum(map(len, self.stop))
        check(
            len(self.stop) <= MAX_STOP_STRINGS and num_stop_chars <= MAX_STOP_CHARS,
            "stop",
            f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
            f"characters in all, got {len(self.stop)} of {num_stop_chars}.",
        )
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "stop_token_ids must be non-negative integers.",
        )
        if self.logit_bias:
            bad = {k: v for k, v in self.logit_bias.items() if not -100.0 <= v <= 100.0}
            check(not bad, "logit_bias", f"logit_bias values must be in [-100, 100], got {bad}.")
        if self.allowed_token_ids is not None:
            check(
                len(self.allowed_token_ids) > 0,
                "allowed_token_ids",
                "allowed_token_ids must not be empty.",
            )
        if self.bad_words is not None:
            check(
                isinstance(self.bad_words, list) and len(self.bad_words) <= MAX_BAD_WORDS,
                "bad_words",
                f"bad_words must be a list of at most {MAX_BAD_WORDS} words.",
            )
            check(
                isinstance(self.bad_words, list)
                and all(
                    isinstance(w, str) and w.strip() and _is_unicode(w) for w in self.bad_words
                ),
                "bad_words",
                "bad_words must be a list of non-blank strings of valid Unicode.",
            )
            num_chars = sum(map(len, self.bad_words))
            check(
                num_chars <= MAX_BAD_WORDS_CHARS,
                "bad_words",
                f"bad_words may hold at most {MAX_BAD_WORDS_CHARS} characters in all, got "
                f"{num_chars}.",
            )
        k = self.truncate_prompt_tokens
        check(
            k is None or (_is_int(k) and (k == -1 or k >= 1)),
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens must be -1 or at least 1, got {k!r}.",
        )
        check(
            self.seed is None or INT64_MIN <= self.seed <= INT64_MAX - (self.best_of - 1),
            "seed",
            f"seed must be a 64-bit signed integer (with room for seed + n - 1), "
            f"got {self.seed!r}.",
        )

    def verify_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Check the fields that depend on the model.

        Raises:
            SamplingParamsError: a token id is outside ``[0, vocab_size)`` or more
                logprobs are asked for than the engine allows (``--max-logprobs``).
        """
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise SamplingParamsError(
                    f"Requested {name}={value} but at most {max_logprobs} are allowed "
                    f"(--max-logprobs).",
                    name,
                )
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", self.logit_bias),
            ("allowed_token_ids", self.allowed_token_ids),
            ("bad_words", [t for word in self.bad_words_token_ids or () for t in word]),
        ):
            bad = [t for t in ids or () if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamsError(
                    f"{name}: token ids {bad[:5]} are out of the vocabulary range "
                    f"[0, {vocab_size}).",
                    name,
                )

    @property
    def sampling_type_greedy(self) -> bool:
        """True when decoding is deterministic argmax."""
        return self.temperature < SAMPLING_EPS

    @property
    def uses_full_sampler(self) -> bool:
        """True if decoding needs the token history or logprobs on the host: penalties,
        logit bias, allowed tokens, bad words, structured outputs, min_tokens, a seed,
        logprobs or prompt logprobs. Plain
        temperature/top-k/top-p/min-p sampling does not (the fast path)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words
            or self.structured_outputs is not None
            or self.min_tokens
            or self.seed is not None
            or self.logprobs is not None
            or self.prompt_logprobs is not None
        )

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Token ids that end the output: stop_token_ids plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids or [])
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return ids

    def clone(self) -> SamplingParams:
        """A deep copy (requests must not share mutable lists)."""
        return copy.deepcopy(self)

    @classmethod
    def from_generation_config(
        cls, generation_config: dict[str, Any], **overrides: Any
    ) -> SamplingParams:
        """SamplingParams whose defaults come from a model's generation_config.json.

        Only the fields vLLM takes from it are used (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens -> max_tokens); ``overrides`` win over them.
        """
        kwargs: dict[str, Any] = {}
        for src, dst in GENERATION_CONFIG_FIELDS.items():
            if generation_config.get(src) is not None:
                kwargs[dst] = generation_config[src]
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kwargs)

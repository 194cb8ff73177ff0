"""Benchmark workloads: random token prompts, ShareGPT conversations, repeated prefixes.

Flags and meanings follow ``vllm bench``'s datasets, so a command line moves between the two
engines unchanged:

- ``random``: prompts of random token ids. Input lengths are drawn uniformly from
  ``[floor(L * (1 - r)), ceil(L * (1 + r))]`` for ``--random-input-len L`` and
  ``--random-range-ratio r`` (output lengths likewise); ``--random-prefix-len`` tokens shared
  by every prompt are put in front.
- ``sharegpt``: the first human turn of each conversation of a local ShareGPT JSON file is
  the prompt; the first reply's token count is the output length (or
  ``--sharegpt-output-len``).
- ``prefix_repetition``: ``--prefix-repetition-num-prefixes`` random prefixes, each shared by
  an equal share of the prompts, followed by a random suffix per prompt (prefix-cache tests).

Lengths are exact for the given tokenizer. Offline benchmarks use the token ids directly. For
HTTP endpoints, which take text, a prompt's ids are decoded and the text is re-encoded; where
the round trip changes the count (tokens merge across a boundary, a partial UTF-8 character
decodes to U+FFFD) tokens are trimmed or appended until the text encodes to the target length.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.benchmarks.common import BenchmarkError
from tokenmill.benchmarks.mm_datasets import add_images, add_mm_dataset_args

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DATASET_NAMES = ("random", "sharegpt", "prefix_repetition", "random-mm")
# Tries at making a text encode to its target length; one or two suffice in practice.
_MAX_FIT_ROUNDS = 16
# ShareGPT conversations with fewer prompt or reply tokens than this are skipped: too short
# to say anything about throughput.
_MIN_SHAREGPT_TOKENS = 4


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request.

    Attributes:
        prompt_token_ids: the prompt's token ids (what the offline engine is given).
        prompt: the prompt's text (what an HTTP endpoint is sent), or None when only ids
            were asked for.
        prompt_len: prompt length in tokens (``len(prompt_token_ids)``).
        expected_output_len: tokens to generate (``max_tokens``).
        images: ``data:`` URLs of the request's images (``random-mm``), sent as chat
            ``image_url`` parts before the text.
    """

    prompt_token_ids: list[int]
    prompt: str | None
    prompt_len: int
    expected_output_len: int
    images: tuple[str, ...] = ()


# ---- CLI -------------------------------------------------------------------------------------


def add_dataset_args(parser: argparse.ArgumentParser, with_seed: bool = True) -> None:
    """The dataset flags of ``vllm bench`` (same names and defaults).

    Args:
        with_seed: add ``--seed`` (the offline benchmarks take it from the engine flags).
    """
    group = parser.add_argument_group("dataset")
    group.add_argument(
        "--dataset-name",
        default=None,
        choices=DATASET_NAMES,
        help="Workload to run. (default: sharegpt with --dataset-path, else random)",
    )
    group.add_argument(
        "--dataset-path", default=None, help="ShareGPT JSON file (read by sharegpt only)."
    )
    group.add_argument(
        "--num-prompts", type=int, default=1000, help="Requests to run. (default: 1000)"
    )
    if with_seed:
        group.add_argument("--seed", type=int, default=0, help="Seed of the workload. (default: 0)")
    group.add_argument(
        "--random-input-len",
        type=int,
        default=1024,
        help="Prompt tokens per request, after any prefix (random). (default: 1024)",
    )
    group.add_argument(
        "--random-output-len",
        type=int,
        default=128,
        help="Output tokens per request (random). (default: 128)",
    )
    group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Lengths are drawn uniformly from [L*(1-r), L*(1+r)] (random). (default: 0.0)",
    )
    group.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="Tokens of one random prefix shared by all prompts (random). (default: 0)",
    )
    group.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="Output tokens per request instead of the reply's length (sharegpt).",
    )
    group.add_argument(
        "--prefix-repetition-prefix-len",
        type=int,
        default=256,
        help="Tokens of each shared prefix (prefix_repetition). (default: 256)",
    )
    group.add_argument(
        "--prefix-repetition-suffix-len",
        type=int,
        default=256,
        help="Tokens of each prompt's own suffix (prefix_repetition). (default: 256)",
    )
    group.add_argument(
        "--prefix-repetition-num-prefixes",
        type=int,
        default=10,
        help="Distinct prefixes (prefix_repetition). (default: 10)",
    )
    group.add_argument(
        "--prefix-repetition-output-len",
        type=int,
        default=128,
        help="Output tokens per request (prefix_repetition). (default: 128)",
    )
    add_mm_dataset_args(group)
    group.add_argument(
        "--disable-shuffle",
        action="store_true",
        help="Keep the file's order of ShareGPT conversations.",
    )
    group.add_argument(
        "--no-oversample",
        action="store_true",
        help="Run fewer requests when the file has fewer usable conversations than "
        "--num-prompts (default: repeat conversations).",
    )


def check_dataset_flags(args: argparse.Namespace) -> str:
    """Check the dataset flags that need no tokenizer (so a benchmark can refuse them before
    it loads a model); returns the dataset's name.

    Raises:
        BenchmarkError: no prompts, a dataset file given to a dataset that reads none (or
            missing where one is needed), or the ``random`` dataset's lengths out of range.
    """
    if args.num_prompts < 1:
        raise BenchmarkError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    name = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
    if args.dataset_path and name != "sharegpt":
        raise BenchmarkError(
            f"--dataset-path is read by --dataset-name sharegpt only, not {name}: drop one"
        )
    if name == "sharegpt" and not args.dataset_path:
        raise BenchmarkError("--dataset-name sharegpt needs --dataset-path FILE.json")
    if name in ("random", "random-mm"):
        check_random_lengths(
            args.random_input_len, args.random_output_len, args.random_range_ratio,
            args.random_prefix_len,
        )  # fmt: skip
    return name


def check_random_lengths(
    input_len: int, output_len: int, range_ratio: float, prefix_len: int
) -> None:
    """The ``random`` dataset's lengths (tokens) and range ratio.

    Raises:
        BenchmarkError: a negative length, ``input_len + prefix_len < 1``,
            ``output_len < 1``, or ``range_ratio`` outside [0, 1).
    """
    if input_len < 0 or prefix_len < 0:
        raise BenchmarkError("--random-input-len and --random-prefix-len must be non-negative")
    if input_len + prefix_len < 1:
        raise BenchmarkError("a prompt needs at least one token (--random-input-len)")
    if output_len < 1:
        raise BenchmarkError(f"--random-output-len must be at least 1, got {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise BenchmarkError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")


def sample_requests(
    args: argparse.Namespace,
    tokenizer: PreTrainedTokenizerBase,
    need_text: bool,
    max_model_len: int | None = None,
) -> list[SampleRequest]:
    """The requests of the workload selected by the dataset flags.

    Args:
        args: parsed flags of :func:`add_dataset_args`.
        tokenizer: the served model's tokenizer (lengths are exact for it).
        need_text: also make each prompt's text (HTTP endpoints).
        max_model_len: ShareGPT conversations longer than this are skipped.

    Raises:
        BenchmarkError: invalid lengths or counts, or an unreadable dataset file.
    """
    name = check_dataset_flags(args)
    if name == "sharegpt":
        return sharegpt_requests(
            tokenizer,
            args.dataset_path,
            args.num_prompts,
            seed=args.seed,
            output_len=args.sharegpt_output_len,
            shuffle=not args.disable_shuffle,
            oversample=not args.no_oversample,
            max_model_len=max_model_len,
            need_text=need_text,
        )
    if name == "prefix_repetition":
        return prefix_repetition_requests(
            tokenizer,
            args.num_prompts,
            prefix_len=args.prefix_repetition_prefix_len,
            suffix_len=args.prefix_repetition_suffix_len,
            num_prefixes=args.prefix_repetition_num_prefixes,
            output_len=args.prefix_repetition_output_len,
            seed=args.seed,
            need_text=need_text,
        )
    if name == "random-mm" and not need_text:
        raise BenchmarkError("--dataset-name random-mm runs with bench serve only")
    samples = random_requests(
        tokenizer,
        args.num_prompts,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        prefix_len=args.random_prefix_len,
        seed=args.seed,
        need_text=need_text,
    )
    return add_images(samples, args) if name == "random-mm" else samples


# ---- token helpers ---------------------------------------------------------------------------


def _backend(tokenizer: PreTrainedTokenizerBase) -> Any:
    return getattr(tokenizer, "backend_tokenizer", None)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (a BOS is the server's to add)."""
    backend = _backend(tokenizer)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> str:
    """Text of ``token_ids`` (special tokens kept)."""
    backend = _backend(tokenizer)
    if backend is not None:
        return backend.decode(list(token_ids), skip_special_tokens=False)
    return tokenizer.decode(list(token_ids), skip_special_tokens=False)


def token_pool(tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """Ids random prompts are drawn from: the base vocabulary minus special tokens (a
    tokenizer that cannot list its vocabulary gives its ``ordinary_token_ids``).

    Special tokens are left out because a server may treat them specially (an EOS in a
    prompt, a chat-role marker) and because their text does not always encode back to them.

    Returns:
        int64 array of token ids.
    """
    ordinary = getattr(tokenizer, "ordinary_token_ids", None)  # a server's tokenizer
    if ordinary is not None:
        pool = np.array(ordinary, dtype=np.int64)
    else:
        vocab_size = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        pool = np.array([i for i in range(vocab_size) if i not in special], dtype=np.int64)
    if pool.size == 0:
        raise BenchmarkError("the tokenizer has no ordinary tokens to build prompts from")
    return pool


def fit_text(
    tokenizer: PreTrainedTokenizerBase,
    head: str,
    tail_ids: list[int],
    target_len: int,
    pool: np.ndarray,
    rng: np.random.Generator,
) -> tuple[str, list[int]]:
    """A text that starts with ``head`` and encodes to exactly ``target_len`` tokens.

    ``tail_ids`` are decoded after ``head``; while the whole text encodes to too many tokens
    the tail is cut, while too few, random tokens from ``pool`` are appended. ``head`` is kept
    as it is, so prompts that share it share its tokens (up to the last word of ``head``).

    Returns:
        ``(text, token_ids)`` with ``token_ids == encode(text)``; its length differs from
        ``target_len`` only if no fit was found within ``_MAX_FIT_ROUNDS`` (very rare).
    """
    tail = list(tail_ids)
    text = head + decode(tokenizer, tail)
    ids = encode(tokenizer, text)
    for _ in range(_MAX_FIT_ROUNDS):
        diff = target_len - len(ids)
        if diff == 0:
            break
        if diff > 0:
            tail.extend(rng.choice(pool, size=diff).tolist())
        elif len(tail) > 0:
            tail = tail[: max(0, len(tail) + diff)]
        else:
            break  # the head alone is already too long
        text = head + decode(tokenizer, tail)
        ids = encode(tokenizer, text)
    return text, ids


def _length_range(length: int, ratio: float, minimum: int) -> tuple[int, int]:
    low = max(minimum, math.floor(length * (1.0 - ratio)))
    high = max(low, math.ceil(length * (1.0 + ratio)))
    return low, high


# ---- random ----------------------------------------------------------------------------------


def random_requests(
    tokenizer: PreTrainedTokenizerBase,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    need_text: bool = False,
) -> list[SampleRequest]:
    """Prompts of random token ids with exact lengths (the ``random`` dataset).

    Each prompt is ``prefix_len`` shared tokens followed by its own random tokens; its
    length (after the prefix) is drawn uniformly from ``[floor(input_len * (1 - r)),
    ceil(input_len * (1 + r))]``, its output length likewise from ``output_len``.

    Raises:
        BenchmarkError: a negative length, ``input_len + prefix_len < 1``,
            ``output_len < 1``, or ``range_ratio`` outside [0, 1).
    """
    check_random_lengths(input_len, output_len, range_ratio, prefix_len)
    rng = np.random.default_rng(seed)
    pool = token_pool(tokenizer)
    in_low, in_high = _length_range(input_len, range_ratio, 1 if prefix_len == 0 else 0)
    out_low, out_high = _length_range(output_len, range_ratio, 1)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    prefix_ids = rng.choice(pool, size=prefix_len).tolist()
    prefix_text = ""
    if need_text and prefix_len:
        prefix_text, prefix_ids = fit_text(tokenizer, "", prefix_ids, prefix_len, pool, rng)
    requests = []
    for i in range(num_prompts):
        own = rng.choice(pool, size=int(input_lens[i])).tolist()
        requests.append(
            _make_request(
                tokenizer, prefix_text, prefix_ids, own, int(output_lens[i]), pool, rng, need_text
            )
        )
    _warn_on_misfits(requests, [prefix_len + int(n) for n in input_lens])
    return requests


def _make_request(
    tokenizer: PreTrainedTokenizerBase,
    prefix_text: str,
    prefix_ids: list[int],
    own_ids: list[int],
    output_len: int,
    pool: np.ndarray,
    rng: np.random.Generator,
    need_text: bool,
) -> SampleRequest:
    target = len(prefix_ids) + len(own_ids)
    if not need_text:
        ids = prefix_ids + own_ids
        return SampleRequest(ids, None, len(ids), output_len)
    text, ids = fit_text(tokenizer, prefix_text, own_ids, target, pool, rng)
    return SampleRequest(ids, text, len(ids), output_len)


def _warn_on_misfits(requests: list[SampleRequest], targets: list[int]) -> None:
    misfits = sum(r.prompt_len != t for r, t in zip(requests, targets, strict=True))
    if misfits:
        logger.warning(
            "%d of %d prompts could not be made exactly their target length; their actual "
            "lengths are used",
            misfits,
            len(requests),
        )


# ---- prefix repetition -----------------------------------------------------------------------


def prefix_repetition_requests(
    tokenizer: PreTrainedTokenizerBase,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
    need_text: bool = False,
) -> list[SampleRequest]:
    """Prompts sharing a few random prefixes (the ``prefix_repetition`` dataset).

    ``num_prompts`` is split as evenly as possible over ``num_prefixes`` prefixes; every
    prompt is its prefix plus ``suffix_len`` random tokens of its own. The order is shuffled,
    so requests of one prefix do not arrive back to back.

    Raises:
        BenchmarkError: ``num_prefixes < 1``, negative lengths, ``output_len < 1``, or
            empty prompts.
    """
    if num_prefixes < 1:
        raise BenchmarkError(f"--prefix-repetition-num-prefixes must be >= 1, got {num_prefixes}")
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise BenchmarkError("prefix_repetition prompts need a positive prefix + suffix length")
    if output_len < 1:
        raise BenchmarkError(f"--prefix-repetition-output-len must be >= 1, got {output_len}")
    rng = np.random.default_rng(seed)
    pool = token_pool(tokenizer)
    requests = []
    for p in range(num_prefixes):
        count = num_prompts // num_prefixes + (1 if p < num_prompts % num_prefixes else 0)
        prefix_ids = rng.choice(pool, size=prefix_len).tolist()
        prefix_text = ""
        if need_text and prefix_len:
            prefix_text, prefix_ids = fit_text(tokenizer, "", prefix_ids, prefix_len, pool, rng)
        for _ in range(count):
            own = rng.choice(pool, size=suffix_len).tolist()
            requests.append(
                _make_request(
                    tokenizer, prefix_text, prefix_ids, own, output_len, pool, rng, need_text
                )
            )
    _warn_on_misfits(requests, [prefix_len + suffix_len] * len(requests))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


# ---- ShareGPT --------------------------------------------------------------------------------


def _load_conversation_pairs(path: str) -> list[tuple[str, str]]:
    """(first human turn, first reply) of each conversation with at least two turns."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BenchmarkError(f"cannot read the ShareGPT file {path}: {e}") from e
    if not isinstance(data, list):
        raise BenchmarkError(f"{path}: a ShareGPT file holds a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        prompt, reply = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(reply, str):
            pairs.append((prompt, reply))
    return pairs


def sharegpt_requests(
    tokenizer: PreTrainedTokenizerBase,
    path: str,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    shuffle: bool = True,
    oversample: bool = True,
    max_model_len: int | None = None,
    need_text: bool = True,
) -> list[SampleRequest]:
    """Requests from a local ShareGPT file (``[{"conversations": [{"from", "value"}, ...]}]``).

    Conversations whose prompt or reply has fewer than 4 tokens, or whose prompt plus output
    exceed ``max_model_len``, are skipped.

    Raises:
        BenchmarkError: unreadable file, no usable conversation, or ``output_len < 1``.
    """
    if output_len is not None and output_len < 1:
        raise BenchmarkError(f"--sharegpt-output-len must be at least 1, got {output_len}")
    pairs = _load_conversation_pairs(path)
    rng = np.random.default_rng(seed)
    if shuffle:
        pairs = [pairs[i] for i in rng.permutation(len(pairs))]
    requests: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(requests) == num_prompts:
            break
        ids = encode(tokenizer, prompt)
        out_len = output_len if output_len is not None else len(encode(tokenizer, reply))
        if len(ids) < _MIN_SHAREGPT_TOKENS or (out_len < _MIN_SHAREGPT_TOKENS and not output_len):
            continue
        if max_model_len is not None and len(ids) + out_len > max_model_len:
            continue
        requests.append(SampleRequest(ids, prompt if need_text else None, len(ids), out_len))
    if not requests:
        raise BenchmarkError(f"{path}: no usable conversation (first human turn + reply)")
    if len(requests) < num_prompts and oversample:
        extra = rng.choice(len(requests), size=num_prompts - len(requests))
        requests += [requests[i] for i in extra]
    elif len(requests) < num_prompts:
        logger.warning(
            "%s has %d usable conversations; running %d requests, not %d",
            path,
            len(requests),
            len(requests),
            num_prompts,
        )
    return requests

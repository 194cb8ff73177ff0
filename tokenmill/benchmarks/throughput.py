"""``tokenmill bench throughput``: offline throughput of the in-process engine.

All requests are handed to ``LLM.generate`` at once and the wall time of the whole batch is
measured, as ``vllm bench throughput`` does: same dataset flags, same sampling (temperature
1.0, top_p 1.0, ``ignore_eos``, ``max_tokens`` = the request's output length), same printed
line and the same keys in ``--output-json``, so one script reads both engines' files.
Prompts are given to the engine as token ids, so their lengths are exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from tokenmill.benchmarks.common import BenchmarkError, flags_of, write_json
from tokenmill.benchmarks.datasets import (
    SampleRequest,
    add_dataset_args,
    check_dataset_flags,
    sample_requests,
)
from tokenmill.benchmarks.spec_decode_report import acceptance, format_acceptance, snapshot
from tokenmill.engine_args import EngineArgs

if TYPE_CHECKING:
    from tokenmill import LLM

logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tokenmill bench throughput``: dataset, benchmark and every engine flag."""
    add_dataset_args(parser, with_seed=False)  # --seed is the engine's, as in vLLM
    group = parser.add_argument_group("throughput")
    # Older vLLM names of the random-dataset lengths.
    group.add_argument(
        "--input-len",
        dest="random_input_len",
        type=int,
        default=argparse.SUPPRESS,
        help="Same as --random-input-len.",
    )
    group.add_argument(
        "--output-len",
        dest="random_output_len",
        type=int,
        default=argparse.SUPPRESS,
        help="Same as --random-output-len.",
    )
    group.add_argument(
        "--prefix-len",
        dest="random_prefix_len",
        type=int,
        default=argparse.SUPPRESS,
        help="Same as --random-prefix-len.",
    )
    group.add_argument(
        "--backend",
        default="tokenmill",
        choices=["tokenmill", "vllm"],
        help="Accepted for vLLM command lines: both run tokenmill's in-process engine.",
    )
    group.add_argument("--n", type=int, default=1, help="Sequences per prompt. (default: 1)")
    group.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="Return token ids only (leaves detokenization out of the measurement).",
    )
    group.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    group.add_argument("--output-json", default=None, help="Write the results to this file.")
    EngineArgs.add_cli_args(parser)


def make_llm(engine_args: EngineArgs) -> LLM:
    """An ``LLM`` with exactly these engine flags."""
    from tokenmill import LLM

    kwargs = dataclasses.asdict(engine_args)
    model = kwargs.pop("model")
    return LLM(model, **kwargs)


def run_throughput(
    llm: LLM,
    requests: list[SampleRequest],
    n: int = 1,
    detokenize: bool = True,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """Generate all ``requests`` in one ``LLM.generate`` call and time it.

    Returns:
        ``elapsed_time`` (s), ``num_requests``, ``total_num_tokens`` (prompt + generated),
        ``requests_per_second``, ``tokens_per_second`` (total) — vLLM's keys — plus
        ``total_num_prompt_tokens``, ``total_num_output_tokens`` and
        ``output_tokens_per_second``. Token counts are what the engine processed. With
        speculative decoding, the run's acceptance too (``spec_decode_report.acceptance``).
    """
    from tokenmill import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(
            n=n,
            temperature=1.0,
            top_p=1.0,
            ignore_eos=True,
            max_tokens=r.expected_output_len,
            detokenize=detokenize,
        )
        for r in requests
    ]
    counters = getattr(llm.llm_engine, "counters", None)
    before = (counters.num_preemptions, counters.prefix_cache_hits) if counters else (0, 0)
    drafts_before = snapshot(counters.spec_decoding) if counters else None
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    if counters is not None:
        logger.info(
            "Engine counters during the run: %d preemptions, %d prefix-cache hit tokens",
            counters.num_preemptions - before[0], counters.prefix_cache_hits - before[1],
        )
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": total,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": total / elapsed,
        "total_num_prompt_tokens": prompt_tokens,
        "total_num_output_tokens": output_tokens,
        "output_tokens_per_second": output_tokens / elapsed,
        **acceptance(drafts_before, counters.spec_decoding if counters else None),
    }


def format_throughput(result: dict[str, Any]) -> str:
    """The lines ``vllm bench throughput`` prints (and the acceptance of speculative
    decoding, when it ran)."""
    lines = [
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s",
        f"Total num prompt tokens:  {result['total_num_prompt_tokens']}",
        f"Total num output tokens:  {result['total_num_output_tokens']}",
    ]
    if format_acceptance(result):
        lines.append(format_acceptance(result))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``tokenmill bench throughput`` with parsed flags; prints and returns the result.

    Raises:
        BenchmarkError: invalid benchmark flags or dataset.
        ConfigError, ModelLoadError: invalid engine flags or an unreadable model.
    """
    if args.n < 1:
        raise BenchmarkError(f"--n must be at least 1, got {args.n}")
    check_dataset_flags(args)
    engine_args = EngineArgs.from_cli_args(args)
    llm = make_llm(engine_args)
    try:
        max_model_len = llm.llm_engine.config.model_config.max_model_len
        requests = sample_requests(
            args, llm.get_tokenizer(), need_text=False, max_model_len=max_model_len
        )
        no_room = sum(r.prompt_len >= max_model_len for r in requests)
        if no_room:
            raise BenchmarkError(
                f"{no_room} prompts have max_model_len={max_model_len} tokens or more, which "
                "leaves no room for an output: shorten them (--random-input-len) or raise "
                "--max-model-len"
            )
        too_long = sum(r.prompt_len + r.expected_output_len > max_model_len for r in requests)
        if too_long:
            logger.warning(
                "%d requests need more than max_model_len=%d tokens; their outputs stop at the "
                "context length",
                too_long,
                max_model_len,
            )
        result = run_throughput(
            llm,
            requests,
            n=args.n,
            detokenize=not args.disable_detokenize,
            use_tqdm=not args.disable_tqdm,
        )
    finally:
        llm.llm_engine.shutdown()
    print(format_throughput(result))
    if args.output_json:
        write_json(args.output_json, {**result, "config": flags_of(args)})
    return result

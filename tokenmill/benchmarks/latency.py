"""``tokenmill bench latency``: end-to-end latency of one batch on the in-process engine.

One batch of ``--batch-size`` random prompts of ``--input-len`` tokens generates exactly
``--output-len`` tokens each (``ignore_eos``, temperature 1.0, top_p 1.0), ``--num-iters``
times after ``--num-iters-warmup`` untimed runs — the workload of ``vllm bench latency``,
with its printed lines and ``--output-json`` keys (``avg_latency``, ``latencies``,
``percentiles``), and, like it, with prefix caching off unless ``--enable-prefix-caching``
is passed.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from tokenmill.benchmarks.common import BenchmarkError, flags_of, percentile_name, write_json
from tokenmill.benchmarks.datasets import token_pool
from tokenmill.benchmarks.spec_decode_report import acceptance, format_acceptance, snapshot
from tokenmill.benchmarks.throughput import make_llm
from tokenmill.engine_args import EngineArgs

if TYPE_CHECKING:
    from tokenmill import LLM

# The percentiles vLLM's latency benchmark reports.
LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tokenmill bench latency`` (vLLM's names and defaults) and the engine's."""
    group = parser.add_argument_group("latency")
    group.add_argument(
        "--input-len", type=int, default=32, help="Prompt tokens per request. (default: 32)"
    )
    group.add_argument(
        "--output-len", type=int, default=128, help="Generated tokens per request. (default: 128)"
    )
    group.add_argument(
        "--batch-size", type=int, default=8, help="Requests in the batch. (default: 8)"
    )
    group.add_argument("--n", type=int, default=1, help="Sequences per prompt. (default: 1)")
    group.add_argument(
        "--num-iters-warmup", type=int, default=10, help="Untimed runs first. (default: 10)"
    )
    group.add_argument("--num-iters", type=int, default=30, help="Timed runs. (default: 30)")
    group.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="Return token ids only (leaves detokenization out).",
    )
    group.add_argument("--output-json", default=None, help="Write the results to this file.")
    # Every run repeats the same prompts: with the cache on, runs after the first would hit
    # it and time only each prompt's last token. vLLM's latency bench turns it off too.
    EngineArgs.add_cli_args(parser, defaults={"enable_prefix_caching": False})


def _check_args(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len", "batch_size", "n", "num_iters"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise BenchmarkError(f"{flag} must be at least 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise BenchmarkError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")


def run_latency(
    llm: LLM,
    input_len: int,
    output_len: int,
    batch_size: int,
    num_iters: int,
    num_iters_warmup: int = 0,
    n: int = 1,
    seed: int = 0,
    detokenize: bool = True,
) -> dict[str, Any]:
    """Time ``num_iters`` runs of one batch of random prompts.

    Returns:
        ``avg_latency`` (s), ``latencies`` (s, one per timed run) and ``percentiles``
        (``{"10": s, ..., "99": s}``); with speculative decoding, the timed runs' acceptance
        (``spec_decode_report.acceptance``).

    Raises:
        BenchmarkError: prompt plus output do not fit ``max_model_len``.
    """
    from tokenmill import SamplingParams

    max_model_len = llm.llm_engine.config.model_config.max_model_len
    if input_len + output_len > max_model_len:
        raise BenchmarkError(
            f"--input-len {input_len} + --output-len {output_len} exceed max_model_len "
            f"{max_model_len}"
        )
    rng = np.random.default_rng(seed)
    pool = token_pool(llm.get_tokenizer())
    prompts = [
        {"prompt_token_ids": rng.choice(pool, size=input_len).tolist()} for _ in range(batch_size)
    ]
    params = SamplingParams(
        n=n,
        temperature=1.0,
        top_p=1.0,
        ignore_eos=True,
        max_tokens=output_len,
        detokenize=detokenize,
    )
    for _ in tqdm(range(num_iters_warmup), desc="Warmup iterations"):
        llm.generate(prompts, params, use_tqdm=False)
    latencies = []
    counters = llm.llm_engine.counters
    drafts_before = snapshot(counters.spec_decoding)
    for _ in tqdm(range(num_iters), desc="Profiling iterations"):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    values = np.percentile(latencies, LATENCY_PERCENTILES)
    return {
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies,
        "percentiles": {
            percentile_name(p): float(v) for p, v in zip(LATENCY_PERCENTILES, values, strict=True)
        },
        **acceptance(drafts_before, counters.spec_decoding),
    }


def format_latency(result: dict[str, Any]) -> str:
    """The lines ``vllm bench latency`` prints."""
    lines = [f"Avg latency: {result['avg_latency']} seconds"]
    lines += [
        f"{p}% percentile latency: {value} seconds" for p, value in result["percentiles"].items()
    ]
    if format_acceptance(result):
        lines.append(format_acceptance(result))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``tokenmill bench latency`` with parsed flags; prints and returns the result.

    Raises:
        BenchmarkError: invalid benchmark flags.
        ConfigError, ModelLoadError: invalid engine flags or an unreadable model.
    """
    _check_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    llm = make_llm(engine_args)
    try:
        result = run_latency(
            llm,
            args.input_len,
            args.output_len,
            args.batch_size,
            args.num_iters,
            args.num_iters_warmup,
            n=args.n,
            seed=engine_args.seed,
            detokenize=not args.disable_detokenize,
        )
    finally:
        llm.llm_engine.shutdown()
    print(format_latency(result))
    if args.output_json:
        write_json(args.output_json, {**result, "config": flags_of(args)})
    return result

"""``tokenmill bench serve``: load an OpenAI-compatible server and measure what clients see.

An asyncio client (aiohttp) streams every request, sending them at a Poisson
``--request-rate`` (gamma-distributed gaps with ``--burstiness``; ``inf`` sends all at once),
with at most ``--max-concurrency`` in flight. It works against tokenmill, vLLM, llama.cpp's
server or any server of the OpenAI API; flags, printed block and result keys are those of
``vllm bench serve``. A request that fails is recorded with its error message and counted;
the run always ends with a summary, and exits with 1 if every request failed. An unreachable
server is reported before anything is sent.

Token counts are the server's (``stream_options.include_usage``) where it reports them, else
the benchmark's tokenizer's count of the streamed text.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
from dataclasses import asdict
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tokenmill.benchmarks import spec_decode_report
from tokenmill.benchmarks.bench_tokenizer import find_tokenizer
from tokenmill.benchmarks.common import BenchmarkError, flags_of, parse_percentiles, write_json
from tokenmill.benchmarks.datasets import add_dataset_args, encode, sample_requests
from tokenmill.benchmarks.serve_client import (
    ClientConfig,
    ServerUnauthorized,
    ServerUnreachable,
    auth_headers,
    list_models,
    run_benchmark,
    wait_until_ready,
)
from tokenmill.benchmarks.serve_metrics import (
    RequestRecord,
    compute_summary,
    format_summary,
    parse_goodput,
    parse_metric_names,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# ---- CLI -------------------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tokenmill bench serve`` (``vllm bench serve`` names and meanings)."""
    add_dataset_args(parser)
    server = parser.add_argument_group("server")
    server.add_argument(
        "--backend",
        default="vllm",
        choices=["vllm", "openai", "openai-chat"],
        help="API flavour: vllm / openai = completions, openai-chat = chat "
        "completions. (default: vllm)",
    )
    server.add_argument(
        "--base-url",
        default=None,
        help="Server URL, e.g. http://127.0.0.1:8000 (instead of --host/--port).",
    )
    server.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    server.add_argument(
        "--endpoint",
        default=None,
        help="API path: /v1/completions or /v1/chat/completions (default: by --backend).",
    )
    server.add_argument(
        "--model",
        default=None,
        help="Model name sent in requests, and the tokenizer when --tokenizer "
        "is not given (default: the server's first model from /v1/models).",
    )
    server.add_argument(
        "--served-model-name",
        default=None,
        help="Model name sent in requests, when it differs from --model.",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help="LoRA adapter names the server serves: each request names one of them as its "
        "model, chosen at random (seeded by --seed), as vLLM's client does.",
    )
    server.add_argument(
        "--tokenizer",
        default=None,
        help="Tokenizer folder or .gguf file (builds prompts, counts tokens). Default: the "
        "model's files where they are on this machine, else the server's /tokenize route.",
    )
    server.add_argument("--trust-remote-code", action="store_true", help="Accepted; ignored.")
    server.add_argument(
        "--ready-check-timeout-sec",
        type=int,
        default=0,
        help="Wait up to this long for the server to answer first (default: 0).",
    )
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second (Poisson arrivals); inf sends all at once. (default: inf)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Shape of the gamma-distributed gaps: 1 = Poisson, < 1 burstier, "
        "> 1 more regular. (default: 1.0)",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="Most requests in flight at once (default: no limit).",
    )
    load.add_argument(
        "--num-warmups", type=int, default=0, help="Untimed requests sent first. (default: 0)"
    )
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--ignore-eos",
        action="store_true",
        help="Generate exactly the requested output length (vLLM extension).",
    )
    sampling.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="Sampling temperature (default: the server's; 0 for greedy).",
    )
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    report = parser.add_argument_group("report")
    report.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="Metrics to print percentiles of, from ttft,tpot,itl,e2el. (default: ttft,tpot,itl, "
        "as vLLM's)",
    )
    report.add_argument(
        "--metric-percentiles",
        default="99",
        help="Percentiles to report, e.g. 50,90,99. (default: 99, as vLLM's)",
    )
    report.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="Targets for goodput, e.g. ttft:500 tpot:50 e2el:2000 (ms).",
    )
    report.add_argument(
        "--save-result",
        action="store_true",
        help="Write the config, summary and per-request records as JSON.",
    )
    report.add_argument(
        "--save-detailed",
        action="store_true",
        help="Also keep generated texts and vLLM's per-request lists.",
    )
    report.add_argument("--result-dir", default=None, help="Folder of the result file.")
    report.add_argument("--result-filename", default=None, help="Name of the result file.")
    report.add_argument(
        "--label",
        default=None,
        help="Name of this run in result files and plots (default: the "
        "model's owner in /v1/models, e.g. tokenmill or vllm, else --backend).",
    )
    report.add_argument(
        "--metadata",
        nargs="*",
        default=None,
        metavar="KEY=VALUE",
        help="Extra KEY=VALUE pairs stored in the result file.",
    )
    report.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="Draw latency CDFs and tokens/s over time into this PNG.",
    )
    report.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def _base_url(args: argparse.Namespace) -> str:
    base = args.base_url or f"http://{args.host}:{args.port}"
    return base.rstrip("/")


def _endpoint(args: argparse.Namespace) -> tuple[str, bool]:
    """The API path and whether it is chat completions."""
    endpoint = args.endpoint or (
        "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    )
    chat = endpoint.rstrip("/").endswith("chat/completions")
    if not chat and not endpoint.rstrip("/").endswith("completions"):
        raise BenchmarkError(
            f"--endpoint {endpoint}: expected /v1/completions or /v1/chat/completions"
        )
    if args.backend == "openai-chat" and not chat:
        raise BenchmarkError("--backend openai-chat needs a chat endpoint (/v1/chat/completions)")
    return endpoint, chat


def _sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
    # As vLLM's client (0.11 on): no temperature unless given, so the server's default
    # (the model's generation config, else 1.0) samples; --temperature 0 is greedy.
    fields: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.ignore_eos:
        fields["ignore_eos"] = True
    return fields


def resolve_model(
    models: list[dict[str, Any]] | None, model: str | None, served_model_name: str | None
) -> tuple[str, str, str]:
    """The model id, the name to send in requests and the tokenizer source.

    Without ``--model`` the server's first listed model is used (its ``root`` path as the
    tokenizer where the server gives one that exists here). A ``--model`` that is a local
    path which the server lists as some model's ``root`` is sent under that model's name,
    so ``--model /models/x.gguf`` works against a server that calls it ``x``.

    Args:
        models: the server's ``/v1/models`` entries, None if it did not answer.

    Raises:
        BenchmarkError: no ``--model`` and the server names no model.
    """
    if model is None:
        if not models:
            raise BenchmarkError(
                "no --model given and the server's /v1/models did not name a model; pass --model"
            )
        model = str(models[0]["id"])
        root = models[0].get("root")
        tokenizer = root if isinstance(root, str) and os.path.exists(root) else model
        return model, served_model_name or model, tokenizer
    name = served_model_name or model
    if served_model_name is None and models and all(m["id"] != model for m in models):
        for entry in models:
            root = entry.get("root")
            if isinstance(root, str) and os.path.abspath(root) == os.path.abspath(model):
                name = str(entry["id"])
    tokenizer = model
    for entry in models or []:  # a served name: the model's own files, if they are here
        root = entry.get("root")
        if entry["id"] == model and isinstance(root, str) and os.path.exists(root):
            tokenizer = root
    return model, name, tokenizer


def served_max_model_len(models: list[dict[str, Any]] | None, name: str) -> int | None:
    """The context length the server gives for model ``name`` (tokenmill and vLLM list it
    as ``max_model_len``), else None. ShareGPT conversations longer than it are skipped."""
    for entry in models or []:
        value = entry.get("max_model_len")
        if entry["id"] == name and isinstance(value, int) and value > 0:
            return value
    return None


def lora_models(names: list[str] | None, num: int, seed: int) -> tuple[str, ...]:
    """The ``model`` of each of ``num`` requests under ``--lora-modules``: one of ``names``
    at random, seeded (empty without the flag: every request names the model)."""
    if not names:
        return ()
    rng = random.Random(seed)
    return tuple(rng.choice(names) for _ in range(num))


def default_label(args: argparse.Namespace, models: list[dict[str, Any]] | None) -> str:
    """``--label``, else who the server says owns its model (tokenmill, vllm, llamacpp...),
    else ``--backend``: result files of two servers then carry different labels."""
    if args.label:
        return args.label
    owner = models[0].get("owned_by") if models else None
    return str(owner) if isinstance(owner, str) and owner else args.backend


def count_missing_tokens(records: list[RequestRecord], tokenizer: PreTrainedTokenizerBase) -> None:
    """Fill token counts the server did not report: prompt from the workload, output by
    tokenizing the streamed text."""
    for record in records:
        if record.prompt_tokens is None:
            record.prompt_tokens = record.prompt_len
        if record.success and record.output_tokens is None:
            record.output_tokens = len(encode(tokenizer, record.generated_text))


# ---- entry point -----------------------------------------------------------------------------


def _check_args(args: argparse.Namespace) -> None:
    if not args.request_rate > 0:
        raise BenchmarkError(f"--request-rate must be positive (or inf), got {args.request_rate}")
    if not args.burstiness > 0:
        raise BenchmarkError(f"--burstiness must be positive, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchmarkError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.num_warmups < 0:
        raise BenchmarkError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    for item in args.metadata or []:
        if "=" not in item:
            raise BenchmarkError(f"--metadata {item!r}: expected KEY=VALUE")


class AllRequestsFailed(ValueError):
    """Every request of the run failed. The summary (and result file) are out already; the
    CLI reports this in one last line and exits with 1, as for other ValueErrors."""


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``tokenmill bench serve`` with parsed flags; prints and returns the result.

    Failed requests are counted and listed in the summary; only a run in which every one
    failed raises, after the summary.

    Raises:
        BenchmarkError: invalid flags, an unreachable server, no tokenizer, or an
            unwritable result file.
        AllRequestsFailed: no request succeeded.
    """
    _check_args(args)
    percentiles = parse_percentiles(args.metric_percentiles)
    metrics = parse_metric_names(args.percentile_metrics)
    slos = parse_goodput(args.goodput)
    base_url = _base_url(args)
    endpoint, chat = _endpoint(args)
    if args.dataset_name == "random-mm" and not chat:
        raise BenchmarkError(
            "--dataset-name random-mm sends images in chat messages: use --backend openai-chat"
        )
    if args.ready_check_timeout_sec > 0 and not wait_until_ready(
        base_url, args.ready_check_timeout_sec
    ):
        print(f"warning: {base_url} did not answer within {args.ready_check_timeout_sec} s")
    try:
        models = list_models(base_url)
    except ServerUnreachable as e:
        raise BenchmarkError(
            f"the server at {base_url} is unreachable ({e}); start it, or point --base-url "
            "(or --host/--port) at it"
        ) from None
    except ServerUnauthorized as e:
        key = "is wrong" if os.environ.get("OPENAI_API_KEY") else "is not set"
        raise BenchmarkError(
            f"the server at {base_url} refused the request ({e}): it needs an API key, and "
            f"OPENAI_API_KEY {key}; set it to the server's --api-key"
        ) from None
    model_id, model_name, tokenizer_id = resolve_model(models, args.model, args.served_model_name)
    args.label = default_label(args, models)
    tokenizer, tokenizer_id = find_tokenizer(args.tokenizer, tokenizer_id, base_url, model_name)
    samples = sample_requests(
        args, tokenizer, need_text=True, max_model_len=served_max_model_len(models, model_name)
    )
    config = ClientConfig(
        api_url=base_url + endpoint,
        chat=chat,
        model_name=model_name,
        sampling=_sampling_fields(args),
        headers=auth_headers(),
        request_models=lora_models(args.lora_modules, len(samples), args.seed),
    )
    print(
        f"Benchmarking {config.api_url} ({config.model_name}): {len(samples)} requests, "
        f"request rate {args.request_rate}/s, max concurrency {args.max_concurrency or 'unlimited'}"
    )
    drafts_before = spec_decode_report.scrape(base_url, auth_headers())
    records, duration = asyncio.run(
        run_benchmark(
            config,
            samples,
            args.request_rate,
            args.burstiness,
            args.max_concurrency,
            args.seed,
            args.num_warmups,
            show_progress=not args.disable_tqdm,
        )
    )
    count_missing_tokens(records, tokenizer)
    summary = compute_summary(records, duration, percentiles, slos)
    # The server's spec-decode counters over the run (warm-up requests included).
    summary.update(
        spec_decode_report.acceptance(
            drafts_before, spec_decode_report.scrape(base_url, auth_headers())
        )
    )
    print(format_summary(summary, metrics, percentiles, args.max_concurrency, args.request_rate))
    if spec_decode_report.format_acceptance(summary):
        print(spec_decode_report.format_acceptance(summary))
    result = build_result(args, summary, records, model_id, tokenizer_id, endpoint)
    if args.save_result or args.result_filename or args.result_dir:
        path = result_path(args, model_id)
        write_json(path, result)
        print(f"Results written to {path}")
    if args.plot:
        from tokenmill.benchmarks.plot import plot_results

        plot_results([(result["label"], result)], args.plot)
        print(f"Plot written to {args.plot}")
    if records and not any(record.success for record in records):
        raise AllRequestsFailed(f"all {len(records)} requests failed (errors listed above)")
    return result


def build_result(
    args: argparse.Namespace,
    summary: dict[str, Any],
    records: list[RequestRecord],
    model_id: str,
    tokenizer_id: str,
    endpoint: str,
) -> dict[str, Any]:
    """The result file: run description and summary under vLLM's keys, ``config`` (every
    flag), ``metadata`` and ``requests`` (one record per request; times in seconds)."""
    label = args.label or args.backend
    rate = args.request_rate
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "endpoint_type": args.backend,
        "endpoint": endpoint,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": len(records),
        "request_rate": rate if rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **summary,
        "config": flags_of(args),
        "metadata": dict(item.split("=", 1) for item in args.metadata or []),
    }
    rows = []
    for record in records:
        row = asdict(record)
        if not args.save_detailed:
            del row["generated_text"]
        rows.append(row)
    result["requests"] = rows
    if args.save_detailed:
        result.update(
            input_lens=[r.prompt_tokens for r in records],
            output_lens=[r.output_tokens or 0 for r in records],
            ttfts=[r.ttft_s or 0.0 for r in records],
            itls=[r.itl_s for r in records],
            generated_texts=[r.generated_text for r in records],
            errors=[r.error or "" for r in records],
        )
    return result


def result_path(args: argparse.Namespace, model_id: str) -> str:
    """``--result-dir/--result-filename``, by default
    ``<label>-<rate>qps[-concurrency<N>]-<model>-<date>.json``."""
    name = args.result_filename
    if not name:
        rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = os.path.basename(model_id.rstrip("/")) or "model"
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{args.label or args.backend}-{rate}qps{concurrency}-{model}-{stamp}.json"
    return os.path.join(args.result_dir, name) if args.result_dir else name

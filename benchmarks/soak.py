"""Soak and fault load against a running server: N concurrent streams for T minutes.

Each stream sends, one after another, a random mix of requests: streamed chat, completions,
completions with n > 1, structured outputs (a JSON schema, a regex, a choice), streams the
client disconnects from after a few chunks, and requests the client cancels by a short
timeout. Every ``--interval`` seconds it prints, and at the end writes as JSON: requests
served, errors by kind (client-caused disconnects and cancellations apart), p50/p99 latency,
and the engine process's RSS and thread count; at the end, after the server goes idle, the
share of KV blocks still held (``tokenmill:kv_cache_usage_perc``, which should be 0).

usage:
    tokenmill serve --port 8000 &
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --server-pid $! \\
        --streams 256 --minutes 10 --output soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import aiohttp
import psutil

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "List three colors:"]
# kind -> weight; "disconnect" and "cancel" are client-caused by design.
MIX = {
    "chat_stream": 3, "completion": 3, "completion_n": 1, "json_schema": 1, "regex": 1,
    "choice": 1, "disconnect": 1, "cancel": 1,
}  # fmt: skip
CLIENT_CAUSED = ("disconnect", "cancel")


def _body(kind: str, rng: random.Random, max_tokens: int) -> tuple[str, dict[str, Any]]:
    prompt = rng.choice(PROMPTS)
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    if kind in ("chat_stream", "disconnect"):
        return "/v1/chat/completions", {**chat, "stream": True}
    if kind == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
        return "/v1/chat/completions", {**chat, "response_format": fmt}
    body = {"prompt": prompt, "max_tokens": max_tokens}
    if kind == "completion_n":
        body.update(n=3, temperature=0.8)
    elif kind == "regex":
        body["structured_outputs"] = {"regex": "[a-z]{3,8}( [a-z]{3,8}){0,3}"}
    elif kind == "choice":
        body["structured_outputs"] = {"choice": ["yes", "no", "maybe"]}
    return "/v1/completions", body


async def _one(session: aiohttp.ClientSession, url: str, kind: str, rng, max_tokens: int):
    """One request; returns (outcome, latency s): "ok", a client-caused kind, or an error."""
    path, body = _body(kind, rng, max_tokens)
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=rng.uniform(0.2, 1.0) if kind == "cancel" else 600)
    try:
        async with session.post(url + path, json=body, timeout=timeout) as response:
            if kind == "disconnect":
                async for _ in response.content.iter_any():
                    break  # the first chunk, then the client goes away
                return "disconnect", time.monotonic() - start
            text = await response.text()
            if response.status != 200:
                return f"http_{response.status}", time.monotonic() - start
            if 'data: {"error"' in text[-4000:]:  # a stream ended by an error event
                return "stream_error", time.monotonic() - start
            return "ok", time.monotonic() - start
    except asyncio.TimeoutError:
        return ("cancel" if kind == "cancel" else "timeout"), time.monotonic() - start
    except aiohttp.ClientError as e:
        return f"client_{type(e).__name__}", time.monotonic() - start


class _Window:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.latencies: list[float] = []


async def _stream(url: str, seed: int, end: float, window: list[_Window], max_tokens: int):
    rng = random.Random(seed)
    kinds, weights = list(MIX), list(MIX.values())
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < end:
            kind = rng.choices(kinds, weights)[0]
            outcome, latency = await _one(session, url, kind, rng, max_tokens)
            window[0].outcomes[outcome] += 1
            if outcome == "ok":
                window[0].latencies.append(latency)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _engine(server_pid: int | None) -> psutil.Process | None:
    if server_pid is None:
        return None
    for child in psutil.Process(server_pid).children():
        if "spawn_main" in " ".join(child.cmdline()):
            return child
    return None


async def _kv_usage(url: str) -> float | None:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("tokenmill:kv_cache_usage_perc"):
                return float(line.rsplit(" ", 1)[1])
    return None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    end = start + 60 * args.minutes
    window = [_Window()]
    engine = _engine(args.server_pid)
    tasks = [
        asyncio.ensure_future(_stream(args.base_url, i, end, window, args.max_tokens))
        for i in range(args.streams)
    ]
    rows, totals = [], Counter()
    while not all(t.done() for t in tasks):
        await asyncio.wait(tasks, timeout=args.interval)
        current, window[0] = window[0], _Window()
        totals.update(current.outcomes)
        row = {
            "t_s": round(time.monotonic() - start),
            "served": current.outcomes["ok"],
            "errors": {k: v for k, v in current.outcomes.items() if k != "ok"},
            "p50_s": _percentile(current.latencies, 0.5),
            "p99_s": _percentile(current.latencies, 0.99),
        }
        if engine is not None:
            row["engine_rss_mib"] = round(engine.memory_info().rss / 2**20, 1)
            row["engine_threads"] = engine.num_threads()
        rows.append(row)
        print(json.dumps(row), flush=True)
    await asyncio.sleep(args.idle_s)  # aborted requests are freed; the server goes idle
    caused = {k: totals[k] for k in CLIENT_CAUSED if totals[k]}
    errors = {k: v for k, v in totals.items() if k != "ok" and k not in CLIENT_CAUSED}
    return {
        "streams": args.streams,
        "minutes": args.minutes,
        "served": totals["ok"],
        "client_caused": caused,
        "errors": errors,
        "kv_cache_usage_at_end": await _kv_usage(args.base_url),
        "windows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--server-pid", type=int, help="for the engine's RSS and threads")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=30.0, help="seconds per report row")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--output", help="write the summary as JSON here")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    summary = {k: v for k, v in result.items() if k != "windows"}
    print(json.dumps(summary, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

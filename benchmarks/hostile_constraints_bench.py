"""Costly structured-output constraints sent together, timed against a running server.

Sends eight regexes that take xgrammar minutes to compile (``".?" * n + "c" * 30``, n = 60..67)
at once, and a plain 16-token completion half a second later; reports when each costly one
was answered (status and seconds), the plain request's time against the same request on the
idle server, the engine's thread count before and 30 s after, and the CPU the engine and its
grammar workers use over the 10 s that follow (percent of one core).

usage:
    tokenmill serve --port 8000 &
    python benchmarks/hostile_constraints_bench.py --base-url http://127.0.0.1:8000 \\
        --server-pid $!
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import psutil

COSTLY = [".?" * n + "c" * 30 for n in range(60, 68)]
PLAIN = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


def _engine(server_pid: int) -> psutil.Process:
    for child in psutil.Process(server_pid).children():
        if "spawn_main" in " ".join(child.cmdline()):
            return child
    raise SystemExit("no engine process under --server-pid")


def _cpu(process: psutil.Process) -> float:
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


async def _timed(client: httpx.AsyncClient, body: dict, start: float) -> tuple[int, float]:
    response = await client.post("/v1/completions", json=body)
    return response.status_code, round(time.monotonic() - start, 2)


async def run(url: str, engine: psutil.Process) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await client.post("/v1/completions", json={**PLAIN, "guided_regex": "[ab]{2,4}"})
        start = time.monotonic()
        await client.post("/v1/completions", json=PLAIN)
        unloaded_s = time.monotonic() - start
        threads_before = engine.num_threads()
        start = time.monotonic()
        costly = [
            asyncio.ensure_future(_timed(client, {**PLAIN, "guided_regex": r}, start))
            for r in COSTLY
        ]
        await asyncio.sleep(0.5)
        plain_start = time.monotonic()
        await client.post("/v1/completions", json=PLAIN)
        loaded_s = time.monotonic() - plain_start
        answers = await asyncio.gather(*costly)
    await asyncio.sleep(30)
    threads_after = engine.num_threads()
    cpu_start = _cpu(engine)
    await asyncio.sleep(10)
    idle_cpu = 100 * (_cpu(engine) - cpu_start) / 10
    return {
        "costly_answers": [{"status": s, "seconds": t} for s, t in answers],
        "plain_unloaded_s": round(unloaded_s, 2),
        "plain_during_attack_s": round(loaded_s, 2),
        "engine_threads_before": threads_before,
        "engine_threads_30s_after": threads_after,
        "idle_cpu_percent_of_a_core": round(idle_cpu, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--server-pid", type=int, required=True)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.base_url, _engine(args.server_pid))), indent=1))


if __name__ == "__main__":
    main()

"""The embedded default on a CPU beside llama.cpp's ``llama-server``, one server after the other.

Both servers serve the same GGUF (the embedded SmolLM2-135M-Instruct Q4_1 by default) and take
the same load from ``tokenmill bench serve``: random prompts of ~100 tokens, 128 output tokens,
``ignore_eos``, once at 16 concurrent requests (64 requests) and once at 1 (16 requests). The
rounds alternate (llama-server, tokenmill, llama-server, tokenmill: ABAB), so a drift of the
machine shows as a difference between rounds rather than between servers. For tokenmill it also
records the time from start to a healthy ``/health`` and the engine process's resident memory
after start-up.

llama-server is llama.cpp's server built from its sources (CMake target ``llama-server``;
benchmarks/RESULTS.md gives the build options); it runs with 16 parallel slots and continuous
batching: ``-np 16 -c 8192 -t <cores>``.

usage:
    python benchmarks/cpu_vs_llamacpp.py --llama-server /path/to/bin/llama-server \\
        [--rounds 2] [--output cpu_vs_llamacpp.json] [-- extra tokenmill serve flags]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil

from tokenmill.model_config_args import default_model_path

LOADS = ({"concurrency": 16, "num_prompts": 64}, {"concurrency": 1, "num_prompts": 16})


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("server did not become healthy")


def _engine_rss_mib(pid: int) -> float:
    """The largest resident set among the server process and its children (the engine core
    runs in a child process)."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    return max(p.memory_info().rss for p in procs) / 2**20


def _bench(url: str, model: str, gguf: str, load: dict, out_dir: str, label: str) -> dict:
    name = f"{label}-c{load['concurrency']}.json"
    cmd = [
        sys.executable, "-m", "tokenmill.entrypoints.cli.main", "bench", "serve",
        "--base-url", url, "--model", model, "--tokenizer", gguf,
        "--dataset-name", "random", "--random-input-len", "100", "--random-output-len", "128",
        "--random-range-ratio", "0", "--ignore-eos", "--num-prompts", str(load["num_prompts"]),
        "--max-concurrency", str(load["concurrency"]), "--num-warmups", "2",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--save-result", "--result-dir", out_dir, "--result-filename", name, "--disable-tqdm",
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, name)) as f:
        res = json.load(f)
    keep = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_e2el_ms",
            "completed")
    return {k: res.get(k) for k in keep}


def _run_server(cmd: list[str], url: str, model: str, gguf: str, out_dir: str, label: str,
                measure_engine: bool) -> dict:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        result: dict = {"startup_s": _wait_healthy(url, proc)}
        if measure_engine:
            time.sleep(1.0)
            result["rss_after_startup_mib"] = _engine_rss_mib(proc.pid)
        for load in LOADS:
            result[f"c{load['concurrency']}"] = _bench(url, model, gguf, load, out_dir, label)
        if measure_engine:
            result["rss_after_load_mib"] = _engine_rss_mib(proc.pid)
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True, help="path to llama.cpp's llama-server")
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--servers", default="llama-server,tokenmill",
                    help="which servers to run, in order, each round")
    ap.add_argument("--output", default="cpu_vs_llamacpp.json")
    ap.add_argument("extra", nargs="*", help="extra `tokenmill serve` flags (after --)")
    args = ap.parse_args()
    gguf = args.model or default_model_path()
    name = os.path.basename(gguf)
    out_dir = tempfile.mkdtemp(prefix="cpu_vs_llamacpp_")
    llama = [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", "8091", "-np", "16",
             "-c", "8192", "-t", str(args.threads), "--no-webui", "--alias", name]
    tm = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", gguf, "--host",
          "127.0.0.1", "--port", "8092", "--served-model-name", name, *args.extra]
    rounds = []
    for r in range(args.rounds):
        servers = {"llama-server": (llama, 8091, False), "tokenmill": (tm, 8092, True)}
        for label in args.servers.split(","):
            cmd, port, engine = servers[label]
            url = f"http://127.0.0.1:{port}"
            res = _run_server(cmd, url, name, gguf, out_dir, f"{label}-{r}", engine)
            rounds.append({"server": label, "round": r, **res})
            print(json.dumps(rounds[-1]), flush=True)
    meta = {"cpu": _cpu_name(), "cores": args.threads, "model": gguf, "tokenmill_flags": args.extra,
            "llama_server_cmd": " ".join(llama), "date": time.strftime("%Y-%m-%d")}
    with open(args.output, "w") as f:
        json.dump({"meta": meta, "rounds": rounds}, f, indent=1)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()

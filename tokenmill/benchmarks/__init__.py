"""Benchmarks with the flags and result keys of ``vllm bench``.

- ``throughput``, ``latency``: the in-process engine (``tokenmill bench throughput|latency``).
- ``serve``: a streaming client that loads any OpenAI-compatible server (``serve_client``)
  and reports TTFT, TPOT, ITL, end-to-end latency, throughput and goodput (``serve_metrics``).
- ``datasets``: the workloads (random token prompts of exact length, ShareGPT files,
  repeated prefixes); ``plot`` and ``compare``: pictures and side-by-side tables of results.
"""

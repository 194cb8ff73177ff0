"""``tokenmill router``: one OpenAI-compatible endpoint in front of several engine replicas.

It keeps each conversation on the replica whose prefix cache holds it (``prefixaware``,
balanced against the replicas' load), or routes by session header or in turn; checks the
replicas' health; passes streams through unbuffered and client disconnects on; and exports
its own metrics. It routes to any OpenAI-compatible server (tokenmill, vLLM, SGLang...).

Why not an existing router: vLLM production-stack's router needs Python 3.12 (tokenmill
supports 3.10+), and its PyPI name now belongs to vLLM's Rust router, a fork of SGLang's.
SGLang's router (``sglang-router`` 0.3.2 on PyPI) installs and proxies OpenAI servers, but
against them its cache-aware policy sent every conversation to one replica while the others
were idle, and requests arriving right after a replica stopped failed with 500 instead of
being routed to another; it also brings a 30 MB binary. This package is small and covers
what the deployment needs: ``policy`` (the routing rules, no I/O), ``backends`` (health and
discovery), ``proxy`` (aiohttp), ``metrics``.
"""

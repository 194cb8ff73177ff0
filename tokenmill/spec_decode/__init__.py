"""Speculative decoding: proposers draft tokens, the target verifies them in one forward pass,
and rejection sampling keeps exactly the target's output distribution.

- ``config.py``: ``--speculative-config`` (vLLM's JSON) -> ``tokenmill.config.SpeculativeConfig``.
- ``proposer.py``: the ``Proposer`` seam and what a step hands it (``VerifiedStep``).
- ``ngram.py``: prompt lookup (vectorised over the batch).
- ``metrics.py``: vLLM's spec-decode counters for Prometheus and the periodic log line.

The proposers that run layers with a KV cache of their own (a smaller draft model, EAGLE /
EAGLE-3 heads, MTP layers of the target) live beside the model runner whose buffers and CUDA
graphs they share, in ``worker/proposers/``.

The scheduler hands out speculative tokens like any other (``Request.spec_token_ids`` count
against the token budget, ``core/speculation.py``); the model runner verifies them
(``worker/spec_decode_step.py``) by rejection sampling (``worker/rejection_sampler.py``,
beside the sampler whose distribution it keeps). This package imports neither: the seam sees
plain arrays and tensors.
"""

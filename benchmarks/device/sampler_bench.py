"""GPU time of the sampler alone: the fused Gumbel-max kernel against the torch routes.

usage: python3 benchmarks/device/sampler_bench.py [VOCAB]
For B rows of ``VOCAB`` (default 128,256, Llama-3's) bf16 logits: ``Sampler.forward`` at
temperature 1 and greedy through the fused kernel (``gumbel_sampling.py``), the same calls
through the torch route (metadata without the kernel's fields: shift, scale, noise and
argmax as separate kernels), top-p 0.9 through the fused route with the sort
(``top_p_0.9_sort``) and with the radix select of ``top_p_select.py``
(``top_p_0.9_radix``; ``_prefetch``: its mass pass loading the next block ahead), and the
softmax route (softmax, divide by the noise, one-stage argmax). Each case runs in a CUDA
graph. Prints ``SAMPLER`` lines in microseconds per call.
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench_cudagraph

from tokenmill.kernels.sampling import top_p as top_p_select
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import sampler as sampler_module
from tokenmill.worker.sampler import Sampler
from tokenmill.worker.sampling_metadata import SamplingRow, build_sampling_metadata


def _metadata(rows: int, vocab: int, temperature: float, fused: bool = True, **kwargs):
    params = SamplingParams(temperature=temperature, max_tokens=16, **kwargs)
    batch = [SamplingRow(params, [1, 2, 3], []) for _ in range(rows)]
    meta = build_sampling_metadata(batch, vocab, torch.device("cuda"))
    if not fused:
        meta.gumbel_seeds = meta.gumbel_temperature = None
    return meta


def _softmax_route(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    noise = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
    return probs.div_(noise).argmax(dim=-1)


def _top_p(sampler: Sampler, logits: torch.Tensor, meta, sort_free: bool, prefetch: bool = False):
    """The sampler's call with top-p by the radix select (``sort_free``) or by sorting."""
    saved = sampler_module._sort_free, top_p_select.PREFETCH
    sampler_module._sort_free, top_p_select.PREFETCH = (lambda _: sort_free), prefetch
    try:
        return sampler(logits, meta)
    finally:
        sampler_module._sort_free, top_p_select.PREFETCH = saved


def main() -> None:
    vocab = int(sys.argv[1]) if len(sys.argv) > 1 else 128256
    sampler = Sampler()
    for rows in (1, 8, 32, 256):
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
        random = _metadata(rows, vocab, 1.0)
        random_torch = _metadata(rows, vocab, 1.0, fused=False)
        top_p = _metadata(rows, vocab, 1.0, top_p=0.9)
        greedy = _metadata(rows, vocab, 0.0)
        greedy_torch = _metadata(rows, vocab, 0.0, fused=False)
        cases = {
            "random": lambda x=logits, m=random: sampler(x, m),
            "random_torch_route": lambda x=logits, m=random_torch: sampler(x, m),
            "random_softmax_route": lambda x=logits, m=random: _softmax_route(x, m.temperature),
            "top_p_0.9_sort": lambda x=logits, m=top_p: _top_p(sampler, x, m, False),
            "top_p_0.9_radix": lambda x=logits, m=top_p: _top_p(sampler, x, m, True),
            "top_p_0.9_radix_prefetch": lambda x=logits, m=top_p: _top_p(sampler, x, m, True, True),
            "greedy": lambda x=logits, m=greedy: sampler(x, m),
            "greedy_torch_route": lambda x=logits, m=greedy_torch: sampler(x, m),
        }
        for name, fn in cases.items():
            fn()
            torch.cuda.synchronize()
            t = do_bench_cudagraph(fn, rep=50, return_mode="median")
            print(f"SAMPLER rows={rows:4d} vocab={vocab} {name:24s} {t * 1e3:8.1f} us (graph)")


if __name__ == "__main__":
    main()

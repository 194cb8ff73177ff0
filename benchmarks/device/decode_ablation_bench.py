"""Where a batch-1 decode step's time goes: the captured forward pass with kernels left out.

usage: python3 benchmarks/device/decode_ablation_bench.py MODEL_DIR [CONTEXT]

Captures the decode forward pass at batch 1 once as the engine does, then once per variant
with some kernels replaced by pass-throughs (RMSNorms, SiLU-and-mul, RoPE with the KV write,
attention), and times each graph's replay over a real decode state (a request of CONTEXT
tokens, default 160, just decoded). A variant's time below the full pass's is what those
kernels cost inside the chain of dependent launches, gaps included: the most a fusion that
removes them can win. The outputs of the ablated variants are meaningless; only their times
are. Also times the short-context graphs (one key split, no reduction) and RoPE in the
decode kernel, which compute the same function as the full pass. The decode switches
(``TOKENMILL_ROPE_IN_DECODE_ATTENTION``, ``TOKENMILL_SHORT_DECODE_GRAPHS``) are set per
variant here, whatever their defaults.

Prints ``ABL <variant>: <us> us per replay (<delta> against full)`` lines.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager

import torch
from triton.testing import do_bench

from tokenmill import LLM, SamplingParams
from tokenmill.model.layers import fused_kernels
from tokenmill.model.layers.attention import Attention
from tokenmill.worker.cuda_graph import CUDAGraphRunner


@contextmanager
def patched(obj, name: str, value) -> None:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _no_norm(x, weight, eps, residual=None, offset=0.0):
    return x if residual is None else (x, residual)


def _no_act(x):
    return x[..., : x.shape[-1] // 2]


def _no_rope(*args, **kwargs):
    return None


def _no_attend(self, query, metadata, out=None):
    return query


PATCHES: dict[str, list[tuple[object, str, object]]] = {
    "norm": [(fused_kernels, "rms_norm", _no_norm)],
    "act": [(fused_kernels, "silu_and_mul", _no_act)],
    "rope": [(fused_kernels, "rotary_and_cache", _no_rope)],
    "attn": [(Attention, "attend", _no_attend)],
}


def main() -> None:
    model = sys.argv[1]
    context = int(sys.argv[2]) if len(sys.argv) > 2 else 160
    llm = LLM(model, load_format="dummy", max_num_seqs=32)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]

    def refill() -> None:
        # Leaves the runner's buffers holding a batch-1 decode at ``context + 1`` tokens.
        llm.generate([{"prompt_token_ids": [7] * context}], params, use_tqdm=False)

    def timed(removed: list[str], max_seq_len: int | None = None,
              rope_in_decode: bool = False) -> float:  # fmt: skip
        with ExitStack() as stack:
            for part in removed:
                for obj, name, value in PATCHES[part]:
                    stack.enter_context(patched(obj, name, value))
            for layer in layers:
                stack.enter_context(patched(layer, "rope_in_decode", rope_in_decode))
            graphs = CUDAGraphRunner(runner, [1], max_seq_len=max_seq_len)
            graphs.capture()
        refill()
        graph = graphs.graphs[1]
        t = do_bench(graph.replay, warmup=20, rep=300, return_mode="median") * 1e3
        del graphs
        return t

    refill()
    # (name, kernels removed, max_seq_len the graph is planned for, RoPE in the decode kernel)
    variants: list[tuple[str, list[str], int | None, bool]] = [
        ("full", [], None, False),
        ("full_again", [], None, False),
        ("short_graph", [], 256, False),
        ("rope_in_decode", [], None, True),
        ("rope_in_decode+short", [], 256, True),
        ("-norm", ["norm"], None, False),
        ("-act", ["act"], None, False),
        ("-rope", ["rope"], None, False),
        ("-attn", ["attn"], None, False),
        ("-rope-attn", ["rope", "attn"], None, False),
        ("products only", ["norm", "act", "rope", "attn"], None, False),
    ]
    results: dict[str, float] = {}
    for name, removed, max_seq_len, rope_in_decode in variants:
        results[name] = timed(removed, max_seq_len, rope_in_decode)
        base = results.get("full", results[name])
        print(f"ABL {name:22s}: {results[name]:8.1f} us per replay "
              f"({results[name] - base:+7.1f} against full)", flush=True)  # fmt: skip
    hidden = torch.randn(1, runner.model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    t = do_bench(lambda: runner.model.compute_logits(hidden), warmup=20, rep=200,
                 return_mode="median") * 1e3  # fmt: skip
    print(f"ABL LM head (eager)        : {t:8.1f} us", flush=True)


if __name__ == "__main__":
    main()

"""Where a batch-1 decode step's time goes: the captured forward pass with kernels left out.

usage: python3 benchmarks/device/decode_ablation_bench.py MODEL_DIR [CONTEXT]
       [--sweep | --sweep-wide | --sweep-decode-tiles | --sweep-one-tile] [--batch N]

Captures the decode forward pass at batch 1 once as the engine does, then once per variant
with some kernels replaced by pass-throughs (RMSNorms, SiLU-and-mul, RoPE with the KV write,
attention, the decode splits' reduction), and times each graph's replay over a real decode
state (a request of CONTEXT tokens, default 160, just decoded). A variant's time below the
full pass's is what those kernels cost inside the chain of dependent launches, gaps
included: the most a fusion that removes them can win. The outputs of the ablated variants
are meaningless; only their times are. Also times the pass with RoPE and the KV write as a
launch of their own instead of inside the decode attention kernel, the splits merged by a
reduction launch, and SiLU-and-mul as a launch of its own rather than in the gate/up
product's epilogue, which compute the same function as the full pass.

``--sweep`` instead times the same graph with other key tiles and split caps of the decode
attention kernel (RoPE in it, as the engine runs it).

``--sweep-wide`` times the graph with one key split per (request, KV head) under the
whole-context decode tile and other wide tiles (``whole_context_variants``).

``--sweep-decode-tiles`` times the graph under other decode key tiles, warps and stages
at the engine's split counts (``decode_tile_variants``); with ``--batch N`` any sweep
captures and replays the decode of N requests instead of one.

``--sweep-one-tile`` times the QKV and output projections on the tiles they had before
they took whole rows in one tile (which a program loads before it waits, and which need
no split-K combine), the down projection on its split tiles and other unsplit ones, and
the LM head (eagerly) with whole rows per program.

Prints ``ABL <variant>: <us> us per replay (<delta> against full)`` lines.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager

import torch
from triton.testing import do_bench

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.attention import paged
from tokenmill.kernels.attention.launch import TileConfig
from tokenmill.kernels.gemm import skinny_configs as skinny_gemm_configs
from tokenmill.kernels.gemm.skinny_configs import SkinnyConfig
from tokenmill.model.layers import activation as activation_layer
from tokenmill.model.layers import attention as attention_layer
from tokenmill.model.layers import norm as norm_layer
from tokenmill.model.layers.attention import Attention
from tokenmill.model.models.llama import LlamaMLP
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


_decode_launches = paged.PagedAttention._decode_launches


def _no_reduce(self, *args, **kwargs):
    launch = _decode_launches(self, *args, **kwargs)
    launch.reduce_grid = None
    return launch


PATCHES: dict[str, list[tuple[object, str, object]]] = {
    "norm": [(norm_layer, "rms_norm", _no_norm)],
    "act": [(activation_layer, "silu_and_mul", _no_act)],
    "rope": [(attention_layer, "rotary_and_cache", _no_rope)],
    "attn": [(Attention, "attend", _no_attend)],
    "reduce": [(paged.PagedAttention, "_decode_launches", _no_reduce)],
}


def sweep_variants() -> list:
    """The ``--sweep`` variants, RoPE in the decode kernel as the engine runs it: decode key
    tiles and split caps. (The products' tiles: ``one_tile_variants``.)"""
    variants: list = [("full", [], True, []), ("full_again", [], True, [])]
    tiles, splits = paged.decode_tile_config, paged.num_decode_splits
    for block_n, cap in [(32, 64), (16, 64), (64, 4), (32, 8), (16, 16), (32, 4), (16, 8)]:

        def tile(*args, block_n=block_n, **kwargs):
            cfg = tiles(*args, **kwargs)
            return TileConfig(cfg.block_m, block_n, cfg.num_warps, cfg.num_stages)

        def split_count(*args, cap=cap, **kwargs):
            return min(cap, splits(*args, **kwargs))

        patch = [(paged, "decode_tile_config", tile),
                 (paged, "num_decode_splits", split_count)]  # fmt: skip
        variants.append((f"decode {block_n} keys, <= {cap} splits", [], True, patch))
    return variants


def fixed_decode_tile(block_n: int, warps: int, stages: int) -> tuple[object, str, object]:
    """A patch that gives every decode launch this tile (16 query rows)."""
    cfg = TileConfig(16, block_n, warps, stages)
    return (paged, "decode_tile_config", lambda *args, **kwargs: cfg)


def whole_context_variants() -> list:
    """The ``--sweep-wide`` variants, RoPE in the decode kernel as the engine runs it: the
    graph with one key split per (request, KV head) (a short context's whole keys in one
    program) with the default tile and wide tiles, among them one 256-key tile that a
    program loads whole before it waits; the graph with 32-key tiles at the engine's split
    counts for comparison."""
    splits = paged.num_decode_splits
    one_split = (paged, "num_decode_splits", lambda *args, **kwargs: 1)
    variants: list = [
        ("full", [], True, []),
        ("full_again", [], True, []),
        ("one split", [], True, [one_split]),
    ]
    for block_n, warps, stages, cap in [
        (256, 8, 1, 1), (256, 16, 1, 1), (128, 8, 1, 1), (128, 8, 1, 2), (32, 4, 3, 64),
    ]:  # fmt: skip

        def split_count(*args, cap=cap, **kwargs):
            return min(cap, splits(*args, **kwargs))

        patch = [fixed_decode_tile(block_n, warps, stages),
                 (paged, "num_decode_splits", split_count)]  # fmt: skip
        name = f"{block_n} keys {warps} warps, <= {cap} splits"
        variants.append((name, [], True, patch))
    return variants


def decode_tile_variants() -> list:
    """The ``--sweep-decode-tiles`` variants, RoPE in the decode kernel as the engine runs
    it, with the engine's split counts: decode key tiles, warps and stages (registers a
    thread from an sm_90 compile: 202 at 64 keys, 4 warps, 3 stages; 143 at 32 keys)."""
    variants: list = [("full", [], True, []), ("full_again", [], True, [])]
    for block_n, warps, stages in [
        (64, 4, 3), (32, 4, 3), (32, 4, 2), (16, 4, 3), (32, 8, 2), (32, 2, 2), (16, 2, 3),
        (64, 4, 2),
    ]:  # fmt: skip
        patch = [fixed_decode_tile(block_n, warps, stages)]
        variants.append((f"decode {block_n} keys {warps} warps {stages} stages", [], True,
                         patch))  # fmt: skip
    return variants


def one_tile_variants() -> list:
    """The ``--sweep-one-tile`` variants, RoPE in the decode kernel as the engine runs it:
    the QKV, output and down projections back on their earlier tiles (split in two,
    several tiles per program), and other unsplit tiles of the down projection."""
    tuned = dict(skinny_gemm_configs.TUNED_CONFIGS)
    qkv, o_proj, down = (1, 6144, 4096), (1, 4096, 4096), (1, 4096, 14336)
    cfg = SkinnyConfig
    earlier = {
        qkv: cfg(32, 256, 2, 4, 1, False),
        o_proj: cfg(4, 256, 2, 4, 1, False),
        down: cfg(4, 256, 2, 4, 1, False),
    }
    tables = [
        ("full", {}),
        ("full_again", {}),
        ("earlier qkv, o_proj and down tiles", earlier),
        ("earlier qkv tiles", {qkv: earlier[qkv]}),
        ("earlier o_proj tiles", {o_proj: earlier[o_proj]}),
        ("earlier down tiles", {down: earlier[down]}),
    ]
    for n, k, split, warps in [(2, 1024, 1, 4), (4, 1024, 1, 8), (8, 512, 1, 8)]:
        tables.append((f"down {n}x{k} split {split} w{warps}",
                       {down: cfg(n, k, split, warps, 1, False)}))  # fmt: skip
    return [
        (name, [], True, [(skinny_gemm_configs, "TUNED_CONFIGS", {**tuned, **table})])
        for name, table in tables
    ]


def main() -> None:
    model = sys.argv[1]
    batch = 1
    if "--batch" in sys.argv:
        i = sys.argv.index("--batch")
        batch = int(sys.argv[i + 1])
        del sys.argv[i : i + 2]
    args = [a for a in sys.argv[2:] if not a.startswith("--")]
    context = int(args[0]) if args else 160
    llm = LLM(model, load_format="dummy", max_num_seqs=32)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    # The gate/up product applies SiLU-and-mul in its epilogue by default; "-act" and the
    # separate-launch variant turn that off.
    mlps = [m for m in runner.model.modules() if isinstance(m, LlamaMLP)]
    ungated = [(m, "gated_product", False) for m in mlps]

    def refill() -> None:
        # Leaves the runner's buffers holding a decode of ``batch`` requests at
        # ``context + 1`` tokens.
        prompts = [{"prompt_token_ids": [7 + i] * context} for i in range(batch)]
        llm.generate(prompts, params, use_tqdm=False)

    def timed(removed: list[str], rope_in_decode: bool = True,
              extra: list | None = None) -> float:  # fmt: skip
        with ExitStack() as stack:
            for obj, name, value in extra or []:
                stack.enter_context(patched(obj, name, value))
            for part in removed:
                for obj, name, value in PATCHES[part]:
                    stack.enter_context(patched(obj, name, value))
            for layer in layers:
                stack.enter_context(patched(layer, "rope_in_decode", rope_in_decode))
            graphs = CUDAGraphRunner(runner, [batch])
            graphs.capture()
        refill()
        graph = graphs.graphs[batch]
        t = do_bench(graph.replay, warmup=20, rep=300, return_mode="median") * 1e3
        del graphs
        return t

    refill()
    if "--sweep" in sys.argv:
        variants = sweep_variants()
    elif "--sweep-wide" in sys.argv:
        variants = whole_context_variants()
    elif "--sweep-decode-tiles" in sys.argv:
        variants = decode_tile_variants()
    elif "--sweep-one-tile" in sys.argv:
        variants = one_tile_variants()
    else:
        # (name, kernels removed, RoPE in the decode kernel, other patches); "-rope" and
        # the variants after it time the separate rotary/KV-write launch.
        reduction_launch = [(paged, "MERGE_COUNTER_SLOTS", 0)]
        variants = [
            ("full", [], True, []),
            ("full_again", [], True, []),
            ("separate rope", [], False, []),
            ("-norm", ["norm"], True, []),
            ("-act", ["act"], True, ungated),
            ("-attn", ["attn"], True, []),
            ("reduction launch", [], True, reduction_launch),
            ("-split reduction", ["reduce"], True, reduction_launch),
            ("separate SiLU-and-mul", [], True, ungated),
            ("-rope", ["rope"], False, []),
            ("-rope-attn", ["rope", "attn"], False, []),
            ("products only", ["norm", "act", "rope", "attn"], False, []),
        ]
    results: dict[str, float] = {}
    for name, removed, rope_in_decode, extra in variants:
        results[name] = timed(removed, rope_in_decode, extra)
        base = results.get("full", results[name])
        print(f"ABL {name:22s}: {results[name]:8.1f} us per replay "
              f"({results[name] - base:+7.1f} against full)", flush=True)  # fmt: skip
    hidden = torch.randn(1, runner.model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    heads = [("", {})]
    if "--sweep-one-tile" in sys.argv:
        key = (1, runner.model.config.vocab_size, runner.model.config.hidden_size)
        for n, k, w in [(4, 4096, 4), (2, 4096, 8), (8, 4096, 8), (16, 512, 8)]:
            heads.append((f" {n}x{k} w{w}", {key: SkinnyConfig(n, k, 1, w, 1, False)}))
    tuned = skinny_gemm_configs.TUNED_CONFIGS
    for label, table in heads:
        with patched(skinny_gemm_configs, "TUNED_CONFIGS", {**tuned, **table}):
            t = do_bench(lambda: runner.model.compute_logits(hidden), warmup=20, rep=200,
                         return_mode="median") * 1e3  # fmt: skip
        print(f"ABL LM head (eager){label:7s}: {t:8.1f} us", flush=True)


if __name__ == "__main__":
    main()

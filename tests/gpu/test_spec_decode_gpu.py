"""Speculative decoding on CUDA: in float32, greedy tokens with n-gram, draft-model, EAGLE and
EAGLE-3 speculation equal those without, with CUDA graphs (verify steps of up to eight
requests replay the whole-step graphs; a model proposer's single-token passes replay its
own graphs) and eagerly, batched and alone; seeded sampling repeats itself.

The model is SmolLM2-135M's architecture with random weights (``M135``, as
``test_engine_gpu.py``); the EAGLE heads are random too, written in their published layouts.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import pytest
import torch

from tests.gpu.test_engine_gpu import _prompts, smollm2_random  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip


def _repetitive(n: int) -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup finds drafts."""
    return [p[:12] * 3 for p in _prompts(n + 4)[4:]]


@dataclass
class _Run:
    tokens: list  # greedy tokens of the batched run, per prompt
    alone: list  # those of the first two prompts run one at a time
    replays: int  # verify and prompt steps that replayed a whole-step mixed graph
    counters: object  # the engine's spec-decode counters
    proposer_replays: int  # replays of the proposer's single-token-pass graphs


def _run(path: str, prompts, spec=None, proposer_graphs: bool = True, **kwargs) -> _Run:
    """Greedy generation; ``proposer_graphs=False`` runs a model proposer's passes eagerly
    while the target keeps its graphs."""
    from tokenmill import LLM, SamplingParams

    extra = {"speculative_config": spec} if spec else {}
    llm = LLM(path, dtype="float32", kv_cache_memory=2 << 30, max_model_len=1024,
              max_num_seqs=16, **extra, **kwargs)  # fmt: skip
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    proposer = runner.spec_decode.proposer if runner.spec_decode is not None else None
    if not proposer_graphs:
        proposer.graphs = None
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
             for p in prompts[:2]]  # fmt: skip
    replays = runner.graphs.mixed.num_replays if runner.graphs and runner.graphs.mixed else 0
    graphs = getattr(proposer, "graphs", None)
    counters = llm.llm_engine.counters.spec_decoding
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
    del llm
    torch.cuda.empty_cache()
    tokens = [o.outputs[0].token_ids for o in batched]
    return _Run(tokens, [o.outputs[0].token_ids for o in alone], replays, counters,
                graphs.num_replays if graphs is not None else 0)  # fmt: skip


@pytest.fixture(scope="module")
def reference(smollm2_random):  # noqa: F811
    _, path = smollm2_random
    prompts = _repetitive(8)
    return prompts, _run(path, prompts).tokens


def test_ngram_equals_plain_with_graphs_and_eagerly(smollm2_random, reference):  # noqa: F811
    _, path = smollm2_random
    prompts, plain = reference
    graphs = _run(path, prompts, NGRAM)
    assert graphs.tokens == plain and graphs.alone == plain[:2]
    # verify steps replayed mixed graphs
    assert graphs.counters.num_drafts > 0 and graphs.replays > 0
    assert _run(path, prompts, NGRAM, enforce_eager=True).tokens == plain


def test_the_model_as_its_own_draft_equals_plain(smollm2_random, reference):  # noqa: F811
    _, path = smollm2_random
    prompts, plain = reference
    spec = {"model": path, "num_speculative_tokens": 3}
    run = _run(path, prompts, spec)
    assert run.tokens == plain and run.alone == plain[:2]
    counters = run.counters
    assert counters.num_drafts > 0 and counters.num_accepted_tokens == counters.num_draft_tokens
    # The drafts after the first came from the proposer's graphs, and were the target's.
    assert run.proposer_replays > 0


@pytest.fixture(scope="module")
def small_draft(smollm2_random, tmp_path_factory):  # noqa: F811
    """A 4-layer random draft with SmolLM2's shape and tokenizer: its drafts are often
    rejected, so the rejected drafts' KV and the lookahead slots are exercised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, src = smollm2_random
    path = tmp_path_factory.mktemp("smollm2-draft")
    for name in os.listdir(src):
        if name != "config.json" and not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), path / name)
    config = AutoConfig.from_pretrained(src, num_hidden_layers=4)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("k", [2, 4])
def test_draft_model_graphs_equal_eager_passes(smollm2_random, reference, small_draft, k):  # noqa: F811
    """The proposer's graphs (batches of 1..8 padded to 1, 2, 4 or 8) draft what its eager
    passes draft: the same acceptance, and the target's tokens either way."""
    _, path = smollm2_random
    prompts, plain = reference
    spec = {"model": small_draft, "num_speculative_tokens": k}
    graphs = _run(path, prompts, spec)
    eager = _run(path, prompts, spec, proposer_graphs=False)
    assert graphs.tokens == plain and graphs.alone == plain[:2]
    assert eager.tokens == plain and eager.alone == plain[:2]
    assert graphs.proposer_replays > 0 and eager.proposer_replays == 0
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert getattr(graphs.counters, name) == getattr(eager.counters, name), name


def _eagle_head(folder, hidden: int, heads: int, kv_heads: int, ffn: int, three: bool,
                draft_vocab: int = 1000) -> None:  # fmt: skip
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    hd = hidden // heads
    qkv_in = 2 * hidden if three else hidden
    prefix = "midlayer" if three else "layers.0"

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    weights = {
        f"{prefix}.self_attn.q_proj.weight": w(heads * hd, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": w(kv_heads * hd, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": w(kv_heads * hd, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": w(hidden, heads * hd),
        f"{prefix}.mlp.gate_proj.weight": w(ffn, hidden),
        f"{prefix}.mlp.up_proj.weight": w(ffn, hidden),
        f"{prefix}.mlp.down_proj.weight": w(hidden, ffn),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(hidden),
        "fc.weight": w(hidden, (3 if three else 2) * hidden),
    }
    if three:
        weights.update({
            f"{prefix}.input_layernorm.weight": torch.ones(hidden),
            f"{prefix}.hidden_norm.weight": torch.ones(hidden),
            "norm.weight": torch.ones(hidden),
            "lm_head.weight": w(draft_vocab, hidden),
            "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
        })  # fmt: skip
    folder.mkdir()
    save_file(weights, folder / "model.safetensors")


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_change_nothing(smollm2_random, reference, tmp_path, method):  # noqa: F811
    _, path = smollm2_random
    prompts, plain = reference
    config = json.load(open(f"{path}/config.json"))
    head = tmp_path / f"{method}-head"
    _eagle_head(head, config["hidden_size"], config["num_attention_heads"],
                config["num_key_value_heads"], config["intermediate_size"], method == "eagle3")
    json.dump({**config, "num_hidden_layers": 1, "draft_vocab_size": 1000},
              open(head / "config.json", "w"))  # fmt: skip
    spec = {"method": method, "model": str(head), "num_speculative_tokens": 3}
    run = _run(path, prompts, spec)
    assert run.tokens == plain and run.alone == plain[:2] and run.counters.num_drafts > 0
    assert run.proposer_replays > 0
    eager = _run(path, prompts, spec, proposer_graphs=False)
    assert eager.tokens == plain
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert getattr(run.counters, name) == getattr(eager.counters, name), name


def test_seeded_sampling_repeats_with_speculation(smollm2_random):  # noqa: F811
    from tokenmill import LLM, SamplingParams

    _, path = smollm2_random
    llm = LLM(path, kv_cache_memory=2 << 30, max_model_len=1024, speculative_config=NGRAM)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i, max_tokens=32,
                             ignore_eos=True) for i in range(4)]  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in _repetitive(4)]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == second

"""The engine on CUDA: model parity with the CPU float32 reference, CUDA graphs against
eager execution, and what is guaranteed about batch independence.

Guarantees (stated here, tested below):
- The same request in the same batch gives the same tokens on every run (bf16 included).
- In float32, greedy output does not depend on batch composition or on CUDA graphs.
- In bfloat16, batch-size independence is NOT guaranteed: GEMM libraries pick different
  tilings (and reduction orders) for different batch sizes, as the decode attention kernel
  picks its key tile and splits, so logits differ in the last bits and a near-tie can flip
  a greedy choice; outputs stay within bf16 rounding.

The model is SmolLM2-135M's architecture with random weights (transformers' initialisation):
the real GGUF file (98 MB) cannot travel to the GPU machine. Set ``M135`` to a folder with
SmolLM2's config.json and tokenizer (the peer-vllm bundle's ``smollm2-135m-dummy``).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def smollm2_random(tmp_path_factory):
    src = os.environ.get("M135")
    if not src or not os.path.isdir(src):
        pytest.skip("set M135 to a SmolLM2-135M config + tokenizer folder")
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("smollm2-random")
    for name in os.listdir(src):
        if name != "config.json":
            shutil.copy(os.path.join(src, name), path / name)
    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(path)
    return model, str(path)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(100, 40000, (5 + 7 * i,), generator=gen).tolist() for i in range(n)]


def test_bf16_logits_match_cpu_float32(smollm2_random):
    from tests.model.paged import PagedRunner
    from tokenmill.config import LoadConfig
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.selector import get_attn_backend
    from tokenmill.model.loader.model_loader import get_model

    hf, path = smollm2_random
    cfg = EngineArgs(model=path, dtype="bfloat16", device="cuda").create_engine_config()
    dev = torch.device("cuda")
    model = get_model(cfg.model_config, LoadConfig(), dev, get_attn_backend("cuda"))
    runner = PagedRunner(model, cfg.model_config.hf_config, num_blocks=64)
    seqs = {i: p for i, p in enumerate(_prompts(3))}
    seqs[3] = _prompts(8)[7] + _prompts(8)[6]
    runner.step({3: seqs[3][:30]}, seqs)  # cached context for a chunk
    logits = runner.step({0: seqs[0], 1: seqs[1], 2: seqs[2], 3: seqs[3][30:]}, seqs).float().cpu()
    with torch.no_grad():
        ref = torch.cat(
            [
                hf(torch.tensor([seqs[0]])).logits[0],
                hf(torch.tensor([seqs[1]])).logits[0],
                hf(torch.tensor([seqs[2]])).logits[0],
                hf(torch.tensor([seqs[3]])).logits[0][30:],
            ]
        )
    # bf16 weights and activations: errors of a few 1e-3 relative to the logit scale.
    rel = (logits - ref).abs().max() / ref.abs().max()
    assert rel < 3e-2, f"max error {rel:.4f} of the largest logit"
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree > 0.95, f"argmax agreement {agree:.3f}"


def _generate(path, prompts, **kwargs):
    from tokenmill import LLM, SamplingParams

    llm = LLM(path, kv_cache_memory=2 << 30, max_model_len=1024, max_num_seqs=64, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = [
        llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
        for p in prompts[:3]
    ]
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], alone, [o.outputs[0].token_ids for o in again]


def test_cuda_graphs_equal_eager_and_batch_independent_in_float32(smollm2_random):
    _, path = smollm2_random
    prompts = _prompts(8)
    graphs, alone, again = _generate(path, prompts, dtype="float32")
    eager, _, _ = _generate(path, prompts, dtype="float32", enforce_eager=True)
    assert graphs == eager
    assert graphs[:3] == alone
    assert graphs == again


def test_start_up_compiling_ahead_changes_nothing_in_float32(smollm2_random, monkeypatch):
    """Start-up's passes run first only to compile their kernels in parallel
    (``parallel_compile``): the engine then generates what it generates with every kernel
    compiled at its first launch (TOKENMILL_COMPILE_THREADS=1), batched or alone."""
    _, path = smollm2_random
    prompts = _prompts(8)
    tokens = {}
    for threads in ("1", "8"):
        monkeypatch.setenv("TOKENMILL_COMPILE_THREADS", threads)
        tokens[threads] = _generate(path, prompts, dtype="float32")
    assert tokens["1"] == tokens["8"]


def test_rope_in_decode_attention_equals_the_separate_kernels_in_float32(
    smollm2_random, monkeypatch
):
    """Decode steps rotate and write their K/V inside the decode kernel: the same greedy
    tokens as the separate rotary/KV-write kernel (which a backend without
    ``supports_decode_rotary`` launches), in CUDA graphs and eagerly."""
    from tokenmill.model.attention.triton_backend import TritonAttentionBackend

    def use(monkeypatch, on: bool) -> None:
        monkeypatch.setattr(TritonAttentionBackend, "supports_decode_rotary", on)

    _assert_variants_keep_tokens(smollm2_random, monkeypatch, use, "float32")


def _assert_variants_keep_tokens(smollm2_random, monkeypatch, use, dtype: str, **kwargs) -> None:
    """Greedy tokens with ``use(monkeypatch, False)`` and with ``use(monkeypatch, True)``
    are the same, in CUDA graphs and eagerly."""
    _, path = smollm2_random
    prompts = _prompts(8)
    tokens = {}
    for on in (False, True):
        use(monkeypatch, on)
        for eager in (False, True):
            tokens[on, eager] = _generate(path, prompts, dtype=dtype, enforce_eager=eager,
                                          **kwargs)  # fmt: skip
    assert tokens[True, False] == tokens[False, False]
    assert tokens[True, True] == tokens[False, True]


def test_gated_product_equals_the_separate_gate_in_bf16(smollm2_random, monkeypatch):
    """With the skinny GEMM on every eligible shape (``--kernel-config '{"skinny_gemm":
    "all"}'``) the gate/up product applies SiLU-and-mul in its epilogue at decode-sized
    batches, bit-equal to the separate kernels, so greedy bf16 tokens are the same as with
    the gate as a launch of its own, in CUDA graphs and eagerly."""
    from tokenmill.model.layers.linear import MergedColumnParallelLinear

    fused = MergedColumnParallelLinear.forward_gated

    def use(monkeypatch, on: bool) -> None:
        separate = lambda self, x: None  # the caller then runs the gate apart  # noqa: E731
        monkeypatch.setattr(MergedColumnParallelLinear, "forward_gated", fused if on else separate)

    _assert_variants_keep_tokens(smollm2_random, monkeypatch, use, "bfloat16",
                                 kernel_config={"skinny_gemm": "all"})  # fmt: skip


def _record_same_step_reads(monkeypatch) -> list[bool]:
    """Patch the scheduler to record each step's ``reads_step_kv``."""
    from tokenmill.core.scheduler import Scheduler

    flags: list[bool] = []
    make_output = Scheduler._make_output

    def recording(self, plan):
        so = make_output(self, plan)
        flags.append(so.reads_step_kv)
        return so

    monkeypatch.setattr(Scheduler, "_make_output", recording)
    return flags


def test_parallel_samples_reading_blocks_their_step_writes_in_float32(smollm2_random, monkeypatch):
    """n = 4 greedy samples of a 33-token prompt: three of them hit the two prompt blocks the
    first one writes in the same step and compute one token each (a flagged step: the
    decode kernel must not read those blocks ahead of the KV write). Every sample equals
    the prompt's greedy tokens alone, with CUDA graphs and eagerly."""
    from tokenmill import LLM, SamplingParams

    _, path = smollm2_random
    flags = _record_same_step_reads(monkeypatch)
    prompt = _prompts(8)[7][:33]
    for eager in (False, True):
        llm = LLM(path, dtype="float32", kv_cache_memory=2 << 30, max_model_len=1024,
                  max_num_seqs=8, enforce_eager=eager)  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        single = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        llm.reset_prefix_cache()
        flags.clear()
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
            n=4, temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)  # fmt: skip
        assert flags[0]
        assert [c.token_ids for c in out[0].outputs] == [single[0].outputs[0].token_ids] * 4
        del llm
        torch.cuda.empty_cache()


def test_decode_step_reading_a_block_filled_by_another_decode_in_float32(
    smollm2_random, monkeypatch
):
    """A decode fills a block (position 31 of its context) in the step that admits a
    request whose prompt is that context plus one token: the new request hits the block
    and computes one token, in a decode-only step whose batch-2 graph would read the
    block ahead of the write. The step is flagged, and both requests generate what they
    generate alone without prefix caching."""
    from tokenmill import LLM, SamplingParams

    _, path = smollm2_random
    prompt_a = _prompts(8)[6][:30]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory=2 << 30, max_model_len=1024,
                  max_num_seqs=8, async_scheduling=False)  # fmt: skip
    ref = LLM(path, enable_prefix_caching=False, **kwargs)
    tokens_a = ref.generate({"prompt_token_ids": prompt_a}, params, use_tqdm=False)
    tokens_a = tokens_a[0].outputs[0].token_ids
    prompt_b = prompt_a + tokens_a[:2] + [11]
    tokens_b = ref.generate({"prompt_token_ids": prompt_b}, params, use_tqdm=False)
    tokens_b = tokens_b[0].outputs[0].token_ids
    del ref
    torch.cuda.empty_cache()

    flags = _record_same_step_reads(monkeypatch)
    llm = LLM(path, **kwargs)
    engine = llm.llm_engine
    flags.clear()
    engine.add_request("a", {"prompt_token_ids": prompt_a}, params)
    engine.step()  # a's prompt: positions 0..29, samples tokens_a[0]
    engine.step()  # position 30, samples tokens_a[1]
    engine.add_request("b", {"prompt_token_ids": prompt_b}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert flags[2], "the step computing a's position 31 admits b on a same-step hit"
    assert not any(flags[3:])
    assert outputs == {"a": tokens_a, "b": tokens_b}
    runner = engine.engine_core.executor.worker.model_runner
    assert runner.graphs.decode.num_replays > 0
    del llm, engine, runner
    torch.cuda.empty_cache()


def test_split_decode_graphs_survive_a_released_cache(smollm2_random):
    """A batch-1 decode graph splits each request's keys (its workspace is allocated by the
    warm-up passes, outside the graph's pool): it must still replay correctly after the
    caching allocator releases its free memory, as it does when an engine is deleted."""
    from tokenmill import LLM, SamplingParams

    _, path = smollm2_random
    prompt = (_prompts(8)[0] * 64)[:300]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        llm = LLM(path, dtype="float32", kv_cache_memory=2 << 30, max_model_len=1024,
                  max_num_seqs=8, enforce_eager=eager)  # fmt: skip
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        if not eager:
            assert set(runner.graphs.decode.metadata) == set(runner.graphs.decode.graphs)
        torch.cuda.empty_cache()
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        tokens[eager] = out[0].outputs[0].token_ids
        del llm, runner
        torch.cuda.empty_cache()
    assert tokens[False] == tokens[True]


@pytest.mark.parametrize("whole_step", [True, False])
def test_mixed_step_graphs_equal_eager_in_float32(smollm2_random, monkeypatch, whole_step):
    """A 64-token budget mixes prompt chunks with decodes in most steps: those replay the
    whole-step graphs of mixed batches (uniform attention grids), or on a backend without
    uniform grids the piecewise graphs (attention eager between them), and greedy tokens
    equal eager execution's, alone or batched."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.model.attention.triton_backend import TritonAttentionBackend

    monkeypatch.setattr(TritonAttentionBackend, "supports_uniform_grids", whole_step)
    _, path = smollm2_random
    prompts = _prompts(8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for eager in (False, True):
        llm = LLM(
            path,
            dtype="float32",
            kv_cache_memory=2 << 30,
            max_model_len=1024,
            max_num_seqs=64,
            max_num_batched_tokens=64,
            enforce_eager=eager,
        )
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        alone = llm.generate({"prompt_token_ids": prompts[7]}, params, use_tqdm=False)
        graphs = None
        if runner.graphs is not None:
            graphs = runner.graphs.mixed if whole_step else runner.graphs.piecewise
        replays = graphs.num_replays if graphs else 0
        results[eager] = (
            [o.outputs[0].token_ids for o in outs],
            alone[0].outputs[0].token_ids,
            replays,
        )
        del llm, runner
        torch.cuda.empty_cache()
    (graphs, graphs_alone, replays), (eager, eager_alone, _) = results[False], results[True]
    assert replays >= 4  # the steps with prompt tokens
    assert graphs == eager
    assert graphs_alone == eager_alone == graphs[7]


def test_bf16_is_deterministic_for_the_same_batch(smollm2_random):
    _, path = smollm2_random
    prompts = _prompts(8)
    first, _, again = _generate(path, prompts, dtype="bfloat16")
    assert first == again


def test_cascade_attention_equals_plain_in_float32(smollm2_random, monkeypatch):
    """48 requests after a cached 400-token prefix: their decode steps read the shared
    blocks once (cascade attention, decode-only steps leaving the whole-step graph for the
    piecewise graphs), and greedy tokens equal those of ``--disable-cascade-attn``."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.worker import cascade

    # 48 x 400 shared tokens: below the default bar for giving up a whole-step graph.
    monkeypatch.setattr(cascade, "CASCADE_MIN_SAVED_TOKENS_WITHOUT_GRAPH", 0)

    _, path = smollm2_random
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(100, 40000, (400,), generator=gen).tolist()
    prompts = [prefix + p for p in _prompts(48)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for disable in (False, True):
        llm = LLM(
            path, dtype="float32", kv_cache_memory=2 << 30, max_model_len=1024,
            max_num_seqs=64, disable_cascade_attn=disable,
        )  # fmt: skip
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        llm.generate({"prompt_token_ids": prefix}, params, use_tqdm=False)
        seen: list[int] = []
        prepare = runner._prepare_inputs

        def recording(so, prepare=prepare, seen=seen):
            inputs = prepare(so)
            seen.append(inputs.metadata.common_prefix_len)
            return inputs

        runner._prepare_inputs = recording
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[disable] = ([o.outputs[0].token_ids for o in outs], seen)
        del llm, runner
        torch.cuda.empty_cache()
    (cascade, seen), (plain, seen_plain) = results[False], results[True]
    assert sum(1 for p in seen if p) >= 20  # the 23 decode-only steps, at least
    assert max(seen) == 400 // 16 * 16 and not any(seen_plain)
    assert cascade == plain


def test_structured_outputs_on_cuda(smollm2_random):
    """Constraints hold with the grammar mask applied on the device, beside plain requests
    that keep running asynchronously (random weights: the text is arbitrary, its form is
    not)."""
    import re

    from tokenmill import LLM, SamplingParams, StructuredOutputsParams

    _, path = smollm2_random
    llm = LLM(path, kv_cache_memory=2 << 30, max_model_len=1024, max_num_seqs=8,
              max_num_batched_tokens=64, async_scheduling=True)  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    choice = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
    regex = StructuredOutputsParams(regex="[0-9]{3}-[a-z]{2}")
    params = [
        plain,
        SamplingParams(temperature=0.8, seed=1, max_tokens=16, structured_outputs=choice),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=regex),
        plain,
    ]
    prompts = [{"prompt_token_ids": p} for p in _prompts(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].outputs[0].text in ("alpha", "beta", "gamma")
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", outs[2].outputs[0].text)
    assert [o.outputs[0].finish_reason for o in outs[1:3]] == ["stop", "stop"]

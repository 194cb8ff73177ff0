"""The decode-only CPU path over a GGUF Llama stack (``models/cpu_decode_stack.py``): built
for the embedded SmolLM2, taken by every decode-only step and by no other, and bit for bit
the layers' own output (tokens and log-probabilities) across batches."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu import block_gemm
from tokenmill.model.models.cpu_decode_stack import CpuDecodeStack

pytestmark = pytest.mark.skipif(
    not block_gemm.available(), reason="the native block product is not built here"
)

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def llm(smollm2_gguf_path):
    engine = LLM(smollm2_gguf_path, kv_cache_memory=32 << 20, max_model_len=512, max_num_seqs=8)
    yield engine
    engine.llm_engine.shutdown()


def _decoder(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner.model.model


def _outputs(llm: LLM, prompts: list[str]):
    return [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_every_decode_only_step_takes_the_stack(llm, monkeypatch):
    decoder = _decoder(llm)
    llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)  # builds it
    assert isinstance(decoder._cpu_decode, CpuDecodeStack)
    runs = []
    real_run = CpuDecodeStack.run
    monkeypatch.setattr(CpuDecodeStack, "run",
                        lambda self, h, m: runs.append(h.shape[0]) or real_run(self, h, m))
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    assert runs == [1] * 7  # the prompt's step runs the layers; each later token the stack


def test_the_stack_gives_the_layers_own_output(llm):
    """Three prompts in one batch (decode rows of different contexts) and one alone: the
    same tokens with the same log-probabilities, to the bit, with the stack and without."""
    decoder = _decoder(llm)
    llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    stack = decoder._cpu_decode
    assert stack is not None
    with_stack = _outputs(llm, PROMPTS), _outputs(llm, PROMPTS[1:2])
    decoder._cpu_decode = None  # the layers run themselves
    try:
        without = _outputs(llm, PROMPTS), _outputs(llm, PROMPTS[1:2])
    finally:
        decoder._cpu_decode = stack
    for got, ref in zip(with_stack, without, strict=True):
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        assert [o.logprobs for o in got] == [o.logprobs for o in ref]


def test_other_stacks_run_their_layers(smollm2_model):
    """Weights dequantized to float32 at load are not natively packed: no stack."""
    model, _ = smollm2_model
    assert model.model.build_cpu_decode_stack() is None

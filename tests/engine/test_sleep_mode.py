"""Sleep mode and in-place weight updates, offline: sleeping frees the weights and the KV
cache (the engine's tensors and the process's memory), waking gives the same greedy
outputs, and weights loaded in place change the outputs exactly as the new weights do."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.hf_config import ModelLoadError

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3,"]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_sleep_with_weights_kept_in_gguf_blocks(smollm2_gguf_path, tmp_path):
    """SmolLM2's GGUF weights kept quantized (their converted forms live in buffers): level 1
    frees them and the KV cache and wakes up identical; level 2 and an update from the same
    file rebuild them from the checkpoint, identical too."""
    llm = LLM(smollm2_gguf_path, kv_cache_memory=32 << 20, max_model_len=512,
              enable_sleep_mode=True)  # fmt: skip
    core = llm.llm_engine.engine_core
    assert core.config.model_config.quantization == "gguf"
    before = tokens(llm)
    awake = core.memory_bytes()
    runner = core.executor.worker.model_runner
    # All the weights but the rotary tables (computed, kept while asleep).
    assert 0.95 * runner.model_weight_bytes() <= awake["weights"] and awake["weights"] > 50 << 20
    assert awake["kv_cache"] > 0
    rss_awake = rss_bytes()
    llm.sleep(level=1)
    assert core.memory_bytes() == {"weights": 0, "kv_cache": 0}
    # The process gives the weights back (they wait in a temporary file on the CPU).
    assert rss_awake - rss_bytes() >= 0.9 * awake["weights"]
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate("Hi", GREEDY, use_tqdm=False)
    llm.sleep(level=1)  # sleeping again changes nothing
    llm.wake_up()
    assert core.memory_bytes() == awake
    assert tokens(llm) == before
    llm.sleep(level=2)
    assert core.memory_bytes() == {"weights": 0, "kv_cache": 0}
    llm.wake_up()
    assert tokens(llm) == before
    llm.update_weights(smollm2_gguf_path)
    assert core.memory_bytes() == awake
    assert tokens(llm) == before
    # GGUF blocks take new weights from a .gguf file only: a safetensors folder is refused.
    with pytest.raises(ModelLoadError, match="must come as a .gguf file"):
        llm.update_weights(str(tmp_path))
    assert tokens(llm) == before
    core.check_integrity()


def hf_greedy(folder: str, tokenizer, prompts=PROMPTS) -> list[list[int]]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(
                ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_checkpoints):
    first, _ = tiny_llama_checkpoints
    return LLM(first, kv_cache_memory=16 << 20, max_model_len=256, enable_sleep_mode=True)


def test_update_weights_changes_outputs_as_the_new_weights_do(tiny_llm, tiny_llama_checkpoints):
    first, second = tiny_llama_checkpoints
    tokenizer = tiny_llm.get_tokenizer()
    assert tokens(tiny_llm) == hf_greedy(first, tokenizer)
    tiny_llm.update_weights(second)
    expected = hf_greedy(second, tokenizer)
    assert expected != hf_greedy(first, tokenizer)
    assert tokens(tiny_llm) == expected
    tiny_llm.update_weights(f"{first}/model.safetensors")  # and back, from one file
    assert tokens(tiny_llm) == hf_greedy(first, tokenizer)


def _without(name: str):
    def change(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    return change


def _with(name: str, tensor: torch.Tensor):
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensor

    return change


# Checkpoints that do not fit the model, each bad only after good tensors in the file's
# (sorted) order: ``(change to the tensors, what the error says)``.
NOT_FITTING = {
    "wrong shape": (
        _with("model.layers.1.mlp.down_proj.weight", torch.zeros(128, 64)),
        r"model\.layers\.1\.mlp\.down_proj\.weight.*\(128, 64\)",
    ),
    "unknown tensor": (
        _with("model.layers.1.mlp.extra.weight", torch.zeros(4)),
        r"'model\.layers\.1\.mlp\.extra\.weight' does not belong to any parameter",
    ),
    "missing tensor": (
        _without("model.layers.1.self_attn.v_proj.weight"),
        r"no weights for .*qkv_proj\.weight \(shards \['v'\]\)",
    ),
}


@pytest.mark.parametrize("case", NOT_FITTING)
def test_update_weights_refuses_a_checkpoint_that_does_not_fit_before_writing(
    tiny_llm, tiny_llama_checkpoints, tmp_path, case
):
    """The whole checkpoint is checked before any tensor is written: the running weights
    and the outputs stay as they were."""
    from safetensors.torch import load_file, save_file

    first, second = tiny_llama_checkpoints
    tiny_llm.update_weights(first)
    before = tokens(tiny_llm)
    model = tiny_llm.llm_engine.engine_core.executor.worker.model_runner.model
    weights = {name: p.clone() for name, p in model.named_parameters()}
    tensors = load_file(f"{second}/model.safetensors")
    change, message = NOT_FITTING[case]
    change(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=message) as e:
        tiny_llm.update_weights(str(tmp_path / "model.safetensors"))
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
    assert tokens(tiny_llm) == before
    assert "written" not in str(e.value)  # nothing was


def test_level_2_then_weights_then_kv_cache(tiny_llm, tiny_llama_checkpoints):
    """The training-loop sequence: drop everything, wake the weights, load new ones, wake
    the KV cache."""
    first, second = tiny_llama_checkpoints
    tiny_llm.update_weights(first)
    before = tokens(tiny_llm)
    core = tiny_llm.llm_engine.engine_core
    tiny_llm.sleep(level=2)
    with pytest.raises(ValueError, match="asleep"):
        tiny_llm.update_weights(second)
    tiny_llm.wake_up(["weights"])
    assert core.is_sleeping and core.memory_bytes()["kv_cache"] == 0
    tiny_llm.update_weights(second)
    tiny_llm.wake_up(["kv_cache"])
    assert not core.is_sleeping
    assert tokens(tiny_llm) == hf_greedy(second, tiny_llm.get_tokenizer())
    # Level 2 without new weights reads the checkpoint again.
    tiny_llm.update_weights(first)
    tiny_llm.sleep(level=2)
    tiny_llm.wake_up()
    assert tokens(tiny_llm) == before


def test_sleep_needs_sleep_mode_and_a_valid_level(tiny_llama_checkpoints, tiny_llm):
    with pytest.raises(ValueError, match="level"):
        tiny_llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        tiny_llm.wake_up(["everything"])
    plain = LLM(tiny_llama_checkpoints[0], kv_cache_memory=16 << 20, max_model_len=256)
    with pytest.raises(ValueError, match="--enable-sleep-mode"):
        plain.sleep()


def test_beam_search_in_flight_finishes_after_wake_up(tiny_llm, tiny_llama_checkpoints):
    """Beams running (some forked, some waiting for their siblings) when the engine falls
    asleep are preempted with their candidates kept, and the search ends after wake_up with
    the beams it has without the nap; every block is free again."""
    from tokenmill import BeamSearchParams

    tiny_llm.update_weights(tiny_llama_checkpoints[0])
    engine = tiny_llm.llm_engine
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time"]
    expected = [[s.tokens for s in o.sequences] for o in tiny_llm.beam_search(prompts, params)]
    kv = engine.engine_core.scheduler.kv_cache_manager
    free_before = kv.num_free_blocks
    for request_id, prompt in enumerate(prompts):
        engine.add_request(f"nap-{request_id}", prompt, params)
    for _ in range(4):  # the prompts and a few forking steps
        engine.step()
    assert engine.has_unfinished_requests()
    assert len(engine.engine_core.scheduler.running) > len(prompts)  # beams have forked
    tiny_llm.sleep(level=1)
    tiny_llm.wake_up()
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    got = [
        [list(out.prompt_token_ids) + c.token_ids for c in out.outputs]
        for out in (results[f"nap-{i}"] for i in range(len(prompts)))
    ]
    assert got == expected
    assert kv.num_free_blocks == free_before
    engine.engine_core.check_integrity()

"""Multi-LoRA generation against transformers + peft on SmolLM2's real weights (float32,
CPU): three adapters and the base model in one batch, greedy tokens and their logprobs."""

from __future__ import annotations

import pytest
import torch

from tests.lora.conftest import ADAPTERS
from tokenmill import SamplingParams
from tokenmill.lora.request import LoRARequest

pytestmark = pytest.mark.slow
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm(smollm2_float_dir):
    from tokenmill import LLM

    return LLM(
        smollm2_float_dir, dtype="float32", device="cpu", kv_cache_memory=64 << 20,
        max_model_len=512, enable_lora=True, max_loras=3, max_lora_rank=16,
        max_cpu_loras=3,
    )  # fmt: skip


@pytest.fixture(scope="module")
def lora_requests(adapter_dirs):
    return {name: LoRARequest(name, i, adapter_dirs[name]) for i, name in enumerate(ADAPTERS, 1)}


def _reference(peft_model, tokenizer, prompt: str, adapter: str | None):
    """Greedy tokens and their logprobs from transformers + peft."""
    model = peft_model
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
                logits = model(out).logits
        else:
            model.set_adapter(adapter)
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
            logits = model(out).logits
    gen = out[0, ids.shape[1]:]
    logprobs = torch.log_softmax(logits[0, ids.shape[1] - 1 : -1].float(), dim=-1)
    return gen.tolist(), logprobs.gather(1, gen[:, None])[:, 0]


def test_mixed_batch_matches_peft(llm, lora_requests, peft_model):
    adapters = [None, "qv", "all", "mlp"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    prompts = PROMPTS * 2
    loras = [lora_requests[a] if a else None for a in adapters] + [
        lora_requests[a] if a else None for a in reversed(adapters)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    tokenizer = llm.get_tokenizer()
    seen = set()
    for prompt, lora, out in zip(prompts, loras, outputs, strict=True):
        name = lora.lora_name if lora else None
        tokens, ref_logprobs = _reference(peft_model, tokenizer, prompt, name)
        got = out.outputs[0]
        assert got.token_ids == tokens, (name, prompt)
        got_lp = torch.tensor([lp[t].logprob for lp, t in zip(got.logprobs, tokens, strict=True)])
        torch.testing.assert_close(got_lp, ref_logprobs, atol=2e-3, rtol=1e-3)
        seen.add((prompt, tuple(tokens)))
    # The adapters change the output: not every adapter answers one prompt the same way.
    assert len(seen) > len(PROMPTS)


def test_adapters_never_share_kv(llm, lora_requests):
    """The same long prompt under two adapters: the second finds no prefix-cache hit."""
    prompt = "Tell me a story about a robot who learns to paint. " * 6
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate(prompt, params, use_tqdm=False, lora_request=lora_requests["qv"])
    other = llm.generate(prompt, params, use_tqdm=False, lora_request=lora_requests["mlp"])
    same = llm.generate(prompt, params, use_tqdm=False, lora_request=lora_requests["qv"])
    assert first[0].num_cached_tokens == 0
    assert other[0].num_cached_tokens == 0
    assert same[0].num_cached_tokens > 0
    llm.llm_engine.engine_core.check_integrity()


def test_unknown_adapter_folder_is_refused(llm, tmp_path):
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate("hi", SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("nope", 99, str(tmp_path)))
    assert not llm.llm_engine.has_unfinished_requests()
    # a name instead of a LoRARequest is not taken for a list of its characters
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest, None or a list"):
        llm.generate(["hi", "yo"], SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request="qv")


def test_unloading_an_adapter_in_use_waits_for_its_requests(llm, lora_requests, peft_model):
    """``remove_lora`` while a request runs with the adapter: the request finishes with it
    (its tokens as peft's), and the adapter is dropped after the request's last step."""
    from tokenmill.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    lora = lora_requests["mlp"]
    manager = engine.engine_core.executor.worker.model_runner.lora
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    engine.add_request("unload-in-use", PROMPTS[0], params, lora_request=lora)
    outputs = engine.step()
    engine.engine_core.remove_lora(lora.lora_int_id)
    assert lora.lora_int_id in manager.known  # still in use
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (final,) = [o for o in outputs if o.finished]
    tokens, _ = _reference(peft_model, llm.get_tokenizer(), PROMPTS[0], "mlp")
    assert final.outputs[0].token_ids == tokens
    assert lora.lora_int_id not in manager.known and lora.lora_int_id not in manager.slot_of
    # Named again, the adapter is read from its folder again.
    again = llm.generate(PROMPTS[0], params, use_tqdm=False, lora_request=lora)
    assert again[0].outputs[0].token_ids == tokens


def test_an_adapter_that_no_longer_loads_ends_its_requests_only(llm, lora_requests, adapter_dirs,
                                                                tmp_path):
    """An adapter that left host memory is read again when a step needs it; when its folder
    went meanwhile, its request ends refused with the reason, the step runs for the others
    and the engine goes on."""
    import shutil

    from tokenmill.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    manager = engine.engine_core.executor.worker.model_runner.lora
    folder = shutil.copytree(adapter_dirs["mlp"], tmp_path / "moving")
    moving = LoRARequest("moving", 50, str(folder))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    engine.add_request("moving", PROMPTS[0], params, lora_request=moving)
    engine.add_request("steady", PROMPTS[1], params, lora_request=lora_requests["qv"])
    manager.host.pop(moving.lora_int_id)  # as when later adapters push it out of host memory
    shutil.rmtree(folder)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = {o.request_id: o.outputs[0] for o in outputs if o.finished}
    assert final["moving"].finish_reason == "abort"
    assert "no adapter folder" in str(final["moving"].stop_reason)
    alone = llm.generate(PROMPTS[1], params, use_tqdm=False, lora_request=lora_requests["qv"])
    assert final["steady"].token_ids == alone[0].outputs[0].token_ids
    assert moving.lora_int_id not in manager.known
    with pytest.raises(ValueError, match="no adapter folder"):  # named again: refused
        llm.generate("hi", params, use_tqdm=False, lora_request=moving)


def _altered_copy(src: str, dst, alter) -> str:
    """``src``'s adapter with its weights (and config) changed by ``alter(weights, config)``."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(f"{dst}/adapter_model.safetensors")
    config = json.load(open(f"{dst}/adapter_config.json"))
    alter(weights, config)
    save_file(weights, f"{dst}/adapter_model.safetensors")
    json.dump(config, open(f"{dst}/adapter_config.json", "w"))
    return str(dst)


def test_non_finite_or_misranked_adapters_are_refused(llm, adapter_dirs, tmp_path):
    """A NaN in an adapter would reach every row of a CPU batch (all slots are computed and
    masked), and a config ``r`` other than the weights' rank would scale them wrongly: both
    are refused when loaded, and the base model serves on."""

    def nan(weights, config):
        for t in weights.values():
            t.fill_(float("nan"))

    def misranked(weights, config):
        config["r"] = config["r"] // 2

    def overflowing(weights, config):  # finite alpha, B * alpha / r past float32's range
        config["lora_alpha"] = 1e300

    def untargeted(weights, config):  # v_proj weights of an adapter that targets q_proj
        config["target_modules"] = ["q_proj"]

    def one_dimensional(weights, config):
        key = next(k for k in weights if k.endswith("lora_B.weight"))
        weights[key] = weights[key].reshape(-1)

    def float8(weights, config):
        key = next(k for k in weights if k.endswith("lora_A.weight"))
        weights[key] = weights[key].to(torch.float8_e4m3fn)

    params = SamplingParams(max_tokens=4, temperature=0)
    base = llm.generate("The capital of France is", params, use_tqdm=False)
    cases = [(nan, "NaN or Inf"), (misranked, "says r="), (overflowing, "overflows"),
             (untargeted, "does not name"), (one_dimensional, "1-dimensional"),
             (float8, "float8_e4m3fn tensor; LoRA weights are matrices")]
    for i, (alter, word) in enumerate(cases, 90):
        path = _altered_copy(adapter_dirs["qv"], tmp_path / str(i), alter)
        with pytest.raises(ValueError, match=word):
            llm.generate("hi", params, use_tqdm=False, lora_request=LoRARequest(str(i), i, path))
    again = llm.generate("The capital of France is", params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == base[0].outputs[0].token_ids


def test_target_modules_in_peft_s_other_forms_serve_the_same_adapter(llm, lora_requests,
                                                                       adapter_dirs, tmp_path):
    """peft writes target_modules as dotted suffixes ("self_attn.q_proj") or as its
    "all-linear" shorthand, and its loader reads them as the plain names: the same weights
    under those configs give the same tokens (``test_mixed_batch_matches_peft`` checks
    those against peft)."""

    def suffixes(weights, config):
        config["target_modules"] = ["self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                                    "v_proj"]  # fmt: skip

    def all_linear(weights, config):
        config["target_modules"] = "all-linear"

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, (name, alter) in enumerate([("qv", suffixes), ("all", all_linear)], 80):
        path = _altered_copy(adapter_dirs[name], tmp_path / name, alter)
        prompts = PROMPTS[:2]
        got = llm.generate(prompts, params, use_tqdm=False,
                           lora_request=LoRARequest(f"{name}-{i}", i, path))  # fmt: skip
        want = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests[name])
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_an_adapter_of_some_layers_serves_them_only(llm, adapter_dirs, tmp_path):
    """``layers_to_transform``: peft's adapter holds weights for those layers only, and
    serves as the same weights listed without it; a weight of another layer is refused."""

    def first_layers(weights, config):
        for key in [k for k in weights if ".layers.0." not in k and ".layers.1." not in k]:
            del weights[key]

    def of_layers(weights, config):
        first_layers(weights, config)
        config["layers_to_transform"] = [0, 1]

    def too_few(weights, config):
        first_layers(weights, config)
        config["layers_to_transform"] = [0]

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = _altered_copy(adapter_dirs["qv"], tmp_path / "plain", first_layers)
    layers = _altered_copy(adapter_dirs["qv"], tmp_path / "layers", of_layers)
    want = llm.generate(PROMPTS[:2], params, use_tqdm=False,
                        lora_request=LoRARequest("plain", 70, plain))  # fmt: skip
    got = llm.generate(PROMPTS[:2], params, use_tqdm=False,
                       lora_request=LoRARequest("layers", 71, layers))  # fmt: skip
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    path = _altered_copy(adapter_dirs["qv"], tmp_path / "too-few", too_few)
    with pytest.raises(ValueError, match="layers.1.self_attn.*does not name"):
        llm.generate("hi", params, use_tqdm=False, lora_request=LoRARequest("few", 72, path))


def test_per_module_ranks_and_alphas_match_peft(llm, smollm2_float_dir, tmp_path):
    """``rank_pattern``/``alpha_pattern``: each module's own r and alpha, as peft applies
    them (greedy tokens and logprobs)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(smollm2_float_dir, dtype=torch.float32)

    torch.manual_seed(5)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"layers.1.self_attn.v_proj": 2, "q_proj": 4},
        alpha_pattern={"down_proj": 4}, init_lora_weights=False,
    )  # fmt: skip
    model = get_peft_model(base(), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.2)
    model.save_pretrained(tmp_path)
    reference = PeftModel.from_pretrained(base(), str(tmp_path), adapter_name="patterns").eval()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    lora = LoRARequest("patterns", 60, str(tmp_path))
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False, lora_request=lora)
    for prompt, out in zip(PROMPTS[:2], outputs, strict=True):
        tokens, ref_logprobs = _reference(reference, llm.get_tokenizer(), prompt, "patterns")
        got = out.outputs[0]
        assert got.token_ids == tokens
        got_lp = torch.tensor([lp[t].logprob for lp, t in zip(got.logprobs, tokens, strict=True)])
        torch.testing.assert_close(got_lp, ref_logprobs, atol=2e-3, rtol=1e-3)


def test_an_unloaded_adapter_is_freed_when_its_last_request_is_aborted(llm, lora_requests):
    """A client that goes away ends its request by an abort, after which the engine may not
    step again: the unloaded adapter is freed then, not left until the next request."""
    engine = llm.llm_engine
    lora = lora_requests["mlp"]
    manager = engine.engine_core.executor.worker.model_runner.lora
    engine.add_request("abort-unloaded", PROMPTS[0], SamplingParams(max_tokens=50),
                       lora_request=lora)  # fmt: skip
    engine.step()
    engine.engine_core.remove_lora(lora.lora_int_id)
    assert lora.lora_int_id in manager.slot_of  # still in use
    engine.abort_request("abort-unloaded")
    assert not engine.has_unfinished_requests()
    assert lora.lora_int_id not in manager.known and lora.lora_int_id not in manager.slot_of
    assert lora.lora_int_id not in manager.host

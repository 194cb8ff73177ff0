"""The ``Proposer`` contract, checked on every implementation (n-gram, draft model, EAGLE,
EAGLE-3 and MTP, the last through a test model that ships an MTP head): one list per
request of at most k token ids of the vocabulary, none where not asked for; drafts depend
on the request alone (the same batched or alone); greedy outputs are the target's."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.spec_decode.conftest import VOCAB
from tokenmill import LLM, SamplingParams
from tokenmill.hf_config import HFConfig
from tokenmill.model import registry
from tokenmill.model.loader import model_loader
from tokenmill.model.loader.weights import initialize_dummy_weights
from tokenmill.model.models.eagle import EagleHead
from tokenmill.model.models.llama import LlamaForCausalLM
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.worker.proposers.eagle import SupportsMTP

K = 3


class TinyMTPForCausalLM(LlamaForCausalLM):
    """A Llama whose checkpoint ships one multi-token-prediction layer (random here)."""

    supports_mtp = True

    def __init__(self, model_config, backend) -> None:
        super().__init__(model_config, backend)
        self._mtp_args = (model_config, backend)

    def mtp_head(self) -> torch.nn.Module:
        if "_mtp" not in self.__dict__:  # kept off the module tree: not a target layer
            model_config, backend = self._mtp_args
            one_layer = HFConfig({**model_config.hf_config.to_dict(), "num_hidden_layers": 1})
            with torch.device(self.lm_head.weight.device):
                head = EagleHead(dataclasses.replace(model_config, hf_config=one_layer), backend)
            initialize_dummy_weights(head, seed=7, low=-0.05, high=0.05)
            head.share(self)
            self.__dict__["_mtp"] = head
        return self.__dict__["_mtp"]


@pytest.fixture
def mtp_target(tiny_target, tmp_path, monkeypatch):
    """The tiny target as a model with an MTP layer."""
    original = registry.get_model_class

    def get_model_class(architecture: str):
        if architecture == "TinyMTPForCausalLM":
            return TinyMTPForCausalLM
        return original(architecture)

    monkeypatch.setattr(registry, "get_model_class", get_model_class)
    monkeypatch.setattr(model_loader, "get_model_class", get_model_class)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes(open(f"{tiny_target}/{name}", "rb").read())
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["TinyMTPForCausalLM"], num_nextn_predict_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _spec(method: str, request) -> tuple[str | None, dict]:
    """The target folder (None: the tiny target) and the speculative config of ``method``."""
    if method == "ngram":
        return None, {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 2,
                      "prompt_lookup_min": 1}  # fmt: skip
    if method == "mtp":
        return request.getfixturevalue("mtp_target"), {"method": "mtp", "num_speculative_tokens": K}
    if method == "draft_model":
        return None, {"model": request.getfixturevalue("tiny_target"), "num_speculative_tokens": K}
    head = request.getfixturevalue(f"{method}_head")
    return None, {"method": method, "model": head, "num_speculative_tokens": K}


def _checked(proposer):
    """Wrap ``proposer.propose`` to check its result against the contract at every call."""
    propose = proposer.propose

    def checked(step):
        drafts = propose(step)
        assert len(drafts) == step.num_reqs
        for wanted, row_drafts in zip(step.propose.tolist(), drafts, strict=True):
            assert len(row_drafts) <= K and all(0 <= t < VOCAB for t in row_drafts)
            assert wanted or not row_drafts
        return drafts

    proposer.propose = checked


def _drafts_by_request(llm: LLM, prompts, params) -> tuple[list, dict[str, list]]:
    """Greedy outputs, and each request's verified drafts step by step."""
    engine = llm.llm_engine
    executor = engine.engine_core.executor
    seen: dict[str, list] = {}
    execute = executor.execute_model

    def recording(so, grammar_output=None):
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            seen.setdefault(req_id, []).append(list(drafts))
        return execute(so, grammar_output)

    executor.execute_model = recording
    try:
        ids = [engine.add_request(f"r{i}", p, params[i]).request_id for i, p in enumerate(prompts)]
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
    finally:
        executor.execute_model = execute
    kv = engine.engine_core.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
    return [outputs[i] for i in ids], {i: seen.get(i, []) for i in ids}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3", "mtp"])
def test_every_proposer_keeps_the_contract(method, request, tiny_target, smollm2_gguf_path):
    target, spec = _spec(method, request)
    target = target or tiny_target
    kw = dict(tokenizer=smollm2_gguf_path, max_model_len=128, kv_cache_memory=16 << 20,
              max_num_batched_tokens=256)  # fmt: skip
    g = torch.Generator().manual_seed(9)
    # Repeats in the prompts give the n-gram lookup matches.
    prompts = [{"prompt_token_ids": (torch.randint(5, 40, (8,), generator=g).tolist() * 3)}
               for _ in range(3)]  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=4,
                                 structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    plain = LLM(target, tokenizer=smollm2_gguf_path, max_model_len=128, kv_cache_memory=16 << 20)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(target, speculative_config=spec, **kw)
    proposer = llm.llm_engine.engine_core.executor.worker.model_runner.spec_decode.proposer
    if method == "mtp":
        assert isinstance(llm.llm_engine.engine_core.executor.worker.model_runner.model,
                          SupportsMTP)  # fmt: skip
    _checked(proposer)
    batched, batched_drafts = _drafts_by_request(
        llm, prompts + prompts[:1], [greedy] * 3 + [constrained]
    )
    assert batched[:3] == reference
    assert batched_drafts["r3"] == []  # structured outputs never speculate
    assert any(batched_drafts[f"r{i}"] for i in range(3))
    for i, prompt in enumerate(prompts):
        alone, alone_drafts = _drafts_by_request(llm, [prompt], [greedy])
        assert alone[0] == reference[i]
        assert alone_drafts["r0"] == batched_drafts[f"r{i}"]

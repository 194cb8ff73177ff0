"""Proposers with layers of their own, on a tiny random Llama: at every step the drafts are
those an independent implementation computes from the request's tokens (so the draft KV
kept across steps, chunked prompts, rejected drafts and prefix-cache hits is right), and
greedy outputs are the target's own.

References: EAGLE and EAGLE-3 heads written here in plain torch from their checkpoints'
tensors, over transformers' hidden states of the target; the draft model is transformers'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.spec_decode.conftest import HEADS, KV_HEADS, save_llama
from tokenmill import LLM, SamplingParams
from tokenmill.worker.proposers.eagle import read_head_weights

EPS = 1e-5
THETA = 10000.0


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate halves (Llama's layout): ``x [T, heads, d]``."""
    d = x.shape[-1]
    inv = THETA ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _attention(w: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """Causal GQA self-attention with RoPE over positions ``0..T-1``."""
    t = x.shape[0]
    q = (x @ w[f"{prefix}.q_proj.weight"].T).view(t, HEADS, -1)
    k = (x @ w[f"{prefix}.k_proj.weight"].T).view(t, KV_HEADS, -1)
    v = (x @ w[f"{prefix}.v_proj.weight"].T).view(t, KV_HEADS, -1)
    pos = torch.arange(t)
    q, k = _rope(q, pos), _rope(k, pos)
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
    return out @ w[f"{prefix}.o_proj.weight"].T


def _mlp(w: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate = F.silu(x @ w[f"{prefix}.gate_proj.weight"].T) * (x @ w[f"{prefix}.up_proj.weight"].T)
    return gate @ w[f"{prefix}.down_proj.weight"].T


def eagle_drafts(w: dict, target, tokens: list[int], k: int) -> list[int]:
    """EAGLE: position ``p`` reads token ``p + 1`` and the target's final hidden state at
    ``p``; drafting on, its own output is the next position's feature."""
    with torch.no_grad():
        feats = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
        xs, fs, drafts = list(tokens[1:]), feats[:-1], []
        for _ in range(k):
            h = torch.cat([embed[xs], fs], dim=-1) @ w["fc.weight"].T + w["fc.bias"]
            r = h + _attention(w, "layers.0.self_attn", h)  # no input norm in layer 0
            post = _rms(r, w["layers.0.post_attention_layernorm.weight"])
            out = r + _mlp(w, "layers.0.mlp", post)
            drafts.append(int((out[-1] @ lm_head.T).argmax()))
            xs.append(drafts[-1])
            fs = torch.cat([fs, out[-1:]])
    return drafts


def eagle3_drafts(w: dict, target, tokens: list[int], k: int) -> list[int]:
    """EAGLE-3: the first feature fuses the target's residual stream at the input of layers
    (2, L // 2, L - 3) = (2, 2, 1); attention over [norm(embedding); norm(feature)]."""
    with torch.no_grad():
        hs = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[2][0], hs[2][0], hs[1][0]], dim=-1)
        fs = (aux @ w["fc.weight"].T)[:-1]
        embed = target.model.embed_tokens.weight
        xs, drafts = list(tokens[1:]), []
        for _ in range(k):
            e = _rms(embed[xs], w["midlayer.input_layernorm.weight"])
            x = torch.cat([e, _rms(fs, w["midlayer.hidden_norm.weight"])], dim=-1)
            r = fs + _attention(w, "midlayer.self_attn", x)
            post = _rms(r, w["midlayer.post_attention_layernorm.weight"])
            pre = r + _mlp(w, "midlayer.mlp", post)
            draft = int((_rms(pre[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
            drafts.append(draft + int(w["d2t"][draft]))
            xs.append(drafts[-1])
            fs = torch.cat([fs, pre[-1:]])
    return drafts


def model_drafts(draft, tokens: list[int], k: int) -> list[int]:
    with torch.no_grad():
        ids = list(tokens)
        for _ in range(k):
            ids.append(int(draft(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(tokens) :]


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 320, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def run_recording(llm: LLM, prompts: list[list[int]], max_tokens: int):
    """Step the engine; after each step, each live request's tokens and next drafts."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(f"p{i}-{id(prompts)}", {"prompt_token_ids": p}, params).request_id
           for i, p in enumerate(prompts)]  # fmt: skip
    scheduler = engine.engine_core.scheduler
    records, outputs = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        for request in scheduler.requests.values():
            if request.spec_token_ids:
                records.append((list(request.all_token_ids), list(request.spec_token_ids)))
    engine.engine_core.check_integrity()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    return [outputs[i] for i in ids], records


KW = dict(max_model_len=256, kv_cache_memory=16 << 20, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def hf_target(tiny_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def plain_outputs(tiny_target, smollm2_gguf_path):
    llm = LLM(tiny_target, tokenizer=smollm2_gguf_path, **KW)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = _prompts(3, 30, seed=4)
    shared = [prompts[0][:28] + [7, 8, 9]]  # a prefix-cache hit on the first prompt's blocks
    return {
        "batch": [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)],
        "shared": [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in shared], params, use_tqdm=False)],
        "prompts": prompts,
        "shared_prompts": shared,
    }  # fmt: skip


@pytest.mark.parametrize(
    "method, padded",
    [("eagle", False), ("eagle3", False), ("draft_model", False), ("eagle", True),
     ("draft_model", True)],
)  # fmt: skip
def test_drafts_match_a_reference_at_every_step(
    method, padded, request, tiny_target, smollm2_gguf_path, hf_target, plain_outputs
):
    """``padded``: the single-token passes run padded with inert rows, as their CUDA
    graphs do (batches of 1..3 proposing requests padded to 4)."""
    k = 3
    if method == "draft_model":
        from transformers import AutoModelForCausalLM

        path = save_llama(request.getfixturevalue("tmp_path") / "draft", seed=5)
        draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        reference = lambda tokens: model_drafts(draft, tokens, k)  # noqa: E731
    else:
        path = request.getfixturevalue(f"{method}_head")
        weights = read_head_weights(path)
        drafts = eagle_drafts if method == "eagle" else eagle3_drafts
        reference = lambda tokens: drafts(weights, hf_target, tokens, k)  # noqa: E731
    spec = {"method": method, "model": path, "num_speculative_tokens": k}
    llm = LLM(tiny_target, tokenizer=smollm2_gguf_path, speculative_config=spec, **KW)
    if padded:
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        runner.spec_decode.proposer.pad_batches_to = [4, 8]
    outputs, records = run_recording(llm, plain_outputs["prompts"], 10)
    assert outputs == plain_outputs["batch"]
    # The second run hits the first prompt's cached blocks (EAGLE recomputes the last).
    shared, shared_records = run_recording(llm, plain_outputs["shared_prompts"], 10)
    assert shared == plain_outputs["shared"]
    records += shared_records
    assert len(records) > 10
    for tokens, proposed in records:
        assert proposed == reference(tokens)[: len(proposed)], (method, len(tokens))


def test_a_head_checkpoint_without_its_files_is_a_clear_error(
    tiny_target, smollm2_gguf_path, tmp_path
):
    import json
    import shutil

    from tokenmill.hf_config import ModelLoadError

    head = tmp_path / "EAGLE-empty"
    head.mkdir()
    shutil.copy(f"{tiny_target}/config.json", head / "config.json")
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    spec = {"model": str(head), "num_speculative_tokens": 2}
    with pytest.raises(ModelLoadError, match="no \\*.safetensors or pytorch_model.bin"):
        LLM(tiny_target, tokenizer=smollm2_gguf_path, speculative_config=spec, **KW)


def test_an_eagle3_d2t_outside_the_vocabulary_is_refused(
    eagle3_head, tiny_target, smollm2_gguf_path, tmp_path
):
    import shutil

    from safetensors.torch import load_file, save_file

    from tokenmill.hf_config import ModelLoadError

    head = tmp_path / "bad-eagle3"
    shutil.copytree(eagle3_head, head)
    weights = load_file(head / "model.safetensors")
    weights["d2t"] = torch.full_like(weights["d2t"], 10_000)
    save_file(weights, head / "model.safetensors")
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    with pytest.raises(ModelLoadError, match="d2t must map each of the 100 draft tokens"):
        LLM(tiny_target, tokenizer=smollm2_gguf_path, speculative_config=spec, **KW)

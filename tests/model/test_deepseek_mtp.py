"""DeepSeek-V3's multi-token-prediction layer, loaded from the checkpoint's ``model.layers.{L}``
tensors as a draft model: its hidden states and logits equal transformers' ``MtpModel`` on
the same weights (float32, CPU), over its own paged latent cache; the causal LM skips it."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_deepseek_parity import _configs, save_deepseek
from tests.model.tolerance import assert_logits_close
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.hf_config import ModelLoadError
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.model.attention.mla import TorchMLABackend
from tokenmill.model.layers.attention import bind_kv_caches, kv_cache_specs
from tokenmill.model.loader.model_loader import get_model
from tokenmill.model.models.deepseek_mtp import DeepseekMTP

NUM_LAYERS = 3  # the decoder's; the MTP layer is checkpoint layer 3


def _checkpoint_names(mtp, hf_main) -> dict[str, torch.Tensor]:
    """transformers' MTP weights under DeepSeek's checkpoint names (per-expert tensors)."""
    layer = mtp.layers[0]
    prefix = f"model.layers.{NUM_LAYERS}."
    out = {
        prefix + "enorm.weight": layer.enorm.weight,
        prefix + "hnorm.weight": layer.hnorm.weight,
        prefix + "eh_proj.weight": layer.eh_proj.weight,
        prefix + "shared_head.norm.weight": layer.post_norm.weight,
        prefix + "shared_head.head.weight": hf_main.lm_head.weight,
        prefix + "embed_tokens.weight": hf_main.model.embed_tokens.weight,
    }
    block = dict(layer.mtp_block.named_parameters()) | dict(layer.mtp_block.named_buffers())
    for name, tensor in block.items():
        if name == "mlp.experts.gate_up_proj":
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2)
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up
        elif name == "mlp.experts.down_proj":
            for e, w in enumerate(tensor):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = w
        else:
            out[prefix + name] = tensor
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    from safetensors.torch import save_file
    from transformers.modeling_layers import MtpModel

    path = tmp_path_factory.mktemp("v3-mtp")
    hf = save_deepseek(_configs()["v3-qlora-yarn"], path)
    torch.manual_seed(1)
    mtp = MtpModel(hf, 1).float().eval()
    with torch.no_grad():
        # MtpModel leaves some tensors uninitialised: every one is drawn here (its shared
        # embedding and head are the target's).
        for name, param in mtp.layers.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + torch.randn_like(param) * 0.1)
            else:
                param.normal_(0.0, 8 * 0.02 if "mlp.gate.weight" in name else 0.02)
        mtp.layers[0].mtp_block.mlp.gate.e_score_correction_bias.normal_(0, 0.2)
    save_file(_checkpoint_names(mtp, hf), str(path / "model-mtp.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return hf, mtp, str(path)


def _metadata(num_new: int, seq_len: int, block_table: torch.Tensor, block_size: int = 16):
    start = seq_len - num_new
    slots = [int(block_table[p // block_size]) * block_size + p % block_size
             for p in range(start, seq_len)]  # fmt: skip
    qsl = torch.tensor([0, num_new], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=num_new, num_reqs=1, query_start_loc=qsl, seq_lens=lens,
        block_table=block_table[None], slot_mapping=torch.tensor(slots), max_query_len=num_new,
        max_seq_len=seq_len, query_start_loc_cpu=qsl, seq_lens_cpu=lens,
    )  # fmt: skip


def test_draft_layer_matches_transformers(mtp_checkpoint):
    """A 19-token prompt, then one more token through the draft layer's own cache: each
    position's draft logits equal transformers' (input tokens shifted one ahead of the
    target's hidden states)."""
    hf, hf_mtp, path = mtp_checkpoint
    cfg = EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config()
    draft = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchMLABackend,
                      model_cls=DeepseekMTP)  # fmt: skip
    (spec,) = kv_cache_specs(draft)
    cache = torch.zeros(8, 16, spec.head_size)
    bind_kv_caches(draft, [cache])
    ids = torch.randint(0, 320, (1, 21), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        target_hidden = hf(ids, output_hidden_states=True).hidden_states[-1][0]
        positions = torch.arange(1, 21)
        ref = hf_mtp.forward_layer(0, target_hidden[None, :20], positions[None], None,
                                   input_ids=ids[:, 1:21])[0]  # fmt: skip
        ref_logits = hf_mtp._project_to_logits(ref)
        table = torch.tensor([5, 2], dtype=torch.int32)
        # The draft sequence's 20 entries fill cache positions 0..19 (blocks 5, 2); RoPE
        # takes the tokens' positions 1..20.
        first = draft(ids[0, 1:20], positions[:19], target_hidden[:19], _metadata(19, 19, table))
        second = draft(ids[0, 20:21], positions[19:], target_hidden[19:20],
                       _metadata(1, 20, table))  # fmt: skip
        hidden = torch.cat([first, second])
        logits = draft.compute_logits(hidden)
    torch.testing.assert_close(hidden, ref, atol=2e-5, rtol=1e-5)
    assert_logits_close(logits, ref_logits)


def test_the_causal_lm_skips_the_draft_layer(mtp_checkpoint):
    hf, _, path = mtp_checkpoint
    cfg = EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchMLABackend)
    assert len(model.model.layers) == NUM_LAYERS
    assert len(kv_cache_specs(model)) == NUM_LAYERS


def test_a_checkpoint_without_draft_layers_is_named(tmp_path):
    save_deepseek(_configs()["v3-qlora-yarn"], tmp_path)
    cfg = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu").create_engine_config()
    with pytest.raises(ModelLoadError, match=r"no multi-token-prediction layers.*layers\.3"):
        get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchMLABackend,
                  model_cls=DeepseekMTP)  # fmt: skip

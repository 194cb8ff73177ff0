"""BERT embeddings: all-MiniLM-L6-v2 against sentence-transformers, and tiny random BERTs
against transformers with each pooling (mean, CLS, last token), through ``LLM.embed``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.model.minilm import (
    SENTENCES,
    TOKENIZER_FILES,
    minilm_folder,
    sentence_transformers_embeddings,
)
from tokenmill import LLM
from tokenmill.config import ConfigError, LoadConfig, PoolerConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.hf_config import ModelLoadError
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.layers.pooler import (
    Pooler,
    parse_pooler_config,
    read_sentence_transformers_config,
    resolve_pooler_config,
)
from tokenmill.model.loader.model_loader import get_model
from tokenmill.model.registry import is_pooling_model


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM(minilm_folder())


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    """sentence-transformers' embeddings of SENTENCES: ``[10, 384]`` float32."""
    return sentence_transformers_embeddings(SENTENCES)


def _vectors(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


# ---- all-MiniLM-L6-v2 ----------------------------------------------------------------------


def test_minilm_config_from_sentence_transformers_files(minilm):
    mc = minilm.model_config
    assert is_pooling_model(mc.architecture)
    assert mc.pooler_config == PoolerConfig("MEAN", True)
    assert mc.max_model_len == 256  # sentence_bert_config.json, not the 512 positions


def test_minilm_matches_sentence_transformers(minilm, reference):
    outputs = minilm.embed(SENTENCES)
    lengths = [len(o.prompt_token_ids) for o in outputs]
    assert min(lengths) <= 4 and max(lengths) >= 60  # one batch mixing short and long inputs
    ours = _vectors(outputs)
    cosine = F.cosine_similarity(ours, reference)
    assert cosine.min().item() >= 0.9999, cosine
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(SENTENCES)))


def test_minilm_batch_does_not_change_an_embedding(minilm):
    batched = _vectors(minilm.embed(SENTENCES))
    alone = torch.cat([_vectors(minilm.embed(s)) for s in SENTENCES])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)


def test_minilm_token_ids_equal_text(minilm):
    text = minilm.embed(SENTENCES[1])[0]
    ids = text.prompt_token_ids
    assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]
    for prompt in (ids, {"prompt_token_ids": ids}, {"prompt": SENTENCES[1]}):
        out = minilm.embed(prompt)[0]
        assert out.prompt_token_ids == ids
        assert out.outputs.embedding == text.outputs.embedding


def test_minilm_too_long_input_and_truncation(minilm):
    long_text = "word " * 400
    with pytest.raises(ValueError, match=r"maximum input length is 256 tokens.*402 tokens"):
        minilm.embed(["short", long_text])
    # sentence-transformers cuts inputs to max_seq_length (right side, [SEP] kept): so does
    # truncate_prompt_tokens=-1.
    reference = sentence_transformers_embeddings([long_text])
    out = minilm.embed(long_text, truncate_prompt_tokens=-1)[0]
    assert len(out.prompt_token_ids) == 256 and out.prompt_token_ids[-1] == 102
    assert F.cosine_similarity(_vectors([out]), reference).item() >= 0.9999
    assert len(minilm.embed(long_text, truncate_prompt_tokens=10)[0].prompt_token_ids) == 10
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        minilm.embed("x", truncate_prompt_tokens=300)


def test_minilm_rejects_bad_inputs(minilm):
    with pytest.raises(ValueError, match="empty"):
        minilm.embed([""])
    with pytest.raises(ValueError, match="empty"):
        minilm.embed({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="out of the vocabulary"):
        minilm.embed([[101, 30522, 102]])
    with pytest.raises(ValueError, match="dimensions"):
        minilm.embed("x", dimensions=64)


def test_generate_on_embedding_model_is_a_clear_error(minilm):
    with pytest.raises(ValueError, match="embedding model.*LLM.embed"):
        minilm.generate("hello")
    with pytest.raises(ValueError, match="embedding model"):
        minilm.chat([{"role": "user", "content": "hello"}])


# ---- tiny random BERTs vs transformers -------------------------------------------------------


def _tiny_bert_config(**overrides):
    from transformers import BertConfig

    values = dict(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        type_vocab_size=2,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
    )
    values.update(overrides)
    return BertConfig(**values)


def _save_tiny(path, hf_model) -> str:
    hf_model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(minilm_folder(), name), path / name)
    return str(path)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A 2-layer random BertModel saved as safetensors (no sentence-transformers files)."""
    from transformers import BertModel

    torch.manual_seed(0)
    model = BertModel(_tiny_bert_config(), add_pooling_layer=True).eval()
    return _save_tiny(tmp_path_factory.mktemp("tiny-bert"), model), model


@pytest.fixture(scope="module")
def tiny_mlm(tmp_path_factory):
    """A random BertForMaskedLM (``bert.*`` names plus an MLM head) with the tanh-GELU."""
    from transformers import BertForMaskedLM

    torch.manual_seed(1)
    model = BertForMaskedLM(_tiny_bert_config(hidden_act="gelu_new")).eval()
    return _save_tiny(tmp_path_factory.mktemp("tiny-mlm"), model), model


def _tokenmill_bert(folder: str):
    config = EngineArgs(model=folder, dtype="float32", device="cpu").create_engine_config()
    model = get_model(config.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    return model, config.model_config


ROWS = [
    [101, 2023, 2003, 1037, 3231, 102],
    [101, 7592, 102],
    [101] + list(range(2000, 2040)) + [102],
]


def _padded(rows):
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    return ids, mask


def _reference_states(hf_encoder, rows) -> list[torch.Tensor]:
    """transformers' last hidden states of each row run alone (no padding): ``[len, H]``."""
    with torch.no_grad():
        return [hf_encoder(input_ids=torch.tensor([r])).last_hidden_state[0] for r in rows]


@pytest.mark.parametrize("fixture", ["tiny_bert", "tiny_mlm"])
def test_tiny_bert_hidden_states_match_transformers(fixture, request):
    folder, hf_model = request.getfixturevalue(fixture)
    model, _ = _tokenmill_bert(folder)
    ids, mask = _padded(ROWS)
    with torch.no_grad():
        hidden = model(ids, mask)
    hf_encoder = hf_model if fixture == "tiny_bert" else hf_model.bert
    for i, ref in enumerate(_reference_states(hf_encoder, ROWS)):
        torch.testing.assert_close(hidden[i, : len(ROWS[i])], ref, atol=1e-5, rtol=1e-5)


def test_tiny_bert_token_types_match_transformers(tiny_bert):
    folder, hf_model = tiny_bert
    model, _ = _tokenmill_bert(folder)
    ids, mask = _padded(ROWS[:1])
    types = torch.tensor([[0, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        ours = model(ids, mask, types)
        ref = hf_model(input_ids=ids, token_type_ids=types).last_hidden_state
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS", "LAST"])
@pytest.mark.parametrize("normalize", [True, False])
def test_tiny_bert_pooling_through_llm_embed(tiny_bert, pooling_type, normalize):
    folder, hf_model = tiny_bert
    llm = _tiny_llm(folder, pooling_type, normalize)
    assert llm.model_config.max_model_len == 128
    ours = _vectors(llm.embed(ROWS))
    for i, states in enumerate(_reference_states(hf_model, ROWS)):
        expected = {"MEAN": states.mean(0), "CLS": states[0], "LAST": states[-1]}[pooling_type]
        if normalize:
            expected = expected / expected.norm()
        torch.testing.assert_close(ours[i], expected, atol=1e-5, rtol=1e-5)


_TINY_LLMS: dict[tuple[str, str, bool], LLM] = {}


def _tiny_llm(folder: str, pooling_type: str, normalize: bool) -> LLM:
    key = (folder, pooling_type, normalize)
    if key not in _TINY_LLMS:
        config = {"pooling_type": pooling_type, "normalize": normalize}
        # The CLI form (JSON text) for one half, the Python form (a dict) for the other.
        _TINY_LLMS[key] = LLM(folder, pooler_config=json.dumps(config) if normalize else config)
    return _TINY_LLMS[key]


def test_pooler_ignores_padding():
    hidden = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    padded = hidden.clone()
    padded[0, 3:] = 1e6  # garbage at padded positions must not leak into the result
    for pooling_type in ("MEAN", "CLS", "LAST"):
        pooler = Pooler(PoolerConfig(pooling_type, False))
        torch.testing.assert_close(pooler(padded, mask)[0], pooler(hidden[:1, :3], mask[:1, :3])[0])
    assert Pooler(PoolerConfig("LAST", False))(hidden, mask)[0].equal(hidden[0, 2])
    normalized = Pooler(PoolerConfig("CLS", True))
    out = normalized.postprocess(normalized(hidden, mask), dimensions=4)
    assert out.shape == (2, 4)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(2))
    torch.testing.assert_close(out[0], F.normalize(hidden[0, 0, :4], dim=0))


# ---- sentence-transformers files -------------------------------------------------------------


def _st_folder(tmp_path, modules, pooling=None, max_seq_length=None):
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if max_seq_length is not None:
        (tmp_path / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length})
        )
    return str(tmp_path)


TRANSFORMER = {
    "idx": 0,
    "name": "0",
    "path": "",
    "type": "sentence_transformers.models.Transformer",
}
POOLING = {
    "idx": 1,
    "name": "1",
    "path": "1_Pooling",
    "type": "sentence_transformers.models.Pooling",
}
NORMALIZE = {
    "idx": 2,
    "name": "2",
    "path": "2_Normalize",
    "type": "sentence_transformers.models.Normalize",
}


def test_st_config_cls_without_normalize(tmp_path):
    folder = _st_folder(
        tmp_path,
        [TRANSFORMER, POOLING],
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
        64,
    )
    st = read_sentence_transformers_config(folder)
    assert (st.pooling_type, st.normalize, st.max_seq_length) == ("CLS", False, 64)
    assert resolve_pooler_config(folder) == (PoolerConfig("CLS", False), 64)
    # An override replaces only the fields it sets.
    assert resolve_pooler_config(folder, PoolerConfig(normalize=True))[0] == PoolerConfig(
        "CLS", True
    )


def test_st_config_pooling_mode_string(tmp_path):
    folder = _st_folder(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode": "lasttoken"})
    assert resolve_pooler_config(folder) == (PoolerConfig("LAST", True), None)


def test_st_config_without_files_defaults_to_cls_normalized(tmp_path):
    assert resolve_pooler_config(str(tmp_path)) == (PoolerConfig("CLS", True), None)


@pytest.mark.parametrize(
    "modules,pooling,match",
    [
        ([TRANSFORMER, POOLING], {"pooling_mode_max_tokens": True}, "pooling mode"),
        (
            [
                TRANSFORMER,
                POOLING,
                {"path": "2_Dense", "type": "sentence_transformers.models.Dense"},
            ],
            {"pooling_mode_mean_tokens": True},
            "Dense",
        ),
    ],
)
def test_st_config_unsupported_is_an_error(tmp_path, modules, pooling, match):
    folder = _st_folder(tmp_path, modules, pooling)
    with pytest.raises(ModelLoadError, match=match):
        read_sentence_transformers_config(folder)


def test_parse_pooler_config():
    assert parse_pooler_config('{"pooling_type": "mean"}') == PoolerConfig("mean", None)
    assert parse_pooler_config({"normalize": False}) == PoolerConfig(None, False)
    for bad in ("{not json", "[1]", '{"pooling": "MEAN"}'):
        with pytest.raises(ConfigError):
            parse_pooler_config(bad)
    with pytest.raises(ConfigError, match="pooling_type"):
        resolve_pooler_config("/nonexistent", PoolerConfig("MAX"))


def test_max_seq_length_caps_the_context(tiny_bert, tmp_path):
    folder, _ = tiny_bert
    copy = tmp_path / "capped"
    shutil.copytree(folder, copy)
    (copy / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    mc = EngineArgs(model=str(copy)).create_engine_config().model_config
    assert mc.max_model_len == 16 and mc.pooler_config == PoolerConfig("CLS", True)
    with pytest.raises(ConfigError, match="maximum context length of 16"):
        EngineArgs(model=str(copy), max_model_len=32).create_engine_config()


def test_pooler_config_on_a_generative_model_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "vocab_size": 30522,
                "intermediate_size": 32,
            }
        )
    )
    with pytest.raises(ConfigError, match="embedding models only"):
        EngineArgs(
            model=str(tmp_path), pooler_config='{"pooling_type": "CLS"}'
        ).create_engine_config()


def test_embed_on_a_generative_model_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "vocab_size": 30522,
                "intermediate_size": 32,
                "max_position_embeddings": 64,
            }
        )
    )
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(minilm_folder(), name), tmp_path / name)
    llm = LLM(str(tmp_path), load_format="dummy", kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="not an embedding model"):
        llm.embed("hello")

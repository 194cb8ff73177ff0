"""BERT (Devlin et al. 2019, arXiv:1810.04805) as a sentence encoder: all-MiniLM-L6-v2 and kin.

Post-norm encoder layers: bidirectional self-attention (merged QKV, a key padding mask) ->
add & LayerNorm -> GELU MLP -> add & LayerNorm. An encoder needs no KV cache: each input is
one forward pass over a right-padded batch ``[B, L]``; the pooler (model/layers/pooler.py)
turns the token states into one vector per input.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.hf_config import HFConfig, ModelLoadError
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.layers.embedding import VocabEmbedding
from tokenmill.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenmill.model.loader.weights import load_model_weights

# config.json ``hidden_act`` -> the activation of the MLP (no gate: BERT's MLP is not GLU).
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
# Checkpoint tensors that are not part of the encoder: BERT's next-sentence pooler
# (tanh(W h_[CLS]), which sentence-transformers does not use), the masked-LM head, and the
# position-id buffer transformers saves.
_IGNORED_PREFIXES = ("pooler.", "cls.")
_IGNORED_NAMES = ("embeddings.position_ids",)


class BertEmbeddings(nn.Module):
    """Token + absolute position + token type embeddings, then LayerNorm.

    ``forward(input_ids [B, L] int64, token_type_ids [B, L] int64 | None) -> [B, L, H]``;
    positions are ``0 .. L-1`` in every row (inputs are right-padded).
    """

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabEmbedding(config.vocab_size, hidden)
        self.position_embeddings = VocabEmbedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = VocabEmbedding(config.get("type_vocab_size", 2), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-12))

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            # Single-segment inputs: every token has type 0.
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    """Bidirectional multi-head attention: ``[B, L, H] -> [B, L, H]`` (before the output
    projection), keys masked where the input is padding."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, num_heads, num_heads, bias=True
        )
        self.num_heads = self.qkv_proj.num_heads

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """``key_mask``: ``[B, 1, 1, L]`` bool, True where a key may be attended to."""
        batch, length, _ = x.shape
        q, k, v = (
            t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
            for t in self.qkv_proj(x).chunk(3, dim=-1)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)


class BertResidualOutput(nn.Module):
    """``LayerNorm(dense(x) + residual)``: the post-norm sublayer exit of BERT."""

    def __init__(self, input_size: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.dense = RowParallelLinear(input_size, hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    """Self-attention and its residual output; names follow the checkpoint's
    (``attention.self.*``, ``attention.output.*``)."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        eps = config.get("layer_norm_eps", 1e-12)
        self.self = BertSelfAttention(config)
        self.output = BertResidualOutput(config.hidden_size, config.hidden_size, eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, key_mask), x)


class BertIntermediate(nn.Module):
    """The MLP's up projection and activation: ``[B, L, H] -> [B, L, I]``."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        hidden_act = config.get("hidden_act", "gelu")
        if hidden_act not in _ACTIVATIONS:
            raise ModelLoadError(
                f"BERT hidden_act {hidden_act!r} is not supported; supported: "
                f"{sorted(_ACTIVATIONS)}"
            )
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.act_fn = _ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_fn(self.dense(x))


class BertLayer(nn.Module):
    """One post-norm encoder layer: ``[B, L, H] -> [B, L, H]``."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        eps = config.get("layer_norm_eps", 1e-12)
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertResidualOutput(config.intermediate_size, config.hidden_size, eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, key_mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, key_mask)
        return x


class BertModel(nn.Module):
    """The BERT encoder (no pooler head): token ids -> contextual token states.

    ``forward(input_ids [B, L] int64, attention_mask [B, L] bool, token_type_ids [B, L] int64
    | None) -> hidden [B, L, H]`` in the model's dtype. ``attention_mask`` is True on real
    tokens; rows are right-padded, and padded positions' outputs are meaningless (the pooler
    masks them out).

    Args:
        model_config: the model; only absolute position embeddings are supported.
        backend: unused (an encoder has no paged KV cache); taken so the generic loader can
            build every architecture the same way.

    Raises:
        ModelLoadError: an unsupported ``position_embedding_type`` or ``hidden_act``.
    """

    # (merged parameter, checkpoint part, shard id)
    stacked_params_mapping = [
        ("qkv_proj", "query", "q"),
        ("qkv_proj", "key", "k"),
        ("qkv_proj", "value", "v"),
    ]

    def __init__(
        self, model_config: ModelConfig, backend: type[AttentionBackend] | None = None
    ) -> None:
        super().__init__()
        config = model_config.hf_config
        position_type = config.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ModelLoadError(
                f"BERT position_embedding_type {position_type!r} is not supported (absolute only)"
            )
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        key_mask = attention_mask.bool()[:, None, None, :]
        return self.encoder(self.embeddings(input_ids, token_type_ids), key_mask)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        """Load a Hugging Face BERT checkpoint (names with or without the ``bert.`` prefix;
        the NSP pooler and MLM head are ignored).

        Raises:
            ModelLoadError: a missing, unexpected or wrongly shaped tensor.
        """
        load_model_weights(
            self, _encoder_weights(weights), self.stacked_params_mapping, source=source
        )


class BertForMaskedLM(BertModel):
    """A masked-LM checkpoint served as an encoder: its ``bert.*`` tensors, head ignored."""


def _encoder_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors renamed to BertModel's parameters; the rest dropped."""
    for name, tensor in weights:
        name = name.removeprefix("bert.")
        if name.startswith(_IGNORED_PREFIXES) or name in _IGNORED_NAMES:
            continue
        # Checkpoints from the original TensorFlow port name LayerNorm's affine gamma/beta.
        if name.endswith(".gamma"):
            name = name[: -len("gamma")] + "weight"
        elif name.endswith(".beta"):
            name = name[: -len("beta")] + "bias"
        yield name, tensor

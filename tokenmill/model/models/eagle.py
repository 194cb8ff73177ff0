"""EAGLE draft heads over a Llama-style target (Li et al. 2024, "EAGLE: Speculative Sampling
Requires Rethinking Feature Uncertainty", arXiv:2401.15077; "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test", arXiv:2503.01840).

A head reads, at position ``p``, the token at ``p + 1`` and a feature of the target at ``p``,
and predicts the token at ``p + 2``; drafting further, it reads its own output as the next
position's feature. The checkpoints are those the EAGLE authors publish (and vLLM loads):

- EAGLE (``eagle``): ``fc.weight`` ``[H, 2H]`` (``fc.bias`` if trained with one) over
  ``[embedding; feature]``, then Llama decoder layers ``layers.{i}.*`` whose first has no
  input norm (its ``input_layernorm.weight`` is ignored); the output ``hidden + residual``
  is both the next feature and, under the target's LM head, the logits. The feature is the
  target's final hidden state. The embedding is the target's.
- EAGLE-3 (``eagle3``): ``fc.weight`` ``[H, 3 H_target]`` fuses the target's residual stream
  at three layers into the first feature; one layer ``midlayer.*`` normalises the embedding
  (``input_layernorm``) and the feature (``hidden_norm``) and attends over their
  concatenation (``q/k/v_proj`` of input ``2H``), the feature being the residual; ``norm``
  and ``lm_head`` ``[draft_vocab, H]`` give logits over a draft vocabulary, mapped to the
  target's by ``d2t`` (``target_id = draft_id + d2t[draft_id]``; ``t2d`` is ignored).
  The embedding is ``embed_tokens.weight`` where the checkpoint has one, else the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.hf_config import ModelLoadError
from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.embedding import LMHead, VocabEmbedding
from tokenmill.model.layers.linear import QKVParallelLinear, ReplicatedLinear
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.loader.weights import load_model_weights
from tokenmill.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

STACKED_PARAMS = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def _biases(config) -> tuple[bool, bool]:
    bias = bool(config.get("attention_bias", False))
    return bias, bias


class EagleHead(nn.Module):
    """An EAGLE head: ``forward(ids [T], positions [T], feature [T, H], metadata) ->
    (states for the logits [T, H], next feature [T, H])``.

    Args:
        model_config: the head's configuration (its config.json).
        backend: the attention backend.
        fc_bias: the checkpoint has ``fc.bias``.
    """

    def __init__(
        self, model_config: ModelConfig, backend: type[AttentionBackend], fc_bias: bool = False
    ) -> None:
        super().__init__()
        config = model_config.hf_config
        hidden = config.hidden_size
        self.embed_tokens: VocabEmbedding | None = None  # the target's, set by ``share``
        self.lm_head: nn.Module | None = None
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=fc_bias)
        qkv_bias, o_bias = _biases(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, model_config.max_model_len, backend, qkv_bias, o_bias)
            for i in range(config.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()

    def share(self, target: nn.Module) -> None:
        """Use the target's embedding and LM head."""
        self.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        feature: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.embed_tokens is not None
        hidden = self.fc(torch.cat([self.embed_tokens(input_ids), feature], dim=-1))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        out = hidden + residual
        return out, out

    def combine_features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The first pass's feature from what the target gives (its final hidden state)."""
        return target_hidden

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64: the target vocabulary's argmax of the logits of ``hidden``."""
        assert self.lm_head is not None
        return self.lm_head(hidden).argmax(dim=-1)

    def load_weights(self, weights: dict[str, torch.Tensor], source: str) -> None:
        skip = ("embed_tokens.weight", "layers.0.input_layernorm.weight", "lm_head.weight")
        load_model_weights(
            self, ((n, t) for n, t in weights.items() if n not in skip), STACKED_PARAMS,
            source=source,
        )  # fmt: skip


class Eagle3Layer(nn.Module):
    """EAGLE-3's layer: attention over ``[norm(embedding); norm(feature)]``, the feature as
    the residual, then Llama's MLP."""

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__()
        config = model_config.hf_config
        hidden, eps = config.hidden_size, config.get("rms_norm_eps", 1e-6)
        qkv_bias, o_bias = _biases(config)
        self.self_attn = LlamaAttention(
            config, 0, model_config.max_model_len, backend, qkv_bias, o_bias
        )
        attn = self.self_attn
        heads, kv_heads = attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads
        attn.qkv_proj = QKVParallelLinear(2 * hidden, attn.qkv_proj.head_dim, heads, kv_heads,
                                          qkv_bias)  # fmt: skip
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = LlamaMLP(hidden, config.intermediate_size, config.get("hidden_act", "silu"),
                            bias=config.get("mlp_bias", False))  # fmt: skip

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        feature: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)
        hidden = self.self_attn(positions, x, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, feature)
        return self.mlp(hidden), residual


class Eagle3Head(nn.Module):
    """An EAGLE-3 head; the interface of ``EagleHead``.

    Args:
        model_config: the head's configuration (``draft_vocab_size``, ``target_hidden_size``).
        backend: the attention backend.
        own_embedding: the checkpoint has ``embed_tokens.weight``.

    Raises:
        ValueError: more than one layer (the published heads have one).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        backend: type[AttentionBackend],
        own_embedding: bool = False,
    ) -> None:
        super().__init__()
        config = model_config.hf_config
        if config.num_hidden_layers != 1:
            raise ValueError(f"EAGLE-3 heads have one layer, this one {config.num_hidden_layers}")
        hidden = config.hidden_size
        target_hidden = config.get("target_hidden_size") or hidden
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = config.get("draft_vocab_size") or config.vocab_size
        self.embed_tokens = (
            VocabEmbedding(config.vocab_size, hidden) if own_embedding else None
        )
        self.fc = ReplicatedLinear(3 * target_hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(model_config, backend)
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6))
        self.lm_head = LMHead(self.draft_vocab_size, hidden)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))

    def share(self, target: nn.Module) -> None:
        """Use the target's embedding unless the checkpoint brought its own."""
        if self.embed_tokens is None:
            self.embed_tokens = target.model.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        feature: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.embed_tokens is not None
        hidden, residual = self.midlayer(positions, self.embed_tokens(input_ids), feature,
                                         metadata)  # fmt: skip
        return self.norm(hidden, residual)

    def combine_features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The first pass's feature: ``fc`` over the target's three layers' residual
        streams (``[T, 3 H_target]``)."""
        return self.fc(target_hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        draft = self.lm_head(hidden).argmax(dim=-1)
        return draft + self.d2t[draft]

    def load_weights(self, weights: dict[str, torch.Tensor], source: str) -> None:
        """Load the checkpoint's tensors.

        Raises:
            ModelLoadError: a tensor that fits no parameter, a missing one, or a ``d2t``
                that maps a draft token outside the target's vocabulary.
        """
        d2t = weights.pop("d2t", None)
        if d2t is not None:
            d2t = d2t.to(torch.int64)
            targets = torch.arange(len(d2t)) + d2t
            if len(d2t) != self.draft_vocab_size or not (
                (targets >= 0) & (targets < self.vocab_size)
            ).all():
                raise ModelLoadError(
                    f"{source}: d2t must map each of the {self.draft_vocab_size} draft tokens "
                    f"into the target's {self.vocab_size}"
                )
            self.d2t.copy_(d2t)
        weights.pop("t2d", None)
        # Some EAGLE-3 checkpoints name the layer as the first of a stack.
        renamed = {
            ("midlayer." + n[len("layers.0.") :] if n.startswith("layers.0.") else n): t
            for n, t in weights.items()
        }
        load_model_weights(self, renamed.items(), STACKED_PARAMS, source=source)

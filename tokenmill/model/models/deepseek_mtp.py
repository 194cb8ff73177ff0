"""DeepSeek-V3's multi-token prediction (MTP) modules (arXiv:2412.19437, section 2.2) as a
draft model for speculative decoding.

A checkpoint with ``num_nextn_predict_layers = n`` stores ``n`` modules as the layers
``model.layers.{L} .. {L + n - 1}`` after its ``L = num_hidden_layers`` decoder layers. Module
``k`` predicts the token ``k + 2`` ahead: from the previous depth's hidden state ``h`` at
position ``i`` (the target model's final hidden state, after its norm, for ``k = 0``) and the
embedding of token ``i + 1`` it computes

    h' = decoder_layer(eh_proj([enorm(embed(t_{i+1})) | hnorm(h)]))
    logits = shared_head.head(shared_head.norm(h'))

where ``decoder_layer`` is a full DeepSeek layer (MLA with its own latent cache, MoE).
``forward`` returns ``shared_head.norm(h')``, which is also what depth ``k + 1`` takes as its
previous hidden state (as transformers' ``MtpModel`` chains them).

How a proposer uses it::

    mtp = get_model(model_config, load_config, device, backend, model_cls=DeepseekMTP)
    bind_kv_caches(mtp, caches)     # one latent cache per module, shapes from kv_cache_specs(mtp)
    hidden = mtp(next_ids, positions, target_hidden, metadata)   # depth 0
    draft = mtp.compute_logits(hidden).argmax(-1)

``next_ids[j]`` is the token after the one whose target hidden state is
``target_hidden[j]``; ``positions`` are those tokens' positions and ``metadata`` the draft
layer's own attention metadata (its block table and slots; every token whose hidden state
is given is written to its cache, like a target layer's). RoPE is relative, so the positions
may equally be the hidden states' own (vLLM's choice), as long as they are consistent.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.hf_config import HFConfig, ModelLoadError
from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.embedding import LMHead, VocabEmbedding
from tokenmill.model.layers.linear import ReplicatedLinear
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.loader.weights import load_model_weights
from tokenmill.model.models.decoder import PreNormDecoderLayer
from tokenmill.model.models.deepseek_v2 import DeepseekV2DecoderLayer, deepseek_params_mapping


def num_mtp_layers(config: HFConfig) -> int:
    """The multi-token-prediction modules a DeepSeek checkpoint carries (0 if none)."""
    return int(config.get("num_nextn_predict_layers") or 0)


class SharedHead(nn.Module):
    """An MTP module's output norm and LM head (``shared_head.norm``, ``shared_head.head``)."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.get("rms_norm_eps", 1e-6))
        self.head = LMHead(config.vocab_size, config.hidden_size)


class DeepseekMTPLayer(DeepseekV2DecoderLayer):
    """One MTP module: a DeepSeek decoder layer (checkpoint layer ``layer_idx``, its latent
    cache ``cache_idx``) with the input projection and the output head around it."""

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        cache_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
    ) -> None:
        super().__init__(config, layer_idx, max_model_len, backend, True, cache_idx)
        eps = config.get("rms_norm_eps", 1e-6)
        self.enorm = RMSNorm(config.hidden_size, eps)
        self.hnorm = RMSNorm(config.hidden_size, eps)
        self.eh_proj = ReplicatedLinear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def predict(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        previous_hidden: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``shared_head.norm`` of the layer's output: ``[T, H]``."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous_hidden)], dim=-1))
        hidden, residual = PreNormDecoderLayer.forward(self, positions, x, None, metadata)
        return self.shared_head.norm(hidden, residual)[0]


class DeepseekMTP(nn.Module):
    """The MTP modules of a DeepSeek-V3 checkpoint (see the module docstring).

    ``forward(input_ids [T] int64, positions [T] int64, previous_hidden [T, H], metadata,
    depth=0) -> [T, H]``; ``compute_logits(hidden [N, H], depth=0) -> [N, vocab]``.
    Module ``k``'s attention layer has ``layer_idx = k``: bind one latent cache per module.

    Raises:
        ValueError: the config has no MTP modules (``num_nextn_predict_layers``).
    """

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.config = c = model_config.hf_config
        n = num_mtp_layers(c)
        if n < 1:
            raise ValueError(
                f"{model_config.model} has no multi-token-prediction layers "
                "(num_nextn_predict_layers)"
            )
        self.first_layer = c.num_hidden_layers
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleDict(
            {
                str(self.first_layer + k): DeepseekMTPLayer(
                    c, self.first_layer + k, k, model_config.max_model_len, backend
                )
                for k in range(n)
            }
        )
        self.stacked_params_mapping = deepseek_params_mapping(c)

    def _layer(self, depth: int) -> DeepseekMTPLayer:
        return self.model.layers[str(self.first_layer + depth)]  # type: ignore[return-value]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        metadata: AttentionMetadata,
        depth: int = 0,
    ) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids)
        return self._layer(depth).predict(positions, embeds, previous_hidden, metadata)

    def compute_logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return self._layer(depth).shared_head.head(hidden)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        """Load the MTP layers' tensors (and skip the decoder's). A module's embedding and
        head come from its own ``embed_tokens`` / ``shared_head.head`` where the checkpoint
        has them (DeepSeek's), else from the target's ``model.embed_tokens`` and
        ``lm_head`` (checkpoints that share them).

        Raises:
            ModelLoadError: the checkpoint has no MTP layers, or a tensor is missing.
        """
        load_model_weights(
            self, self._mtp_tensors(weights, source), self.stacked_params_mapping,
            source=source,
        )  # fmt: skip

    def _mtp_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        layers = {int(k) for k in self.model.layers}
        pattern = re.compile(r"model\.layers\.(\d+)\.(.+)")
        fallback: dict[str, torch.Tensor] = {}
        have: set[str] = set()
        for name, tensor in weights:
            m = pattern.fullmatch(name)
            if m is not None and int(m.group(1)) in layers:
                if m.group(2) == "embed_tokens.weight":
                    name = "model.embed_tokens.weight"
                    if name in have:
                        continue
                have.add(name)
                yield name, tensor
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                fallback[name] = tensor
        if not have:
            raise ModelLoadError(
                f"{source}: no multi-token-prediction layers (model.layers.{min(layers)}.*)"
            )
        if "model.embed_tokens.weight" not in have and "model.embed_tokens.weight" in fallback:
            yield "model.embed_tokens.weight", fallback["model.embed_tokens.weight"]
        for i in sorted(layers):
            head = f"model.layers.{i}.shared_head.head.weight"
            if head not in have and "lm_head.weight" in fallback:
                yield head, fallback["lm_head.weight"]

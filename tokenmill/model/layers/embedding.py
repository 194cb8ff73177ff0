"""Token embedding and the LM head (tied to the embedding or separate)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import current_kernel_config
from tokenmill.model.layers.dense import dense
from tokenmill.model.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    """Token id -> vector. ``forward(ids [T] int) -> [T, embedding_dim]``.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: hidden size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        # Set when the checkpoint's embeddings stay quantized (GGUF blocks).
        self.quant_method: Any = None

    def set_quant_method(self, method: Any) -> None:
        """Keep the checkpoint's quantized blocks in ``method`` instead of a float weight
        (``weight`` becomes an empty placeholder that receives the checkpoint tensor)."""
        self.quant_method = method
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        placeholder.weight_loader = self.weight_loader
        self.weight = placeholder

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.quant_method is not None:
            self.quant_method.load(self, loaded)
            return
        default_weight_loader(param, loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embed(input_ids)
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    """Hidden states -> logits over the vocabulary: ``[N, H] -> [N, V]``.

    When ``tie_word_embeddings`` is set the model points ``weight`` at the embedding's.
    ``soft_cap`` (Gemma 2/3) applies ``cap * tanh(logits / cap)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, soft_cap: float | None = None):
        super().__init__(num_embeddings, embedding_dim)
        self.soft_cap = soft_cap
        self.skinny_gemm = current_kernel_config().skinny_gemm

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.quant_method is not None:
            logits = self.quant_method.apply(hidden_states)
        else:
            logits = dense(hidden_states, self.weight, skinny=self.skinny_gemm)
        if self.soft_cap:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits

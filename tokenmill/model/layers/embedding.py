"""Token embedding and the LM head (tied to the embedding or separate), vocabulary-parallel.

With tensor parallelism each rank holds a contiguous ``ceil(V / tp)``-row slice of the
vocabulary (the last slice padded with zero rows): the embedding looks up the ids in its
slice, zeroes the others and sums over the ranks; the LM head computes the logits of its
slice and gathers them (Megatron-LM, Shoeybi et al. 2019).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import current_kernel_config
from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from tokenmill.math_utils import cdiv
from tokenmill.model.layers.dense import dense
from tokenmill.model.layers.linear import default_weight_loader
from tokenmill.model.layers.weight_shape import check_shape


class VocabEmbedding(nn.Module):
    """Token id -> vector. ``forward(ids [T] int) -> [T, embedding_dim]``.

    Args:
        num_embeddings: vocabulary size ``V``.
        embedding_dim: hidden size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = get_tensor_model_parallel_world_size()
        per_rank = cdiv(num_embeddings, self.tp_size)
        self.vocab_start = get_tensor_model_parallel_rank() * per_rank
        self.vocab_end = min(num_embeddings, self.vocab_start + per_rank)
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim), requires_grad=False)
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
        if self.quant_method is not None:  # one rank only (config_checks)
            self.quant_method.load(self, loaded)
            return
        if self.tp_size == 1:
            default_weight_loader(param, loaded)
            return
        name = getattr(param, "_tm_name", "?")
        check_shape(name, (self.num_embeddings, self.embedding_dim), loaded.shape)
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embed(input_ids)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        hidden = F.embedding(local, self.weight).masked_fill(outside[:, None], 0)
        return tensor_model_parallel_all_reduce(hidden)


class LMHead(VocabEmbedding):
    """Hidden states -> logits over the vocabulary: ``[N, H] -> [N, V]``.

    When ``tie_word_embeddings`` is set the model points ``weight`` at the embedding's (the
    same vocabulary slice on every rank). ``soft_cap`` (Gemma 2/3) applies
    ``cap * tanh(logits / cap)``.
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
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits)[:, : self.num_embeddings]
        if self.soft_cap:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits

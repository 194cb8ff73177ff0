"""A separate, smaller draft model that shares the target's tokenizer (vLLM's ``draft_model``
method, Leviathan et al. 2023): any causal LM tokenmill serves, on the target's device and in
its dtype, with its KV in the target's blocks (``model_proposer.py``)."""

from __future__ import annotations

import torch

from tokenmill.config import LoadConfig
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.model.loader.model_loader import get_model
from tokenmill.worker.proposers.model_proposer import ModelProposer


class DraftModelProposer(ModelProposer):
    """Greedy drafts of a draft model (``SpeculativeConfig.draft_model_config``).

    Args:
        config: the engine configuration; the draft loads like the target (random weights
            when the target's ``--load-format`` is ``dummy``).
        device: the target's device.
    """

    def load_model(self, target: torch.nn.Module) -> None:
        spec = self.config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        dummy = self.config.load_config.load_format == "dummy"
        self.module = get_model(
            spec.draft_model_config,
            LoadConfig("dummy" if dummy else "auto"),
            self.device,
            self.attn_backend,
            self.config.kernel_config,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.module is not None
        return self.module(input_ids, positions, metadata), None

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.module is not None
        return self.module.compute_logits(hidden).argmax(dim=-1)  # type: ignore[operator]

"""EAGLE, EAGLE-3 and MTP proposers: heads that read the target's hidden states
(``model/models/eagle.py`` for the heads and their checkpoints; ``model_proposer.py`` for
the passes). MTP layers are the target's own (``SupportsMTP``); no model in tokenmill ships
them yet, and ``--speculative-config`` refuses ``mtp`` for models without them.
"""

from __future__ import annotations

import glob
import os
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from tokenmill.config import EngineConfig, kernel_config_scope
from tokenmill.hf_config import ModelLoadError
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.model.loader.model_loader import torch_dtype
from tokenmill.model.loader.weights import initialize_dummy_weights
from tokenmill.model.models.eagle import Eagle3Head, EagleHead
from tokenmill.spec_decode.proposer import VerifiedStep
from tokenmill.worker.proposers.model_proposer import ModelProposer


@runtime_checkable
class SupportsMTP(Protocol):
    """A target model with multi-token-prediction layers (e.g. DeepSeek-V3's): its
    ``mtp_head()`` is a module with ``EagleHead``'s interface (``forward``,
    ``combine_features``, ``greedy_tokens``) whose attention layers are not among the
    target's own (the target's KV caches are bound by layer index). Its model class sets
    ``supports_mtp = True``."""

    supports_mtp: bool

    def mtp_head(self) -> nn.Module: ...


def eagle3_aux_layers(num_target_layers: int, head_config) -> tuple[int, ...]:
    """The target layers whose input residual stream an EAGLE-3 head reads: the head's
    ``eagle_aux_hidden_state_layer_ids``, else vLLM's default ``(2, L // 2, L - 3)``."""
    ids = head_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (head_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    return tuple(int(i) for i in ids)


def read_head_weights(folder: str) -> dict[str, torch.Tensor]:
    """An EAGLE head's tensors, from ``*.safetensors`` or ``pytorch_model.bin`` (the EAGLE
    authors' checkpoints), names without a leading ``model.``.

    Raises:
        ModelLoadError: neither kind of file.
    """
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    weights: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for path in files:
            weights.update(load_file(path))
    else:
        path = os.path.join(folder, "pytorch_model.bin")
        if not os.path.isfile(path):
            raise ModelLoadError(f"{folder} has no *.safetensors or pytorch_model.bin file")
        # weights_only: tensors and plain containers only, no code runs.
        weights = torch.load(path, map_location="cpu", weights_only=True)
    return {(n[len("model.") :] if n.startswith("model.") else n): t for n, t in weights.items()}


class EagleProposer(ModelProposer):
    """Greedy drafts of an EAGLE / EAGLE-3 head, or of the target's MTP layers.

    Args:
        config: the engine configuration (method eagle, eagle3 or mtp).
        device: the target's device.
    """

    shifted = True
    needs_hidden_states = True

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        super().__init__(config, device)
        spec = config.speculative_config
        assert spec is not None
        self.method = spec.method
        self._aux_layers: tuple[int, ...] = ()

    def load_model(self, target: nn.Module) -> None:
        if self.method == "mtp":
            if not isinstance(target, SupportsMTP) or not target.supports_mtp:
                raise ModelLoadError(f"{type(target).__name__} has no MTP layers")
            self.module = target.mtp_head()
            return
        spec = self.config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        head_config = spec.draft_model_config
        dummy = self.config.load_config.load_format == "dummy"
        weights = {} if dummy else read_head_weights(head_config.model)
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch_dtype(head_config.dtype))
        try:
            with torch.device(self.device), kernel_config_scope(self.config.kernel_config):
                if self.method == "eagle3":
                    own_embedding = "embed_tokens.weight" in weights
                    head = Eagle3Head(head_config, self.attn_backend, own_embedding)
                else:
                    head = EagleHead(head_config, self.attn_backend, "fc.bias" in weights)
        finally:
            torch.set_default_dtype(old_dtype)
        head.eval().requires_grad_(False)
        with torch.no_grad():
            if dummy:
                initialize_dummy_weights(head, seed=head_config.seed)
            else:
                head.load_weights(weights, source=head_config.model)
        head.share(target)
        if self.method == "eagle3":
            self._aux_layers = eagle3_aux_layers(len(target.model.layers), head_config.hf_config)
        self.module = head

    def carried_shape(self) -> tuple[int, torch.dtype] | None:
        # An EAGLE head carries its own output, of its hidden size; MTP layers the target's.
        spec = self.config.speculative_config
        assert spec is not None
        head = self.config.model_config if self.method == "mtp" else spec.draft_model_config
        assert head is not None
        return head.hf_config.hidden_size, torch_dtype(head.dtype)

    def aux_hidden_layers(self) -> tuple[int, ...]:
        return self._aux_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.module is not None and hidden_states is not None
        return self.module(input_ids, positions, hidden_states, metadata)

    def target_features(self, step: VerifiedStep, rows: torch.Tensor) -> torch.Tensor:
        assert self.module is not None
        source = step.aux_hidden_states if self._aux_layers else step.hidden_states
        assert source is not None
        return self.module.combine_features(source[rows])  # type: ignore[operator]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.module is not None
        return self.module.greedy_tokens(hidden)  # type: ignore[operator]

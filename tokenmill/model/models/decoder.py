"""What every decoder-only model here shares: the layer stack and the causal-LM shell.

A family's file defines its decoder layer and builds ``embed_tokens`` (``first_stage``),
``layers`` (``stage_layers``) and ``norm`` (``last_stage``) in a ``DecoderModel`` subclass
(the submodule names are the checkpoints'); its ``DecoderForCausalLM`` subclass builds that
model and calls ``attach``.

Under pipeline parallelism a rank builds only its stage: the layers outside it, the
embedding off the first stage and the final norm and LM head off the last are
``PPMissingLayer`` placeholders (no weights; the loader skips their checkpoint tensors), so
layer indices and checkpoint names stay those of the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.model.layers.embedding import LMHead, VocabEmbedding
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.stage import PPMissingLayer, last_stage
from tokenmill.model.loader.weights import load_model_weights


def open_residual(
    norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input norm on the residual stream: ``(norm(hidden + residual), hidden +
    residual)``; the first layer (``residual=None``) starts the stream with ``hidden``.
    Shapes ``[T, H]``; ``norm`` is an RMSNorm that adds the residual itself (fused)."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class PreNormDecoderLayer(nn.Module):
    """RMSNorm -> attention -> RMSNorm -> feed-forward, the residual adds fused into the norms.

    Subclasses set ``input_layernorm``, ``self_attn``, ``post_attention_layernorm`` and
    ``mlp`` (or override ``feed_forward``). Shapes: hidden and residual ``[T, H]``; the first
    layer gets ``residual=None`` and starts the residual stream.
    """

    input_layernorm: nn.Module
    self_attn: nn.Module
    post_attention_layernorm: nn.Module

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = open_residual(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class AuxHiddenTap(nn.Module):
    """Runs a decoder layer after copying its input residual stream (``hidden + residual``,
    or ``hidden`` before the first layer) into columns of a persistent buffer; in place
    inside a CUDA graph, whose copy then lands in the same buffer at every replay."""

    def __init__(self, layer: nn.Module, buffer: torch.Tensor, columns: slice) -> None:
        super().__init__()
        self.layer = layer
        self.buffer = buffer
        self.columns = columns

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        *args: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        stream = hidden if residual is None else hidden + residual
        self.buffer[: stream.shape[0], self.columns].copy_(stream)
        return self.layer(positions, hidden, residual, *args)


class DecoderModel(nn.Module):
    """Embedding, pre-norm decoder layers and the final norm: ids ``[T]`` -> hidden ``[T, H]``.

    Subclasses set ``embed_tokens``, ``layers`` (each called as ``layer(positions, hidden,
    residual, metadata) -> (hidden, residual)``) and ``norm`` (an RMSNorm that adds the
    residual first).

    A pipeline stage other than the first reads its input, the previous stage's hidden
    states and residual as ``[T, 2H]``, from ``stage_input`` (a ``[max_tokens, 2H]`` buffer
    the model runner binds and fills); a stage other than the last returns them in that
    form instead of normed hidden states.
    """

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    stage_input: torch.Tensor | None = None

    # ``[max_tokens, n * H]`` after ``keep_aux_hidden_states``, else None.
    aux_hidden_states: torch.Tensor | None = None
    # The decode-only CPU path over ``layers`` (``build_cpu_decode_stack``), built at the
    # first CPU forward pass; None where it does not apply. It holds the weights' tensors,
    # which a reload overwrites in place (``model_loader.reload_weights``).
    _cpu_decode: Any = None
    _cpu_decode_built = False

    def build_cpu_decode_stack(self) -> Any:
        """An object with ``applies(hidden, metadata) -> bool`` and ``run(hidden,
        metadata) -> (hidden, residual)`` that runs the layers of decode-only CPU steps
        exactly as they run themselves (``models/cpu_decode_stack.py``), or None
        (the default: the layers always run themselves)."""
        return None

    def _decode_stack(self, hidden: torch.Tensor) -> Any:
        if hidden.device.type != "cpu":
            return None
        if not self._cpu_decode_built:
            self._cpu_decode, self._cpu_decode_built = self.build_cpu_decode_stack(), True
        return self._cpu_decode

    def build_stack(
        self, config: Any, make_layer: Callable[[int], nn.Module], eps: float, **norm_kwargs: Any
    ) -> None:
        """Whole-model ``embed_tokens``, ``layers`` (``make_layer(i)`` for each of
        ``config.num_hidden_layers``) and ``norm`` (RMSNorm with ``config.rms_norm_eps``,
        else ``eps``), for families that are not split over pipeline stages."""
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.get("rms_norm_eps", eps), **norm_kwargs)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[T, H]`` (families that scale them override this)."""
        return self.embed_tokens(input_ids)

    def keep_aux_hidden_states(self, layers: tuple[int, ...], max_tokens: int) -> None:
        """From now on, each forward pass keeps the residual stream at the input of
        ``layers`` (EAGLE-3 reads it) in ``aux_hidden_states``: ``[max_tokens, n * H]``,
        layer ``layers[i]``'s in columns ``i * H .. (i + 1) * H``, the pass's first rows.

        Raises:
            ValueError: a layer index outside the model.
        """
        num_layers = len(self.layers)
        if any(not 0 <= i < num_layers for i in layers):
            raise ValueError(f"auxiliary hidden-state layers {layers} outside 0..{num_layers - 1}")
        weight = self.embed_tokens.weight
        hidden = weight.shape[1]
        self.aux_hidden_states = torch.zeros(
            max_tokens, len(layers) * hidden, dtype=weight.dtype, device=weight.device
        )
        for n, i in enumerate(layers):
            columns = slice(n * hidden, (n + 1) * hidden)
            self.layers[i] = AuxHiddenTap(self.layers[i], self.aux_hidden_states, columns)
        self._cpu_decode_built = False  # the taps run as layers: build over them again

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds`` ``[T, H]``, when given, replaces the embedding of ``input_ids``
        (multimodal models: image embeddings merged at their placeholder tokens)."""
        residual = None
        if isinstance(self.embed_tokens, PPMissingLayer):
            assert self.stage_input is not None, "the pipeline stage's input is not bound"
            hidden, residual = self.stage_input[: input_ids.shape[0]].chunk(2, dim=-1)
            hidden, residual = hidden.contiguous(), residual.contiguous()
        else:
            hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        stack = self._decode_stack(hidden)
        if stack is not None and residual is None and stack.applies(hidden, metadata):
            hidden, residual = stack.run(hidden, metadata)
        else:
            for layer in self.layers:
                if not isinstance(layer, PPMissingLayer):
                    hidden, residual = layer(positions, hidden, residual, metadata)
        if isinstance(self.norm, PPMissingLayer):
            return torch.cat((hidden, residual), dim=-1)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """A ``DecoderModel`` under an LM head (tied to the embedding when configured).

    ``forward(input_ids [T] int64, positions [T] int64, metadata) -> hidden [T, H]``;
    ``compute_logits(hidden [N, H]) -> [N, vocab]``.
    """

    # checkpoint name part -> (our merged parameter, shard id); see ``load_model_weights``
    stacked_params_mapping: list[tuple[str, str, Any]] = []
    # ``tie_word_embeddings`` when the config does not say
    tie_word_embeddings_default = False

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        self.config = model_config.hf_config

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", self.tie_word_embeddings_default))

    def attach(self, model: DecoderModel, soft_cap: float | None = None) -> None:
        """Take ``model`` as ``self.model`` and build the LM head over it.

        Args:
            soft_cap: final logit soft-capping, if the family uses it.
        """
        self.model = model
        self.lm_head = last_stage(
            lambda: LMHead(self.config.vocab_size, self.config.hidden_size, soft_cap=soft_cap)
        )
        if self.tie_word_embeddings and isinstance(model.embed_tokens, VocabEmbedding):
            if isinstance(self.lm_head, LMHead):
                self.lm_head.tie_to(model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        skip = ("lm_head.weight",) if self.tie_word_embeddings else ()
        if self.tie_word_embeddings and isinstance(self.model.embed_tokens, PPMissingLayer):
            # The LM head of the last stage is tied to an embedding another stage holds:
            # it loads the embedding's tensor as its own weight.
            weights = _embedding_as_lm_head(weights)
            skip = ()
        load_model_weights(self, weights, self.stacked_params_mapping, skip=skip, source=source)


def _embedding_as_lm_head(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint with ``model.embed_tokens.weight`` renamed ``lm_head.weight`` (a
    checkpoint's own ``lm_head.weight`` of a tied model is a copy, dropped)."""
    for name, tensor in weights:
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor
        elif name != "lm_head.weight":
            yield name, tensor

"""Give each layer of a model built under ``quantization_context`` its quantized weights,
and convert them once the checkpoint is loaded."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.layers.embedding import LMHead, VocabEmbedding
from tokenmill.model.layers.fused_moe import FusedMoE
from tokenmill.model.layers.linear import LinearBase
from tokenmill.model.layers.mla import MLAAttention
from tokenmill.model.layers.quantization.base import QuantizationConfig
from tokenmill.model.layers.quantization.gguf import GGUFEmbeddingMethod


def create_quantized_weights(model: nn.Module, config: QuantizationConfig) -> None:
    """Ask ``config`` for each layer's method by the layer's name and create its weights.

    Call inside the device and default-dtype context the model was built in.

    Raises:
        QuantizationError: a layer the method cannot quantize.
    """
    embeddings: dict[int, VocabEmbedding] = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and module.quant_method is None:
            module.prefix = name
            module.create_weights(config.get_linear_method(module, name))
        elif isinstance(module, FusedMoE):
            method = config.get_moe_method(module, name)
            if method is not None:
                module.set_quant_method(method)
        elif isinstance(module, VocabEmbedding) and config.quantizes_embeddings():
            tied = embeddings.get(id(module.weight)) if isinstance(module, LMHead) else None
            if tied is not None:  # a tied LM head shares the embedding's blocks
                module.quant_method = tied.quant_method
                module.weight = tied.weight
                continue
            previous = id(module.weight)
            module.set_quant_method(GGUFEmbeddingMethod(torch.get_default_dtype()))
            embeddings[previous] = module


def process_quantized_weights(model: nn.Module, device: torch.device) -> None:
    """Run each method's ``process_weights_after_loading`` (repacking for the device), then
    give MLA layers a dense copy of a quantized up-projection."""
    done: set[int] = set()
    for module in model.modules():
        if isinstance(module, LinearBase) and module.quant_method is not None:
            module.quant_method.process_weights_after_loading(module)
        elif isinstance(module, FusedMoE) and module.quant_method is not None:
            module.quant_method.process_weights_after_loading(module)
        elif isinstance(module, VocabEmbedding) and module.quant_method is not None:
            method = module.quant_method
            if id(method) not in done:
                method.process_weights_after_loading(module, device)
                done.add(id(method))
            if isinstance(module, LMHead):
                method.build_head(module)
    mla_layers = [m for m in model.modules() if isinstance(m, MLAAttention)]
    if mla_layers:  # the absorbed decode's W_UK and W_UV, in the model's dtype (its norms')
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        for layer in mla_layers:
            layer.impl.dequantize_up_projection(dtype, device)

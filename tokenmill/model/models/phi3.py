"""Phi-3 (Abdin et al. 2024, arXiv:2404.14219): Llama's layout and computation.

Its checkpoints store q/k/v as one ``qkv_proj`` tensor and gate/up as one ``gate_up_proj``
tensor; they load whole into the merged parameters (the weight loaders split a fused tensor
given no shard id, also across tensor-parallel ranks). The long-context variants use
LongRoPE ("su"/"longrope" scaling: per-frequency short/long factors, Ding et al. 2024,
arXiv:2402.13753), which ``layers/rotary.py`` implements; ``sliding_window``, when set,
applies to every layer.
"""

from __future__ import annotations

from tokenmill.hf_config import HFConfig
from tokenmill.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4-mini causal LM (no attention biases)."""

    gguf_permuted_qk = False

    @staticmethod
    def attention_biases(config: HFConfig) -> tuple[bool, bool]:
        return False, False

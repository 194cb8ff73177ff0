"""Decode-only steps of a GGUF Llama-style layer stack on the CPU, as one flat loop of
native ops.

At one or a few rows a CPU decode step of a small model spends about as long in Python
(module calls, the quantization method's dispatch, each layer's attention checks) as in
its products: on SmolLM2-135M, 30 layers of ~150 us of interpreter work each. Where every
layer of the stack is the plain pre-norm block (RMSNorm, QKV product, rotary attention over
the paged cache, output product, RMSNorm, gate/up product, SiLU-and-mul, down product) over
weights packed for the native block product (``kernels/cpu/block_gemm.py``), a
``CpuDecodeStack`` binds each layer's packed weights, norm weights and attention layer
once and runs a decode step's layers as a loop over the native ops the modules themselves
call (``add_rms_norm``, ``block_gemm``, ``paged_decode_attention_rotary``), in the same order
on the same arguments: the result is bit for bit the modules'. Every other step (prompt
tokens, padded rows, a shared-prefix cascade, an attention hook) and every other stack
(other blocks, adapters, tensor or pipeline parallelism, FP8 KV scales) runs the modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.cpu.block_gemm import BlockWeights
from tokenmill.kernels.cpu.native import native_ops
from tokenmill.kernels.quant import int4_cpu
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.model.attention.torch_ref import (
    TorchAttentionImpl,
    batch_plan,
    native_decode_rows,
)
from tokenmill.model.layers import attention as attention_layer
from tokenmill.model.layers.activation import SiluAndMul
from tokenmill.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenmill.model.layers.norm import RMSNorm, no_residual
from tokenmill.model.layers.quantization.gguf import GGUFLinearMethod
from tokenmill.model.models.decoder import PreNormDecoderLayer

# A product's arguments after ``x``: block_gemm(x, packed, corr, scales, offsets, nibbles).
Product = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]


@dataclass(frozen=True)
class _Layer:
    """One layer's bound weights and attention (see ``CpuDecodeStack``)."""

    input_norm: tuple[torch.Tensor, float, float]
    post_norm: tuple[torch.Tensor, float, float]
    qkv: Product
    qkv_bias: torch.Tensor | None
    o: Product
    o_bias: torch.Tensor | None
    gate_up: Product
    gate_up_bias: torch.Tensor | None
    down: Product
    down_bias: torch.Tensor | None
    split: tuple[int, int, int]
    attn: attention_layer.Attention
    num_heads: int
    head_dim: int
    cos_sin: torch.Tensor
    rotary_dim: int
    neox: bool
    scale: float
    window: int


def _product(linear: nn.Module) -> Product | None:
    """The native block product's arguments of a GGUF linear layer held as one packed
    weight, or None."""
    if not isinstance(linear.quant_method, GGUFLinearMethod):
        return None
    segments = getattr(linear, "gguf_segments", None)
    if not segments or len(segments) != 1 or len(segments[0].planes) != 1:
        return None
    weights = segments[0].planes[0]
    if not isinstance(weights, BlockWeights):
        return None
    return weights.packed, weights.corr, weights.scales, weights.offsets, weights.nibbles


def _norm(norm: nn.Module) -> tuple[torch.Tensor, float, float] | None:
    if type(norm) is not RMSNorm or norm.weight.dtype != torch.float32:
        return None
    return norm.weight, float(norm.eps), float(norm.offset)


def _bind_layer(layer: nn.Module, attention_cls: type, mlp_cls: type) -> _Layer | None:
    """``layer``'s bound form, or None where it is not the plain block this path runs."""
    cls = type(layer)
    if (
        not isinstance(layer, PreNormDecoderLayer)
        or cls.forward is not PreNormDecoderLayer.forward
        or cls.feed_forward is not PreNormDecoderLayer.feed_forward
    ):
        return None
    attn_block, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(attn_block) is not attention_cls or type(mlp) is not mlp_cls:
        return None
    if not isinstance(mlp.act_fn, SiluAndMul):
        return None
    qkv, o = attn_block.qkv_proj, attn_block.o_proj
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    if (
        type(qkv) is not QKVParallelLinear
        or type(o) is not RowParallelLinear
        or type(gate_up) is not MergedColumnParallelLinear
        or type(down) is not RowParallelLinear
        or any(lin.tp_size != 1 for lin in (qkv, o, gate_up, down))
    ):
        return None
    attn = attn_block.attn
    rope = attn.rotary_emb
    # Whether a step rotates inside the native decode kernel is the attention layer's own
    # test, run per step (``CpuDecodeStack.applies``); here what the loop cannot do.
    if rope is None or attn._kv_scales is not None or not isinstance(attn.impl, TorchAttentionImpl):
        return None
    products = [_product(lin) for lin in (qkv, o, gate_up, down)]
    norms = [_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)]
    if any(p is None for p in products) or any(n is None for n in norms):
        return None
    return _Layer(
        input_norm=norms[0], post_norm=norms[1],
        qkv=products[0], qkv_bias=qkv.bias, o=products[1], o_bias=o.bias,
        gate_up=products[2], gate_up_bias=gate_up.bias, down=products[3], down_bias=down.bias,
        split=(attn_block.q_size, attn_block.kv_size, attn_block.kv_size),
        attn=attn, num_heads=attn.num_heads, head_dim=attn.head_dim,
        cos_sin=rope.cos_sin_cache, rotary_dim=rope.rotary_dim, neox=rope.is_neox_style,
        scale=float(attn.impl.scale), window=attn.sliding_window or 0,
    )  # fmt: skip


class CpuDecodeStack:
    """A model's layers bound for decode-only CPU steps (see the module docstring)."""

    def __init__(self, layers: list[_Layer]) -> None:
        self.layers = layers
        ops = native_ops()
        self._add_rms_norm = ops.add_rms_norm.default
        self._block_gemm = ops.block_gemm.default
        self._attend = ops.paged_decode_attention_rotary.default

    @classmethod
    def build(
        cls, layers: nn.ModuleList, attention_cls: type, mlp_cls: type
    ) -> CpuDecodeStack | None:
        """The stack over ``layers`` (all of them, in order), or None where any layer is
        not the plain block over natively packed weights, or the native ops are missing.

        Args:
            attention_cls, mlp_cls: the family's attention block (a ``qkv_proj``,
                ``o_proj`` and ``attn``, with ``q_size`` and ``kv_size``) and gated MLP
                (``gate_up_proj``, ``act_fn``, ``down_proj``); a layer whose blocks are of
                other classes, subclasses included, is not bound.
        """
        ops = native_ops()
        if ops is None or not bool(ops.block_gemm_available()) or len(layers) == 0:
            return None
        bound = [_bind_layer(layer, attention_cls, mlp_cls) for layer in layers]
        if any(b is None for b in bound):
            return None
        return cls(bound)  # type: ignore[arg-type]

    def applies(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """Whether this step takes the stack: float32 rows, nothing padded, no attention
        hook, no prompt rows routed to a bfloat16 copy, and a step whose attention the
        layers would run in the native decode kernel with the rotation and K/V write inside
        (``Attention.decodes_with_rotary``, asked of the first layer on the embeddings, on
        the queries' device and of their dtype)."""
        if (
            hidden.dtype != torch.float32
            or hidden.device.type != "cpu"
            or hidden.shape[0] != metadata.num_actual_tokens
            or attention_layer.attention_hook_active()
            or int4_cpu.current_prompt_rows() is not None
        ):
            return False
        return (
            self.layers[0].attn.decodes_with_rotary(hidden, metadata)
            and batch_plan(metadata)["all_decode"]
        )

    def run(
        self, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over ``hidden [T, H]`` (the embeddings) -> ``(hidden, residual)``,
        as ``DecoderModel.forward``'s loop returns them."""
        table, seq_lens = native_decode_rows(batch_plan(metadata), metadata)
        n = hidden.shape[0]
        slots = metadata.slot_mapping[:n].long().contiguous()
        norm, gemm, attend = self._add_rms_norm, self._block_gemm, self._attend
        residual: torch.Tensor | None = None
        for c in self.layers:
            if residual is None:
                x = norm(hidden, no_residual(), *c.input_norm)[0]
                residual = hidden
            else:
                x, residual = norm(hidden, residual, *c.input_norm)
            qkv = gemm(x, *c.qkv)
            if c.qkv_bias is not None:
                qkv = qkv + c.qkv_bias
            q, k, v = qkv.split(c.split, dim=-1)
            out = attend(
                q.view(n, c.num_heads, c.head_dim), k, v, c.attn.kv_cache, slots, table,
                seq_lens, c.cos_sin, c.rotary_dim, c.neox, c.scale, c.window,
            ).view(n, -1)  # fmt: skip
            hidden = gemm(out, *c.o)
            if c.o_bias is not None:
                hidden = hidden + c.o_bias
            x, residual = norm(hidden, residual, *c.post_norm)
            gate_up = gemm(x, *c.gate_up)
            if c.gate_up_bias is not None:
                gate_up = gate_up + c.gate_up_bias
            d = gate_up.shape[-1] // 2
            hidden = gemm((F.silu(gate_up[:, :d]) * gate_up[:, d:]).contiguous(), *c.down)
            if c.down_bias is not None:
                hidden = hidden + c.down_bias
        assert residual is not None
        return hidden, residual

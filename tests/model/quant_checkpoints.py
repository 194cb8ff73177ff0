"""Tiny int4 checkpoints (GPTQ, AWQ, compressed-tensors W4A16) written in each format's
documented packed layout from a random float model, plus the float model carrying the
exactly dequantized weights (the reference transformers runs).

Layouts followed: AutoGPTQ's ``QuantLinear.pack`` (qweight packed along K, qzeros along N,
``zero - 1`` stored in the original format), AutoAWQ's GEMM ``pack`` (both packed along N in
the order 0, 2, 4, 6, 1, 3, 5, 7) and compressed-tensors' ``pack_to_int32`` (its own helper
writes the compressed-tensors tensors).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from tokenmill.kernels.quant.int4_pack import AWQ_ORDER, pack_cols, pack_rows

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

TINY_LLAMA = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def quantize(w: torch.Tensor, group: int, sym: bool, gen: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 of ``w [N, K]`` in groups along K.

    Returns:
        ``(q [N, K] int 0..15, scales [N, K/G] float16, zeros [N, K/G] int 0..15)``.
    """
    n, k = w.shape
    wg = w.view(n, k // group, group)
    if sym:
        scales = (wg.abs().amax(-1) / 7).clamp_min(1e-4)
        zeros = torch.full(scales.shape, 8, dtype=torch.int64)
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        scales = ((hi - lo) / 15).clamp_min(1e-4)
        zeros = torch.randint(4, 12, scales.shape, generator=gen)
    scales = scales.half()
    q = torch.round(wg / scales.float().unsqueeze(-1)) + zeros.unsqueeze(-1)
    return q.clamp(0, 15).to(torch.int64).view(n, k), scales, zeros


def dequantized(q, scales, zeros, group) -> torch.Tensor:
    """``(q - z) * s`` in float32, ``[N, K]``."""
    n, k = q.shape
    w = q.view(n, k // group, group).float() - zeros.unsqueeze(-1).float()
    return (w * scales.float().unsqueeze(-1)).view(n, k)


def make_int4_checkpoint(folder: str, fmt: str, group: int, sym: bool, act_order: bool = False,
                         seed: int = 0, skip: tuple[str, ...] = ()) -> str:
    """Write ``folder/quant`` (the ``fmt`` checkpoint) and ``folder/reference`` (float32 with
    the dequantized weights); return ``folder``.

    Args:
        fmt: ``gptq`` (original format), ``gptq_v2``, ``awq`` or ``ct``.
        group: group size along K (-1: per channel).
        act_order: GPTQ/compressed-tensors act-order (a random ``g_idx``).
        skip: layers left in float32 (``model.layers.0.self_attn.q_proj``), listed in the
            config's ``ignore`` / ``modules_to_not_convert``.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).float().eval()
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    quant_state: dict[str, torch.Tensor] = {}
    orders: dict[str, torch.Tensor] = {}
    for name in list(state):
        if (not any(f".{lin}." in name for lin in LINEARS) or not name.endswith(".weight")
                or name[: -len(".weight")] in skip):
            quant_state[name] = state[name]
            continue
        w = state[name]
        n, k = w.shape
        g = k if group == -1 else group
        g_idx = torch.arange(k) // g
        if act_order:
            # Parts that share their input (q/k/v, gate/up) share GPTQ's act order.
            shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
            shared = shared.replace("up_proj", "gate_proj")
            g_idx = orders.setdefault(shared, g_idx[torch.randperm(k, generator=gen)])
        # Quantized in group order: column j of the sorted order is input channel perm[j].
        perm = torch.argsort(g_idx, stable=True)
        q_sorted, scales, zeros = quantize(w[:, perm], g, sym, gen)
        q = torch.empty_like(q_sorted)
        q[:, perm] = q_sorted
        deq = torch.empty_like(w)
        deq[:, perm] = dequantized(q_sorted, scales, zeros, g)
        state[name] = deq
        prefix = name[: -len(".weight")]
        quant_state.update(_pack(fmt, prefix, q, scales, zeros, g_idx, act_order, sym))
    hf.load_state_dict(state)
    hf.save_pretrained(os.path.join(folder, "reference"))
    qdir = os.path.join(folder, "quant")
    os.makedirs(qdir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in quant_state.items()},
              os.path.join(qdir, "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = _quant_config(fmt, group, sym, act_order)
    if skip:
        key = "ignore" if fmt == "ct" else "modules_to_not_convert"
        config["quantization_config"][key] = [*(config["quantization_config"].get(key) or []),
                                              *skip]
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def _pack(fmt, prefix, q, scales, zeros, g_idx, act_order, sym) -> dict[str, torch.Tensor]:
    if fmt in ("gptq", "gptq_v2"):
        stored_zeros = zeros - 1 if fmt == "gptq" else zeros
        return {
            f"{prefix}.qweight": pack_rows(q.t()),
            f"{prefix}.qzeros": pack_cols(stored_zeros.t() & 15),
            f"{prefix}.scales": scales.t().contiguous(),
            f"{prefix}.g_idx": g_idx.to(torch.int32),
        }
    if fmt == "awq":
        return {
            f"{prefix}.qweight": pack_cols(q.t(), AWQ_ORDER),
            f"{prefix}.qzeros": pack_cols(zeros.t(), AWQ_ORDER),
            f"{prefix}.scales": scales.t().contiguous(),
        }
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = {
        f"{prefix}.weight_packed": pack_to_int32((q - 8).to(torch.int8), 4),
        f"{prefix}.weight_scale": scales.float(),
        f"{prefix}.weight_shape": torch.tensor(list(q.shape)),
    }
    if not sym:
        out[f"{prefix}.weight_zero_point"] = pack_to_int32(
            (zeros - 8).to(torch.int8), 4, packed_dim=0
        )
    if act_order:
        out[f"{prefix}.weight_g_idx"] = g_idx.to(torch.int32)
    return out


def _quant_config(fmt, group, sym, act_order) -> dict:
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
                "desc_act": act_order, "checkpoint_format": fmt}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "channel" if group == -1 else "group",
               "group_size": None if group == -1 else group,
               "actorder": "group" if act_order else None, "observer": "minmax"}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None,
                                      "format": "pack-quantized"}},
        "ignore": ["lm_head"],
    }


def quantize_folder(src: str, out: str, fmt: str, group: int, sym: bool, seed: int = 0,
                    leaves: tuple[str, ...] = LINEARS) -> tuple[str, str]:
    """Quantize every projection of a saved float model (attention, MLP, per-expert MoE
    projections: the weights named ``*.<leaf>.weight`` for a leaf of ``leaves``; not routers,
    embeddings or the LM head) into ``out/quant`` in ``fmt``, and write ``out/reference``
    with the dequantized weights. Returns both folders."""
    import shutil

    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    state = load_file(os.path.join(src, "model.safetensors"))
    quant_state, reference = {}, {}
    for name, w in state.items():
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if leaf not in leaves and leaf not in ("w1", "w2", "w3"):
            quant_state[name] = reference[name] = w
            continue
        n, k = w.shape
        q, scales, zeros = quantize(w.float(), group, sym, gen)
        reference[name] = dequantized(q, scales, zeros, group)
        quant_state.update(_pack(fmt, name[: -len(".weight")], q, scales, zeros,
                                 torch.arange(k) // group, False, sym))
    for sub, tensors in (("quant", quant_state), ("reference", reference)):
        folder = os.path.join(out, sub)
        os.makedirs(folder, exist_ok=True)
        for f in os.listdir(src):
            if f != "model.safetensors":
                shutil.copy(os.path.join(src, f), folder)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = _quant_config(fmt, group, sym, False)
    with open(os.path.join(out, "quant", "config.json"), "w") as f:
        json.dump(config, f)
    return os.path.join(out, "quant"), os.path.join(out, "reference")

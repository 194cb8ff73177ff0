"""Tiny FP8 checkpoints written in each format's documented layout from a random float model,
plus the float32 reference that runs the same scheme: the exactly dequantized weights, and
each quantized linear layer's input quantized and dequantized as the scheme says (forward
pre-hooks on transformers' model, independent of tokenmill's code).

Layouts: compressed-tensors ``float-quantized`` (``weight`` float8_e4m3fn, ``weight_scale``
``[1]`` per tensor, ``[N, 1]`` per channel or ``[N/bn, K/bk]`` per block, ``input_scale``
``[1]`` static) and vLLM's ``fp8`` (``weight_scale`` ``[]`` per tensor or
``weight_scale_inv`` ``[N/128, K/128]`` per block, ``input_scale`` ``[]``).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = torch.float8_e4m3fn
# Hidden 256 and a K/V width of 128: every merged part is whole 128x128 blocks.
TINY_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=320,
                  max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
STATIC_INPUT_SCALE = 0.02

# scheme name -> (format, weights, activations)
SCHEMES = {
    "ct-tensor-static": ("ct", "tensor", "static"),
    "ct-tensor-dynamic": ("ct", "tensor", "tensor"),
    "ct-channel-token": ("ct", "channel", "token"),
    "ct-channel-w8a16": ("ct", "channel", "none"),
    "ct-block": ("ct", "block", "group"),
    "fp8-static": ("fp8", "tensor", "static"),
    "fp8-dynamic": ("fp8", "tensor", "tensor"),
    "fp8-block": ("fp8", "block", "group"),
}


def _q(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(FP8)


def quantize_weight(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
    """``(fp8 values, stored scale, dequantized float32)`` of ``w [N, K]``."""
    n, k = w.shape
    if kind == "tensor":
        scale = w.abs().max() / 448
        q = _q(w, scale)
        return q, scale, q.float() * scale
    if kind == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448
        q = _q(w, scale)
        return q, scale, q.float() * scale
    blocks = w.view(n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    q = _q(w, full)
    return q, scale, q.float() * full


def fake_quantize_input(x: torch.Tensor, activations: str) -> torch.Tensor:
    """The scheme's activation quantization, quantized and dequantized in float32."""
    if activations == "none":
        return x
    flat = x.reshape(-1, x.shape[-1]).float()
    if activations == "static":
        scale = torch.tensor(STATIC_INPUT_SCALE)
    elif activations == "tensor":
        scale = flat.abs().max() / 448
    elif activations == "token":
        scale = flat.abs().amax(-1, keepdim=True) / 448
    else:  # groups of 128 inputs per token
        g = flat.view(flat.shape[0], -1, 128)
        scale = (g.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-12)
        return ((g / scale).clamp(-448, 448).to(FP8).float() * scale).view(x.shape)
    scale = scale.clamp_min(1e-12)
    return ((flat / scale).clamp(-448, 448).to(FP8).float() * scale).view(x.shape)


def hook_reference(model: torch.nn.Module, activations: str) -> None:
    """Quantize the inputs of ``model``'s projections as the scheme does, and normalize with
    tokenmill's RMSNorm: FP8 rounding turns a last-bit difference in a normed activation
    (another summation order) into a whole FP8 step, so both sides share the norm's float32
    rounding."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS:
            module.register_forward_pre_hook(
                lambda _m, args: (fake_quantize_input(args[0], activations),))
        elif type(module).__name__.endswith("RMSNorm"):
            module.forward = _tokenmill_norm(module)


def _tokenmill_norm(module: torch.nn.Module):
    """``module``'s RMSNorm as tokenmill computes it, on rows as the engine passes them."""
    from tokenmill.model.layers.norm import RMSNorm

    norm = RMSNorm(module.weight.numel(), module.variance_epsilon)
    norm.weight = module.weight
    return lambda x: norm(x.reshape(-1, x.shape[-1]).contiguous()).view_as(x)


def make_fp8_checkpoint(folder: str, scheme: str, seed: int = 0, **config: int
                        ) -> tuple[str, str]:
    """Write ``folder/quant`` (the checkpoint of ``scheme``, a key of ``SCHEMES``) and
    ``folder/reference`` (float32, dequantized weights); return both paths. ``config``
    overrides fields of ``TINY_LLAMA``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    fmt, kind, activations = SCHEMES[scheme]
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY_LLAMA, **config}))
    hf = hf.float().eval()
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    quant: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if name.rsplit(".", 2)[-2] not in LINEARS or not name.endswith(".weight"):
            quant[name] = w
            continue
        q, scale, deq = quantize_weight(w, kind)
        state[name] = deq
        prefix = name[: -len(".weight")]
        quant[name] = q
        if fmt == "ct":
            quant[f"{prefix}.weight_scale"] = scale.reshape(1) if kind == "tensor" else scale
        elif kind == "block":
            quant[f"{prefix}.weight_scale_inv"] = scale
        else:
            quant[f"{prefix}.weight_scale"] = scale.reshape(())
        if activations == "static":
            value = torch.tensor(STATIC_INPUT_SCALE)
            quant[f"{prefix}.input_scale"] = value.reshape(1) if fmt == "ct" else value
    hf.load_state_dict(state)
    reference = os.path.join(folder, "reference")
    hf.save_pretrained(reference)
    qdir = os.path.join(folder, "quant")
    os.makedirs(qdir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in quant.items()},
              os.path.join(qdir, "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config["quantization_config"] = quantization_config(fmt, kind, activations)
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(config, f)
    return qdir, reference


def quantization_config(fmt: str, kind: str, activations: str) -> dict:
    if fmt == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme":
              "static" if activations == "static" else "dynamic"}
        if kind == "block":
            qc["weight_block_size"] = [128, 128]
        return qc
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": kind, "observer": "minmax"}
    if kind == "block":
        weights["block_structure"] = [128, 128]
    acts = None
    if activations != "none":
        strategy = {"static": "tensor", "tensor": "tensor", "token": "token",
                    "group": "group"}[activations]
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                "dynamic": activations != "static", "observer": None if
                activations != "static" else "minmax"}
        if activations == "group":
            acts["group_size"] = 128
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": acts, "output_activations": None,
                                      "format": "float-quantized"}},
        "ignore": ["lm_head"],
    }


def make_moe_float(folder, kind: str):
    """A tiny random Mixtral or Qwen3-MoE (decisive routers) saved to ``folder``; returns
    transformers' model."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    from tests.model.test_qwen3_parity import save_random_model

    common = {k: v for k, v in TINY_LLAMA.items() if k not in ("intermediate_size", "head_dim")}
    if kind == "qwen3-moe":
        config = Qwen3MoeConfig(**common, head_dim=64, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=128, intermediate_size=128,
                                norm_topk_prob=True)
    else:
        config = MixtralConfig(**common, head_dim=64, intermediate_size=128,
                               num_local_experts=4, num_experts_per_tok=2)
    return save_random_model(config, folder, {"gate.weight": 40.0})


def quantize_moe_reference(hf: torch.nn.Module) -> None:
    """Replace the attention projections' and the experts' weights of transformers' MoE
    model by their per-channel FP8 values (experts ``[E, N, K]``: per row), and quantize the
    attention projections' inputs per token (its fused experts have no per-expert modules
    to hook: their inputs stay float)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            leaf = name.rsplit(".", 1)[-1] if "experts" in name else name.rsplit(".", 2)[-2]
            if leaf in ("gate_up_proj", "down_proj", "q_proj", "k_proj", "v_proj", "o_proj"):
                rows = p.reshape(-1, p.shape[-1]).float()
                p.copy_(quantize_weight(rows, "channel")[2].view(p.shape))
    hook_reference(hf, "token")

"""Rotary position embedding (RoPE, Su et al. 2021, arXiv:2104.09864) and its scalings.

Scalings follow the definitions transformers uses for the same config keys, so logits match:
``linear`` (position interpolation, Chen et al. 2023), ``dynamic`` (NTK-aware base change),
``llama3`` (Llama 3.1's frequency-dependent interpolation), ``yarn`` (Peng et al. 2023,
arXiv:2309.00071) and ``longrope`` (Phi-3's per-frequency factors, arXiv:2402.13753).
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch
from torch import nn

from tokenmill.kernels.device import use_triton
from tokenmill.kernels.rotary import rotary_inplace


def _base_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    """``1 / base^(2i/d)`` for i in [0, d/2), float32, shape [d/2]."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between
    # blended linearly in 1/wavelen.
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, out)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, rotary_dim: int, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    orig = scaling.get("original_max_position_embeddings", max_position)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = _base_inv_freq(base, rotary_dim)
    interpolation = extrapolation / factor
    keep = 1 - ramp  # 1 -> extrapolate (high frequencies), 0 -> interpolate
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = _yarn_mscale(factor, scaling["mscale"]) / _yarn_mscale(
                factor, scaling["mscale_all_dim"]
            )
        else:
            attention_factor = _yarn_mscale(factor)
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key in place of their first ``rotary_dim`` dims.

    ``forward(positions [T] int, q [T, Hq*D], k [T, Hk*D]) -> (q, k)`` same shapes and
    dtype; the rotation is computed in float32 from a cached ``[max_position, rotary_dim]``
    table of ``cos | sin``.

    Args:
        head_dim: size of each head.
        rotary_dim: leading dims of each head that rotate (``head_dim`` for most models).
        max_position: positions covered by the table.
        base: RoPE theta.
        is_neox_style: rotate the two halves (GPT-NeoX, Llama in HF layout) rather than
            interleaved pairs (GPT-J).
        scaling: the config's ``rope_scaling`` dict (with ``rope_type``) or None.
        max_model_len: the engine's context length (decides dynamic/longrope behaviour).

    Raises:
        ValueError: the scaling type is not supported.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        is_neox_style: bool = True,
        scaling: dict[str, Any] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        inv_freq, attention_factor = self._inv_freq(
            base, rotary_dim, scaling, max_position, max_model_len or max_position
        )
        positions = torch.arange(max(max_position, max_model_len or 0), dtype=torch.float64)
        freqs = torch.outer(positions, inv_freq)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor
        self.register_buffer("cos_sin_cache", cache.float(), persistent=False)

    @staticmethod
    def _inv_freq(
        base: float,
        dim: int,
        scaling: dict[str, Any] | None,
        max_position: int,
        max_model_len: int,
    ) -> tuple[torch.Tensor, float]:
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type == "default":
            return _base_inv_freq(base, dim), 1.0
        assert scaling is not None
        if rope_type == "linear":
            return _base_inv_freq(base, dim) / scaling["factor"], 1.0
        if rope_type == "llama3":
            return _llama3_inv_freq(_base_inv_freq(base, dim), scaling), 1.0
        if rope_type == "dynamic":
            orig = scaling.get("original_max_position_embeddings", max_position)
            factor = scaling["factor"]
            if max_model_len <= orig:  # transformers only rescales past the original length
                return _base_inv_freq(base, dim), 1.0
            # NOTE: one base for all positions (the one for max_model_len); transformers
            # recomputes it per sequence length, which a shared cache cannot.
            new_base = base * ((factor * max_model_len / orig) - (factor - 1)) ** (dim / (dim - 2))
            return _base_inv_freq(new_base, dim), 1.0
        if rope_type == "yarn":
            return _yarn_inv_freq(base, dim, scaling, max_position)
        if rope_type in ("longrope", "su"):
            orig = scaling.get("original_max_position_embeddings", max_position)
            use_long = max_model_len > orig
            ext = torch.tensor(
                scaling["long_factor" if use_long else "short_factor"], dtype=torch.float64
            )
            factor = scaling.get("factor") or max_position / orig
            attention_factor = scaling.get("attention_factor")
            if attention_factor is None:
                attention_factor = (
                    1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
                )
            return _base_inv_freq(base, dim) / ext, float(attention_factor)
        raise ValueError(f"unsupported rope scaling type {rope_type!r}")

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]; cos/sin: [T, 1, rot/2]
        rot = x[..., : self.rotary_dim].float()
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        if self.rotary_dim == self.head_dim:
            return out.to(x.dtype)
        return torch.cat([out.to(x.dtype), x[..., self.rotary_dim :]], dim=-1)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H, head_dim]`` (any strides) rotated at ``positions [T]``, in torch: a new
        tensor of ``x``'s dtype."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(x, cos, sin)

    # A decode launch may rotate each new token at its context's last position from
    # ``cos_sin_cache`` (``DecodeRotary``); not so where positions follow other rules (M-RoPE).
    rotates_at_context_end = True

    def runs_fused(self, q: torch.Tensor) -> bool:
        """Whether ``q``'s rotation runs as a fused Triton kernel (CUDA, and a power-of-two
        half rotary dimension)."""
        half = self.rotary_dim // 2
        return use_triton(q) and not half & (half - 1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.runs_fused(q):
            rotary_inplace(
                positions, q, k, self.cos_sin_cache, self.head_dim, self.rotary_dim,
                self.is_neox_style,
            )
            return q, k
        cos, sin = self._cos_sin(positions)
        t = positions.shape[0]
        qk = _adjacent(q, k) if not q.is_cuda else None
        if qk is not None:  # q and k side by side in one projection output: one rotation
            out = self._rotate(qk.view(t, -1, self.head_dim), cos, sin).view(t, -1)
            return out[:, : q.shape[1]], out[:, q.shape[1] :]
        q = self._rotate(q.view(t, -1, self.head_dim), cos, sin).view(t, -1)
        k = self._rotate(k.view(t, -1, self.head_dim), cos, sin).view(t, -1)
        return q, k

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[T, 1, rotary_dim / 2]`` at ``positions``. On the CPU they are looked
        up once per forward pass: the layers sharing this table get the same ``positions``
        tensor object, which the runner makes anew (a slice of its buffer) for every pass
        and nothing writes while the pass runs. (Not under CUDA graphs or compilation,
        where this Python-side state would be captured.)"""
        if positions.is_cuda or torch.compiler.is_compiling():
            return self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        cached = self.__dict__.get("_pass_cos_sin")
        if cached is not None and cached[0] is positions:
            return cached[1], cached[2]
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        # Keeping the positions object keeps its id from being reused by a later tensor.
        self.__dict__["_pass_cos_sin"] = (positions, cos, sin)
        return cos, sin


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``[T, Nq + Nk]``: a view of ``q [T, Nq]`` and ``k [T, Nk]`` as one tensor when ``k``'s
    columns directly follow ``q``'s in the same storage (the split of a QKV product), else
    None."""
    if (q.dim() != 2 or k.dim() != 2 or q.dtype != k.dtype or q.shape[0] != k.shape[0]
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
            or q.stride(1) != 1
            or k.stride(1) != 1 or q.stride(0) != k.stride(0)
            or k.data_ptr() != q.data_ptr() + q.shape[1] * q.element_size()
            or q.shape[1] + k.shape[1] > q.stride(0)):
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1]), q.stride())


# Weak: a table lives as long as a model that uses it.
_ROPE_CACHE: weakref.WeakValueDictionary[tuple, RotaryEmbedding] = weakref.WeakValueDictionary()


def get_rope(
    head_dim: int,
    max_position: int,
    base: float,
    scaling: dict[str, Any] | None = None,
    rotary_dim: int | None = None,
    is_neox_style: bool = True,
    max_model_len: int | None = None,
) -> RotaryEmbedding:
    """The rotary embedding a config asks for (see RotaryEmbedding).

    Layers with the same settings share one instance: its cos/sin table holds
    ``max_position x rotary_dim`` float32 values (64 MiB for Llama 3.1's 131072
    positions), which would otherwise be repeated in every layer.
    """
    device = torch.empty(0).device  # the default device the model is being built on
    key = (
        head_dim, rotary_dim or head_dim, max_position, float(base), is_neox_style,
        json.dumps(scaling, sort_keys=True), max_model_len, str(device),
    )
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = RotaryEmbedding(
            head_dim, rotary_dim or head_dim, max_position, base, is_neox_style, scaling,
            max_model_len,
        )
        _ROPE_CACHE[key] = rope
    return rope

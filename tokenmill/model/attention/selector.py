"""Which attention backend runs on which device."""

from __future__ import annotations

from tokenmill.model.attention.backend import AttentionBackend


def get_attn_backend(device_type: str, use_mla: bool = False) -> type[AttentionBackend]:
    """The backend for ``device_type`` ("cuda" or "cpu").

    CUDA uses the Triton kernels when Triton is importable; everything else uses the
    torch reference backend. ``use_mla``: the model's attention is multi-head latent
    attention (``ModelConfig.use_mla``), whose backends keep a latent cache.
    """
    if device_type == "cuda":
        try:
            if use_mla:
                from tokenmill.model.attention.mla_triton import TritonMLABackend as triton_cls
            else:
                from tokenmill.model.attention.triton_backend import (
                    TritonAttentionBackend as triton_cls,
                )
        except ImportError:
            pass
        else:
            return triton_cls
    if use_mla:
        from tokenmill.model.attention.mla import TorchMLABackend

        return TorchMLABackend
    from tokenmill.model.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend

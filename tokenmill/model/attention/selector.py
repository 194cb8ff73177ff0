"""Which attention backend runs on which device."""

from __future__ import annotations

from tokenmill.model.attention.backend import AttentionBackend


def get_attn_backend(device_type: str) -> type[AttentionBackend]:
    """The backend for ``device_type`` ("cuda" or "cpu").

    CUDA uses the Triton kernels when Triton is importable; everything else uses the
    torch reference backend.
    """
    if device_type == "cuda":
        try:
            from tokenmill.model.attention.triton_backend import TritonAttentionBackend
        except ImportError:
            pass
        else:
            return TritonAttentionBackend
    from tokenmill.model.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend

"""The attention backend seam: every backend implements what its class declares, and the
attention layer asks the seam, not the implementation, which launches a backend has."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.attention.backend import AttentionImpl, DecodeRotary
from tokenmill.model.attention.torch_ref import TorchAttentionBackend


def _backends():
    backends = [TorchAttentionBackend]
    if _has_triton():
        from tokenmill.model.attention.triton_backend import TritonAttentionBackend

        backends.append(TritonAttentionBackend)
    return backends


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
def test_decode_rotary_is_implemented_where_declared(backend):
    impl_cls = backend.get_impl_cls()
    overrides = impl_cls.attend_decode_rotary is not AttentionImpl.attend_decode_rotary
    assert overrides == backend.supports_decode_rotary


def test_a_backend_without_it_says_so():
    impl = TorchAttentionBackend.get_impl_cls()(4, 16, 0.25, 2)
    x = torch.zeros(1, 64)
    rotary = DecodeRotary(torch.zeros(8, 16), 16, True)
    with pytest.raises(NotImplementedError, match="does not rotate inside attention"):
        AttentionImpl.attend_decode_rotary(impl, x, x[:, :32], x[:, :32],
                                           torch.zeros(2, 1, 16, 2, 16), None, rotary)
    assert not AttentionImpl.host_decode_rotary(impl, x, torch.zeros(2, 1, 16, 2, 16), None)


def test_the_layer_takes_the_fused_decode_path_only_where_declared(monkeypatch):
    from tokenmill.model.layers.attention import Attention

    layer = Attention(4, 16, 0.25, 2, 0, TorchAttentionBackend)
    assert layer.rope_in_decode == TorchAttentionBackend.supports_decode_rotary
    monkeypatch.setattr(TorchAttentionBackend, "supports_decode_rotary", False)
    assert not Attention(4, 16, 0.25, 2, 0, TorchAttentionBackend).rope_in_decode

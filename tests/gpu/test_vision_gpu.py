"""Qwen2.5-VL on CUDA: greedy tokens of image prompts are the same with CUDA graphs as
eagerly (float32), and the bf16 vision tower stays close to its float32 run.

The model is a small Qwen2.5-VL shape (2 text layers of 256, a 4-block vision tower with
window and full attention) with ``--load-format dummy`` weights: nothing is downloaded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.vlm_checkpoints import write_qwen2_5_vl_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory) -> str:
    text = dict(vocab_size=272, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                mrope_section=[8, 12, 12])  # fmt: skip
    vision = dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=2,
                  out_hidden_size=256, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3])  # fmt: skip
    return write_qwen2_5_vl_config(str(tmp_path_factory.mktemp("qwen2_5_vl")), text, vision)


def _chats() -> list[list[dict]]:
    from PIL import Image

    rng = np.random.RandomState(0)
    chats = []
    for i, (h, w) in enumerate([(224, 224), (336, 168), (112, 448)]):
        image = Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8))
        chats.append([{"role": "user", "content": [
            {"type": "text", "text": f"Picture {i}:"},
            {"type": "image_pil", "image_pil": image},
            {"type": "text", "text": "Describe it."},
        ]}])  # fmt: skip
    return chats


def _greedy(folder: str, dtype: str, enforce_eager: bool, **kwargs) -> list[list[int]]:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    llm = LLM(model=folder, load_format="dummy", dtype=dtype, enforce_eager=enforce_eager,
              max_model_len=2048, gpu_memory_utilization=0.3, seed=0, **kwargs)  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llm.chat(_chats(), params, use_tqdm=False)
    graphs = llm.llm_engine.engine_core.executor.worker.model_runner.graphs
    if not enforce_eager:  # the steps with image placeholders replayed the embedding pieces
        assert graphs is not None and graphs.images is not None
        assert graphs.images.num_replays > 0 and graphs.paths["images eager"] == 0
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("budget", [None, 96], ids=["whole", "chunks"])
def test_cuda_graphs_give_the_eager_greedy_tokens(vl_folder, budget):
    """Steps with image placeholders replay piecewise graphs over input embeddings (M-RoPE
    streams in a static buffer); whole prompts, and 96-token chunks that mix image and text
    tokens of several prompts."""
    kwargs = {} if budget is None else {"max_num_batched_tokens": budget}
    assert _greedy(vl_folder, "float32", False, **kwargs) == _greedy(
        vl_folder, "float32", True, **kwargs
    )


def test_bfloat16_tower_stays_close_to_float32(vl_folder):
    """The vision tower (varlen window attention in bf16) on the same weights and pixels as
    its float32 run: image embeddings within 3% relative error. (Greedy tokens of random
    dummy weights are near-ties, so they are no check of bf16 precision.)"""
    import json
    import os

    from transformers import AutoImageProcessor

    from tokenmill.model.models.qwen2_5_vl import _vision_tower

    config = json.load(open(os.path.join(vl_folder, "config.json")))
    torch.manual_seed(0)
    with torch.device("cuda"):
        tower = _vision_tower(config["vision_config"]).float().eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.05)
        for block in tower.blocks:
            block.mlp._zero_padding()
    chats = _chats()
    images = [chat[0]["content"][1]["image_pil"] for chat in chats]
    out = AutoImageProcessor.from_pretrained(vl_folder)(images=images, return_tensors="pt")
    pixels, grid = out["pixel_values"].cuda(), out["image_grid_thw"].cuda()
    with torch.no_grad():
        ref = tower(pixels, grid_thw=grid)
        ref = getattr(ref, "pooler_output", ref).float()
        low = tower.to(torch.bfloat16)(pixels.bfloat16(), grid_thw=grid)
        low = getattr(low, "pooler_output", low).float()
    assert low.shape == ref.shape
    assert ((low - ref).norm() / ref.norm()).item() < 0.03


def test_fused_tower_equals_the_torch_tower(vl_folder):
    """The tower's CUDA path (fused RMSNorm, patch rotary and SiLU gate kernels) in float32
    against its CPU torch path (transformers' formulas, checked against transformers on CPU)
    on the same weights and pixels."""
    import json
    import os

    from transformers import AutoImageProcessor

    from tokenmill.model.models.qwen2_5_vl import _vision_tower

    config = json.load(open(os.path.join(vl_folder, "config.json")))
    torch.manual_seed(0)
    tower = _vision_tower(config["vision_config"]).float().eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.05)
        for block in tower.blocks:  # padding stays zero, as loading keeps it
            block.mlp._zero_padding()
    images = [chat[0]["content"][1]["image_pil"] for chat in _chats()]
    out = AutoImageProcessor.from_pretrained(vl_folder)(images=images, return_tensors="pt")
    pixels, grid = out["pixel_values"], out["image_grid_thw"]
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # the patch embedding's Conv3d in full float32
    try:
        with torch.no_grad():
            ref = tower(pixels, grid_thw=grid)
            ref = getattr(ref, "pooler_output", ref)
            got = tower.cuda()(pixels.cuda(), grid_thw=grid.cuda())
            got = getattr(got, "pooler_output", got).cpu()
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-4)


def test_window_attention_varlen_matches_per_window_sdpa():
    """The vision tower's one-call FlashAttention varlen path (bf16) against the per-window
    SDPA reference on the same inputs, computed in float32."""
    from tokenmill.model.models import qwen2_5_vl_vision as vv

    if vv.varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    torch.manual_seed(0)
    attn = vv.VisionWindowAttention(dim=128, num_heads=2).cuda()
    cu = torch.tensor([0, 64, 100, 164, 260], dtype=torch.int32, device="cuda")
    hidden = torch.randn(260, 128, device="cuda")
    angles = torch.randn(260, 64, device="cuda")
    rope = (angles.cos(), angles.sin())
    with torch.no_grad():
        ref = attn(hidden, cu, rope)  # float32: per-window SDPA
        out = attn.to(torch.bfloat16)(hidden.bfloat16(), cu, rope)
    # outputs have std ~0.07; bf16 per-window SDPA on the CPU is within 1.2e-3 of float32
    torch.testing.assert_close(out.float(), ref, atol=4e-3, rtol=2e-2)


# CUDA float32 against the CPU's: the vision tower's convolution runs in TF32 on CUDA (torch's
# cuDNN default), so logits differ in the third decimal; a missing bidirectional mask moves
# them by tenths. Greedy tokens of these random models are not compared: near-ties flip.
GEMMA3_ATOL = 2e-2


def _raw_logits(logprobs: dict) -> torch.Tensor:
    return torch.tensor([logprobs[t].logprob for t in range(272)])


def test_gemma3_image_tokens_see_their_whole_image_on_the_gpu(tmp_path_factory):
    """Gemma 3 (image tokens attend to each other both ways, through the Triton prompt
    kernel's ``last_key_pos``): every prompt position's log-probs and the first generated
    token's raw logits on CUDA (float32) equal the CPU engine's (the torch reference), for a
    prompt with two images longer than the sliding window, in one step and in 32-token
    chunks."""
    from tests.gpu.vlm_gpu_checks import assert_cuda_matches_cpu
    from tests.model.vlm_checkpoints import random_image, write_gemma3_mm

    folder = write_gemma3_mm(str(tmp_path_factory.mktemp("gemma3_mm")))
    chat = [{"role": "user", "content": [
        {"type": "text", "text": "First:"},
        {"type": "image_pil", "image_pil": random_image(1, 64, 64)},
        {"type": "text", "text": "second:"},
        {"type": "image_pil", "image_pil": random_image(2, 90, 40)},
        {"type": "text", "text": "compare."},
    ]}]  # fmt: skip
    assert_cuda_matches_cpu(folder, chat, GEMMA3_ATOL)


def test_gemma3_prefix_cache_hits_inside_images_and_mixed_steps_on_the_gpu(tmp_path_factory):
    """Gemma 3 on CUDA (CUDA graphs for the decode and mixed steps without image tokens,
    eager steps with them) with prefix caching and 24-token steps: a batch of prompts that
    share images, run twice (the second run's cache hits end inside images), gives the
    CPU engine's raw logits for the first generated token."""
    from tests.model.vlm_checkpoints import random_image, write_gemma3_mm
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    folder = write_gemma3_mm(str(tmp_path_factory.mktemp("gemma3_mm_pc")))
    images = [random_image(i, 64, 64) for i in range(3)]
    prompts = []
    for pre in range(0, 16, 3):
        for k in range(2):
            text = "a" * pre + "<start_of_image>" + "y" * (k + 1) + "<start_of_image>" + "z" * k
            data = {"image": [images[0], images[1 + k]]}
            prompts += [{"prompt": text, "multi_modal_data": data},
                        {"prompt": "b" + text, "multi_modal_data": data}]  # fmt: skip
    prompts.append("text only, beside the images")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=272)
    common = dict(model=folder, dtype="float32", max_model_len=512, max_logprobs=272,
                  logprobs_mode="raw_logits")  # fmt: skip
    ref = LLM(**common, device="cpu").generate(prompts, params, use_tqdm=False)
    llm = LLM(**common, gpu_memory_utilization=0.2, enable_prefix_caching=True,
              max_num_batched_tokens=24)  # fmt: skip
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, r in zip(outs, ref, strict=True):
            torch.testing.assert_close(_raw_logits(out.outputs[0].logprobs[0]),
                                       _raw_logits(r.outputs[0].logprobs[0]),
                                       atol=GEMMA3_ATOL, rtol=0)  # fmt: skip
    assert sum(o.num_cached_tokens or 0 for o in outs) > 0
    del llm
    torch.cuda.empty_cache()

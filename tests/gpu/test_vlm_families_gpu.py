"""The vision-language families beyond Qwen2.5-VL and Gemma 3 on CUDA (float32) against the
CPU engine on the same random weights: every prompt position's raw logits and the first
generated token's, for a prompt with two images, in one step and in 32-token chunks (CUDA
graphs for the steps without image tokens). Qwen2-VL's and Qwen3-VL's towers take the
variable-length attention path, Qwen3-VL adds DeepStack features inside the decoder (its
image steps run eagerly), Mistral 3 and Pixtral-12B write row-break embeddings, InternVL
tiles its images."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.vlm_gpu_checks import assert_cuda_matches_cpu
from tests.model import vlm_checkpoints as ckpt

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

WRITERS = {
    "qwen2_vl": ckpt.write_qwen2_vl,
    "qwen3_vl": ckpt.write_qwen3_vl,
    "qwen3_vl_moe": lambda path: ckpt.write_qwen3_vl(path, moe=True),
    "mistral3": ckpt.write_mistral3,
    "pixtral_llava": lambda path: ckpt.write_mistral3(path, llava=True),
    "internvl": ckpt.write_internvl,
}
@pytest.mark.parametrize("family", list(WRITERS))
def test_cuda_equals_the_cpu_engine(family, tmp_path):
    folder = WRITERS[family](str(tmp_path / family))
    assert_cuda_matches_cpu(folder, [{"role": "user", "content": [
        {"type": "text", "text": "First:"},
        {"type": "image_pil", "image_pil": ckpt.random_image(1, 112, 84)},
        {"type": "text", "text": "second:"},
        {"type": "image_pil", "image_pil": ckpt.random_image(2, 60, 100)},
        {"type": "text", "text": "compare."},
    ]}])  # fmt: skip

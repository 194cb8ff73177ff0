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
# float32 on both sides; the GPU's attention and reductions differ in order (as for Gemma 3
# in test_vision_gpu.py).
ATOL = 2e-2


def _raw_logits(logprobs: dict) -> torch.Tensor:
    return torch.tensor([logprobs[t].logprob for t in range(272)])


@pytest.mark.parametrize("family", list(WRITERS))
def test_cuda_equals_the_cpu_engine(family, tmp_path):
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    folder = WRITERS[family](str(tmp_path / family))
    chat = [{"role": "user", "content": [
        {"type": "text", "text": "First:"},
        {"type": "image_pil", "image_pil": ckpt.random_image(1, 112, 84)},
        {"type": "text", "text": "second:"},
        {"type": "image_pil", "image_pil": ckpt.random_image(2, 60, 100)},
        {"type": "text", "text": "compare."},
    ]}]  # fmt: skip
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=272, prompt_logprobs=272)
    common = dict(model=folder, dtype="float32", max_model_len=512, max_logprobs=272,
                  logprobs_mode="raw_logits")  # fmt: skip
    runs = []
    for kwargs in (dict(device="cpu"), dict(gpu_memory_utilization=0.2),
                   dict(gpu_memory_utilization=0.2, max_num_batched_tokens=32)):  # fmt: skip
        llm = LLM(**common, **kwargs)
        runs.append(llm.chat(chat, params, use_tqdm=False)[0])
        del llm
        torch.cuda.empty_cache()
    ref = runs[0]
    for out in runs[1:]:
        assert out.prompt_token_ids == ref.prompt_token_ids
        for pos in range(1, len(ref.prompt_token_ids)):
            torch.testing.assert_close(_raw_logits(out.prompt_logprobs[pos]),
                                       _raw_logits(ref.prompt_logprobs[pos]),
                                       atol=ATOL, rtol=0)  # fmt: skip
        torch.testing.assert_close(_raw_logits(out.outputs[0].logprobs[0]),
                                   _raw_logits(ref.outputs[0].logprobs[0]),
                                   atol=ATOL, rtol=0)  # fmt: skip

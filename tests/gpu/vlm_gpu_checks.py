"""A vision-language model on CUDA against the CPU engine on the same weights (the GPU
tests of the image families share it)."""

from __future__ import annotations

import torch

# float32 on both sides; the GPU's attention and reductions differ in order.
ATOL = 2e-2


def _raw_logits(logprobs: dict) -> torch.Tensor:
    return torch.tensor([logprobs[t].logprob for t in range(272)])


def assert_cuda_matches_cpu(folder: str, chat: list[dict], atol: float = ATOL) -> None:
    """``chat`` on the model in ``folder`` (float32): every prompt position's raw logits and
    the first generated token's on CUDA, in one step and in 32-token chunks, within
    ``atol`` of the CPU engine's."""
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

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
                                       atol=atol, rtol=0)  # fmt: skip
        torch.testing.assert_close(_raw_logits(out.outputs[0].logprobs[0]),
                                   _raw_logits(ref.outputs[0].logprobs[0]),
                                   atol=atol, rtol=0)  # fmt: skip

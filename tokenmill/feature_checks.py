"""Start-up checks of engine features that do not combine yet (each refused in one line).

The parallel layouts' own checks are in ``distributed/config_checks.py``; per-request
refusals (beam search with speculative decoding, LoRA or pipeline stages) in
``engine/input_processor.py``.
"""

from __future__ import annotations

from tokenmill.config import ConfigError, ModelConfig


def check_feature_combinations(
    model_config: ModelConfig,
    *,
    speculative: bool,
    lora: bool,
    kv_cache_dtype: str,
    enable_sleep_mode: bool,
    kv_offloading: bool,
    model_parallel_size: int = 1,
) -> None:
    """Refuse the feature pairs the engine does not implement.

    Raises:
        ConfigError: speculative decoding with an MLA model, a model that takes images,
            sleep mode or KV offloading (the proposer's own weights and KV cache are
            neither released nor offloaded); LoRA with sleep mode (level 2 reloads the
            checkpoint, not the adapter slots); an FP8 KV cache with an MLA model (its
            latent cache has no FP8 path), as are FP8 weights (``--quantization fp8``);
            FP8 weights with tensor or pipeline parallelism (``model_parallel_size``: tensor
            x pipeline ranks; their loaders take whole tensors); a ``--logprobs-mode``
            other than raw logprobs with speculative decoding.
    """
    mla = model_config.use_mla
    images = model_config.multimodal_config is not None
    fp8_kv = kv_cache_dtype.startswith("fp8")
    refused = (
        (speculative and mla, "--speculative-config is not implemented for MLA models "
                              "(DeepSeek): their MTP layers are not served yet"),
        (speculative and images, "--speculative-config is not implemented for models that "
                                 "take images"),
        (speculative and enable_sleep_mode, "--speculative-config does not combine with "
                                            "--enable-sleep-mode yet"),
        (speculative and kv_offloading, "--speculative-config does not combine with "
                                        "--kv-offloading-size yet"),
        (lora and enable_sleep_mode, "--enable-lora does not combine with --enable-sleep-mode "
                                     "yet"),
        (fp8_kv and mla, f"--kv-cache-dtype {kv_cache_dtype} is not implemented for MLA models "
                         "(DeepSeek): use auto"),
        (mla and model_config.quantization == "fp8", "--quantization fp8 is not implemented "
                                                     "for MLA models (DeepSeek)"),
        (speculative and model_config.logprobs_mode != "raw_logprobs",
         f"--logprobs-mode {model_config.logprobs_mode} does not combine with "
         "--speculative-config yet (its verification returns raw logprobs)"),
    )  # fmt: skip
    for on, message in refused:
        if on:
            raise ConfigError(message)
    if model_parallel_size > 1 and _fp8_weights(model_config):
        raise ConfigError(
            f"FP8 weights ({model_config.quantization}) are not implemented with tensor or "
            "pipeline parallelism yet: run them on one GPU per engine (-dp replicates it)"
        )


def _fp8_weights(model_config: ModelConfig) -> bool:
    """Whether the model runs FP8 weights (``fp8``, or a compressed-tensors FP8 checkpoint)."""
    method = model_config.quantization
    if method == "compressed-tensors":
        from tokenmill.model.layers.quantization.compressed_tensors import is_fp8

        return is_fp8(model_config.hf_config.get("quantization_config") or {})
    return method == "fp8"


def check_kv_cache_dtype(kv_cache_dtype: str, device: str) -> None:
    """Raises ConfigError: an FP8 cache on a GPU whose kernels cannot convert to FP8."""
    if kv_cache_dtype.startswith("fp8") and device == "cuda":
        import torch

        if torch.cuda.get_device_capability() < (8, 9):
            raise ConfigError(
                f"--kv-cache-dtype {kv_cache_dtype} needs a GPU of compute capability "
                "8.9 or newer (Ada, Hopper); use auto"
            )

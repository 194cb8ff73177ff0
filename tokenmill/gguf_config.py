"""Map a GGUF file's metadata (llama.cpp's format) onto config.json keys.

``read_gguf_config`` reads ``<arch>.*`` metadata as llama.cpp's loader does and fills in
what llama.cpp's graphs fix rather than store (layer patterns, softmax scales, routing),
so a model built from the result runs what llama.cpp runs. Torch-free.
"""

from __future__ import annotations

import os
import re
from typing import Any

from tokenmill.load_errors import ModelLoadError

# GGUF architecture name -> (HF architecture, HF model_type)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma": ("GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2"),  # V3 with sigmoid gating
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
    "llama4": ("Llama4ForCausalLM", "llama4_text"),
}

# ggml's type id of MXFP4 (GGMLQuantizationType.MXFP4): gpt-oss' experts in GGUF files.
GGML_MXFP4 = 39

# GGUF metadata key (after "<arch>.") -> config.json key
GGUF_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "final_logit_softcapping": "final_logit_softcapping",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "rope.freq_base_swa": "rope_local_base_freq",
    "expert_count": "num_local_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "interleave_moe_layer_step": "interleave_moe_layer_step",
}

# llama.cpp's Llama 4 graph (llama-model.cpp, LLM_ARCH_LLAMA4; llama-graph.cpp): RoPE layers
# attend within chunks of 8192 tokens, every fourth layer is NoPE, and the NoPE layers scale
# their queries by 1 + 0.1 * log(1 + floor((pos + 1) / 8192)); none of these is in the file.
LLAMA4_CHUNK_SIZE = 8192
LLAMA4_NO_ROPE_LAYER_STEP = 4
LLAMA4_ATTN_TEMP_FLOOR_SCALE = 8192
LLAMA4_ATTN_TEMP_SCALE = 0.1
# llama.cpp turns QK-norm off for the 128-expert model (Maverick) and on otherwise.
LLAMA4_NO_QK_NORM_EXPERTS = 128

# llama.cpp's Gemma 3 graph: five sliding-window layers per global one, local RoPE base 1e4.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_27B_LAYERS = 62
GEMMA2_27B_LAYERS = 46


def _gguf_field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.contents()
    return value


def open_gguf(path: str) -> Any:
    """Open a GGUF file with the gguf package's reader.

    Raises:
        ModelLoadError: the file cannot be parsed; one that ends before its last tensor's
            data (an interrupted download) is named as truncated.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors on bad files
        # The reader maps each tensor's bytes and reshapes them: a file cut short yields
        # fewer elements than the tensor's shape and numpy's reshape (or, cut inside the
        # header's last values, a view of the wrong size) is what fails.
        if isinstance(e, ValueError) and ("reshape" in str(e) or "larger dtype" in str(e)):
            size = os.path.getsize(path)
            raise ModelLoadError(
                f"GGUF file {path} is truncated: its {size} bytes end before its tensor "
                "data does (an interrupted download?)"
            ) from e
        if isinstance(e, ValueError) and "GGMLQuantizationType" in str(e):
            raise ModelLoadError(
                f"GGUF file {path} has a tensor of a type the gguf package does not know "
                f"({e}): a newer llama.cpp type, or a corrupt header"
            ) from e
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    check_tensor_layout(reader, path)
    return reader


def check_tensor_layout(reader: Any, path: str) -> None:
    """Each tensor's data must start where the one before it ends (padded to the file's
    alignment), as llama.cpp's loader requires: a header whose types or shapes were
    changed without the data would otherwise be read as other values.

    Raises:
        ModelLoadError: naming the first tensor whose data is not where the header puts it.
    """
    align = int(reader.alignment)
    expected = int(reader.data_offset)
    before = None
    for t in reader.tensors:
        if int(t.data_offset) != expected:
            after = f"the end of tensor {before.name!r} ({before.tensor_type.name}, " \
                f"{int(before.n_bytes)} bytes)" if before is not None else "the data section"
            raise ModelLoadError(
                f"GGUF file {path} is inconsistent: tensor {t.name!r} starts at byte "
                f"{int(t.data_offset)}, not at {after} (byte {expected}): the tensor types "
                "or shapes in its header do not match its data"
            )
        expected += -(-int(t.n_bytes) // align) * align
        before = t


def read_gguf_config(path: str) -> dict[str, Any]:
    """Map a GGUF file's metadata onto config.json keys.

    Raises:
        ModelLoadError: the file cannot be parsed or its architecture is not known.
    """
    reader = open_gguf(path)
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {path} has architecture {arch!r}; supported: "
            f"{sorted(GGUF_ARCHITECTURES)}"
        )
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    data: dict[str, Any] = {"architectures": [hf_arch], "model_type": model_type}
    for key, hf_key in GGUF_KEYS.items():
        value = _gguf_field(reader, f"{arch}.{key}")
        if value is not None:
            data[hf_key] = value
    if "vocab_size" not in data:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            data["vocab_size"] = len(tokens.data)
    for key, hf_key in (("attention.head_count", "num_attention_heads"),
                        ("embedding_length", "hidden_size")):  # fmt: skip
        if not isinstance(data.get(hf_key), int) or data[hf_key] < 1:
            raise ModelLoadError(f"GGUF file {path} has no positive {arch}.{key}")
    if "intermediate_size" not in data:
        raise ModelLoadError(f"GGUF file {path} has no {arch}.feed_forward_length")
    if "head_dim" not in data:
        data["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
    data.setdefault("num_key_value_heads", data["num_attention_heads"])
    scaling_type = _gguf_field(reader, f"{arch}.rope.scaling.type")
    if scaling_type and scaling_type != "none":
        scaling = {"rope_type": scaling_type}
        factor = _gguf_field(reader, f"{arch}.rope.scaling.factor")
        if factor is not None:
            scaling["factor"] = float(factor)
        orig = _gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        data["rope_scaling"] = scaling
    for key, hf_key in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ):
        value = _gguf_field(reader, key)
        if value is not None:
            data[hf_key] = int(value)
    tensor_names = {t.name for t in reader.tensors}
    data["tie_word_embeddings"] = "output.weight" not in tensor_names
    data["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "qwen2moe":
        # llama.cpp's graph: q/k/v biases as the file has them, raw top-k router weights
        # unless the file says to renormalise them.
        data["qkv_bias"] = data["attention_bias"]
        data["norm_topk_prob"] = bool(_gguf_field(reader, f"{arch}.expert_weights_norm"))
    data["_gguf_architecture"] = arch
    _derive_moe_config(data, arch, _gguf_field(reader, f"{arch}.expert_weights_norm"))
    if arch == "gemma3":
        _derive_gemma3_config(data, _gguf_field(reader, f"{arch}.attention.sliding_window_pattern"))
    elif arch in ("gemma", "gemma2"):
        _derive_gemma_config(data, arch)
    elif arch == "deepseek2":
        _derive_deepseek2_config(data, lambda key: _gguf_field(reader, f"{arch}.{key}"))
    elif arch == "gpt-oss":
        _derive_gpt_oss_config(data, {t.name: int(t.tensor_type) for t in reader.tensors})
    elif arch == "llama4":
        _derive_llama4_config(data, lambda key: _gguf_field(reader, f"{arch}.{key}"), path)
    if arch in ("llama", "llama4"):
        _rope_freq_factors(data, reader, path)
    return data


def gguf_experts_are_mxfp4(tensor_types: dict[str, int]) -> bool:
    """Whether every expert weight of a file (``ffn_*_exps.weight`` name -> ggml type) is
    MXFP4; False for a file without experts."""
    types = [t for name, t in tensor_types.items() if re.search(r"ffn_\w+_exps\.weight$", name)]
    return bool(types) and all(t == GGML_MXFP4 for t in types)


def _derive_gpt_oss_config(data: dict[str, Any], tensor_types: dict[str, int]) -> None:
    """What llama.cpp's gpt-oss graph fixes rather than stores: even layers sliding (its
    sliding-window pattern of 2); the experts' size is the expert feed-forward length. Its
    YaRN rounds the correction range to whole dimensions (transformers' ``truncate``, the
    default here, where the released config turns it off). Experts that are all MXFP4 in
    the file stay MXFP4 (the released checkpoint's ``quantization_config``)."""
    if data.get("moe_intermediate_size"):
        data["intermediate_size"] = data.pop("moe_intermediate_size")
    data["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                           for i in range(data["num_hidden_layers"])]  # fmt: skip
    if gguf_experts_are_mxfp4(tensor_types):
        data["quantization_config"] = {"quant_method": "mxfp4"}


def _derive_gemma_config(data: dict[str, Any], arch: str) -> None:
    """Fill what llama.cpp's Gemma and Gemma 2 graphs fix rather than store: tanh GELU, and
    for Gemma 2 its even layers sliding and the softmax scale (``head_dim^-0.5``, but
    ``(hidden_size / num_heads)^-0.5`` for the 27B model of 46 layers)."""
    data.setdefault("hidden_activation", "gelu_pytorch_tanh")
    if arch != "gemma2":
        return
    n = data["num_hidden_layers"]
    data["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                           for i in range(n)]  # fmt: skip
    if n == GEMMA2_27B_LAYERS:
        data.setdefault("query_pre_attn_scalar", data["hidden_size"] // data["num_attention_heads"])
    data.setdefault("query_pre_attn_scalar", data["head_dim"])


def _derive_moe_config(data: dict[str, Any], arch: str, weights_norm: Any) -> None:
    """Mixture-of-experts files: llama.cpp writes Mixtral as architecture ``llama`` with an
    expert count; Qwen3-MoE renormalises its top-k routing weights (llama.cpp's graph does
    unless the file says otherwise)."""
    if not data.get("num_local_experts"):
        data.pop("num_local_experts", None)
        return
    if arch == "llama":
        data["architectures"], data["model_type"] = ["MixtralForCausalLM"], "mixtral"
    elif arch == "qwen3moe":
        data["norm_topk_prob"] = True if weights_norm is None else bool(weights_norm)


# llama.cpp's expert_gating_func values.
GGUF_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


def _derive_deepseek2_config(data: dict[str, Any], field: Any) -> None:
    """DeepSeek-V2/V3 settings from llama.cpp's ``deepseek2`` metadata (``field(key)``: the
    value of ``deepseek2.<key>`` or None), as its converter writes them.

    The converter stores MLA as multi-query attention over the latent: ``head_count_kv`` 1,
    ``key_length`` ``kv_lora_rank + rope`` and the per-head sizes in ``key_length_mla`` /
    ``value_length_mla`` (older files: ``key_length`` ``nope + rope``, ``value_length`` the
    value head). Sigmoid gating means DeepSeek-V3 (and its correction bias); YaRN's
    ``yarn_log_multiplier`` is ``0.1 * mscale_all_dim`` (``mscale`` equal to it, as in
    DeepSeek's released configs).
    """
    rope = int(field("rope.dimension_count"))
    key = field("attention.key_length_mla") or field("attention.key_length")
    value = field("attention.value_length_mla") or field("attention.value_length")
    data.pop("head_dim", None)
    data["num_key_value_heads"] = data["num_attention_heads"]
    data.update(
        qk_rope_head_dim=rope,
        qk_nope_head_dim=int(key) - rope,
        v_head_dim=int(value),
        kv_lora_rank=int(field("attention.kv_lora_rank")),
        q_lora_rank=field("attention.q_lora_rank") or None,
        first_k_dense_replace=int(field("leading_dense_block_count") or 0),
        n_shared_experts=int(field("expert_shared_count") or 0),
        routed_scaling_factor=float(field("expert_weights_scale") or 1.0),
        norm_topk_prob=bool(field("expert_weights_norm")),
        n_group=int(field("expert_group_count") or 1),
        topk_group=int(field("expert_group_used_count") or 1),
    )
    if "num_local_experts" in data:
        data["n_routed_experts"] = data.pop("num_local_experts")
    scoring = GGUF_GATING_FUNCS.get(int(field("expert_gating_func") or 1), "softmax")
    data["scoring_func"] = scoring
    if scoring == "sigmoid":
        data["architectures"], data["model_type"] = ["DeepseekV3ForCausalLM"], "deepseek_v3"
        data["topk_method"] = "noaux_tc"
    else:
        data["topk_method"] = "group_limited_greedy" if data["n_group"] > 1 else "greedy"
    log_mul = field("rope.scaling.yarn_log_multiplier")
    if data.get("rope_scaling") and log_mul:
        mscale = float(log_mul) / 0.1
        data["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale)


def _derive_gemma3_config(data: dict[str, Any], pattern: Any) -> None:
    """Fill the Gemma 3 settings a GGUF file leaves implicit, as llama.cpp's Gemma 3 graph
    fixes them: the layer pattern (every sixth layer global unless the file lists per-layer
    sliding flags), the local RoPE base, tanh GELU, and the softmax scale.

    NOTE: llama.cpp scales queries by ``head_dim^-0.5`` except for the 27B model (62 layers),
    which uses ``(hidden_size / num_heads)^-0.5``. transformers instead keeps its default
    ``query_pre_attn_scalar`` of 256, which agrees for every size but 27B.
    """
    n = data["num_hidden_layers"]
    if isinstance(pattern, list) and len(pattern) == n:
        sliding = [bool(p) for p in pattern]
    else:
        every = int(pattern) if isinstance(pattern, int) and pattern > 0 else None
        every = every or GEMMA3_SLIDING_WINDOW_PATTERN
        sliding = [bool((i + 1) % every) for i in range(n)]
    data["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    data.setdefault("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA)
    data.setdefault("hidden_activation", "gelu_pytorch_tanh")
    if n == GEMMA3_27B_LAYERS:
        data.setdefault("query_pre_attn_scalar", data["hidden_size"] // data["num_attention_heads"])
    data.setdefault("query_pre_attn_scalar", data["head_dim"])


def _derive_llama4_config(data: dict[str, Any], field: Any, path: str) -> None:
    """Llama 4 text settings (transformers' ``Llama4TextConfig``) from a ``llama4`` file's
    metadata (``field(key)``: the value of ``llama4.<key>`` or None) and what llama.cpp's
    graph fixes.

    The converter stores the dense layers' MLP size (``intermediate_size_mlp``) as
    ``feed_forward_length`` and the experts' and shared expert's (``intermediate_size``) as
    ``expert_feed_forward_length``. Routing is sigmoid top-``expert_used_count`` with the
    router weight applied to the expert's input, as the model always does.

    Raises:
        ModelLoadError: a file with ``attention.sliding_window`` 0 (llama.cpp's variant
            without chunked attention or NoPE layers), or no ``expert_feed_forward_length``.
    """
    window = field("attention.sliding_window")
    if window is not None and int(window) == 0:
        raise ModelLoadError(
            f"GGUF file {path}: a llama4 file with attention.sliding_window 0 (every layer "
            "full attention, llama.cpp's MobileLLM variant) is not supported"
        )
    data.pop("sliding_window", None)
    if not data.get("moe_intermediate_size"):
        raise ModelLoadError(f"GGUF file {path} has no llama4.expert_feed_forward_length")
    data["intermediate_size_mlp"] = data["intermediate_size"]
    data["intermediate_size"] = data.pop("moe_intermediate_size")
    if field("attention.key_length") is None and field("rope.dimension_count"):
        data["head_dim"] = int(field("rope.dimension_count"))
    n = data["num_hidden_layers"]
    experts = int(data.get("num_local_experts") or 0)
    data.update(
        interleave_moe_layer_step=int(data.get("interleave_moe_layer_step") or 1),
        num_experts_per_tok=int(data.get("num_experts_per_tok") or 1),
        no_rope_layers=[int((i + 1) % LLAMA4_NO_ROPE_LAYER_STEP != 0) for i in range(n)],
        attention_chunk_size=LLAMA4_CHUNK_SIZE,
        attn_temperature_tuning=True,
        floor_scale=LLAMA4_ATTN_TEMP_FLOOR_SCALE,
        attn_scale=LLAMA4_ATTN_TEMP_SCALE,
        use_qk_norm=experts != LLAMA4_NO_QK_NORM_EXPERTS,
        hidden_act="silu",
    )
    if not experts:  # no MoE layers (``_derive_moe_config`` dropped the count)
        data["moe_layers"] = []


def _rope_freq_factors(data: dict[str, Any], reader: Any, path: str) -> None:
    """The converter turns the llama3 RoPE scaling of Llama 3.1+ and Llama 4 into a
    ``rope_freqs`` tensor of ``head_dim / 2`` factors, each frequency divided by its factor
    (the metadata has no scaling type), which llama.cpp's ``llama`` and ``llama4`` graphs
    apply. They become ``rope_scaling`` of type ``longrope`` with those factors for short and
    long contexts alike and an attention factor of 1: the same frequencies, whatever the
    converter's parameters were.

    Raises:
        ModelLoadError: a ``rope_freqs`` tensor of another size than ``head_dim / 2``.
    """
    import numpy as np

    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return
    factors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    head_dim = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
    if factors.size != head_dim // 2:
        raise ModelLoadError(
            f"GGUF file {path}: rope_freqs.weight has {factors.size} factors, not head_dim / 2 "
            f"({head_dim // 2})"
        )
    values = [float(f) for f in factors]
    data["rope_scaling"] = {
        "rope_type": "longrope", "short_factor": values, "long_factor": values,
        "attention_factor": 1.0,
        "original_max_position_embeddings": data.get("max_position_embeddings"),
    }  # fmt: skip

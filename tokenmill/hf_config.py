"""Read a model's configuration from a Hugging Face folder or a GGUF file's metadata.

Both end up as an ``HFConfig``: the keys of config.json (GGUF metadata is mapped onto
them), with the rotary-embedding settings normalised to ``rope_theta`` plus
``rope_scaling`` (a dict with ``rope_type``, or None) whichever transformers version
wrote the file. Torch-free, so configuration can be resolved without loading torch.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any


class ModelLoadError(RuntimeError):
    """A model file is missing, unreadable or inconsistent; the message names it."""


class HFConfig:
    """Attribute access over a config.json dict; missing keys raise AttributeError.

    ``get(key, default)`` reads optional keys. ``to_dict()`` returns the underlying dict.
    """

    def __init__(self, data: dict[str, Any]):
        object.__setattr__(self, "_data", dict(data))

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__") or key == "_data":  # pickling probes dunders before _data exists
            raise AttributeError(key)
        try:
            return self._data[key]
        except KeyError:
            raise AttributeError(f"model config has no field {key!r}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self._data[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        value = self._data.get(key, default)
        return default if value is None else value

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)

    def __repr__(self) -> str:
        return f"HFConfig({self._data!r})"


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def normalize_rope(data: dict[str, Any]) -> dict[str, Any]:
    """Fold transformers-5 ``rope_parameters`` and older ``rope_scaling`` into one form.

    Afterwards ``rope_theta`` is a float and ``rope_scaling`` is None (plain RoPE) or a dict
    with ``rope_type`` ("llama3", "linear", "dynamic", "yarn", "longrope", ...). Per-layer-type
    parameters (Gemma 3: ``{"full_attention": {...}, "sliding_attention": {...}}``) are
    kept as they are in ``rope_parameters`` for the model to read.
    """
    data = dict(data)
    params = data.get("rope_parameters")
    if isinstance(params, dict) and ("rope_type" in params or "rope_theta" in params):
        params = dict(params)
        data.setdefault("rope_theta", params.pop("rope_theta", None))
        if params.get("rope_type", "default") != "default" and not data.get("rope_scaling"):
            data["rope_scaling"] = params
    scaling = data.get("rope_scaling")
    for source in (params, scaling):  # M-RoPE (Qwen2-VL): plain RoPE over three streams
        if isinstance(source, dict) and source.get("mrope_section"):
            data.setdefault("mrope_section", list(source["mrope_section"]))
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        rope_type = scaling.pop("type", None) or scaling.get("rope_type", "default")
        if rope_type == "mrope":
            rope_type = "default"
        scaling["rope_type"] = rope_type
        if rope_type in ("longrope", "su") and data.get("original_max_position_embeddings"):
            # Phi-3 configs before transformers 5 keep this length at the top level.
            scaling.setdefault(
                "original_max_position_embeddings", data["original_max_position_embeddings"]
            )
        data["rope_scaling"] = None if rope_type == "default" else scaling
    else:
        data["rope_scaling"] = None
    if data.get("rope_theta") is None:
        data["rope_theta"] = 10000.0
    data["rope_theta"] = float(data["rope_theta"])
    return data


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
}

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


# Quantization settings that older AutoGPTQ / AutoAWQ checkpoints keep beside config.json
# instead of in its quantization_config (vLLM reads them too): file -> method when unnamed.
SEPARATE_QUANT_CONFIGS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def _with_separate_quant_config(model: str, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the ``quantization_config`` of a separate file, if the folder has one."""
    for name, method in SEPARATE_QUANT_CONFIGS.items():
        path = os.path.join(model, name)
        if os.path.isfile(path):
            qc = _read_json(path)
            if not isinstance(qc, dict):
                raise ModelLoadError(f"{path} must hold a JSON object")
            return {**data, "quantization_config": {"quant_method": method, **qc}}
    return data


def load_hf_config(
    model: str, overrides: dict[str, Any] | None = None
) -> tuple[HFConfig, dict[str, Any]]:
    """Read a model's config and generation config.

    Args:
        model: a Hugging Face model folder (with config.json) or a ``.gguf`` file.
        overrides: keys replacing the config's (``--hf-overrides``), applied to the
            language model's settings before they are checked.

    Returns:
        ``(config, generation_config)``; the second is ``{}`` when the model has none.

    Raises:
        ModelLoadError: the path does not exist or holds no readable config.
    """
    if not os.path.exists(model):
        raise ModelLoadError(
            f"model path {model!r} does not exist (tokenmill loads models from a local "
            f"folder or .gguf file; it never downloads)"
        )
    generation_config: dict[str, Any] = {}
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ModelLoadError(f"{model} is a file but not a .gguf file")
        data = read_gguf_config(model)
    else:
        config_path = os.path.join(model, "config.json")
        if not os.path.isfile(config_path):
            raise ModelLoadError(f"{model} has no config.json")
        data = _read_json(config_path)
        if "quantization_config" not in data:
            data = _with_separate_quant_config(model, data)
        gen_path = os.path.join(model, "generation_config.json")
        if os.path.isfile(gen_path):
            generation_config = _read_json(gen_path)
    # Multimodal wrappers keep the language model's settings in text_config; the wrapper's
    # own keys (vision_config, image_token_id, ...) stay beside them.
    if "text_config" in data and "num_hidden_layers" not in data:
        text = dict(data["text_config"])
        for key, value in data.items():
            if key != "text_config":
                text.setdefault(key, value)
        data = text
    if overrides:
        data = {**data, **overrides}
    for key in ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        if key not in data:
            raise ModelLoadError(f"the config of {model} has no {key!r}")
    _check_heads(data, model)
    _check_kinds(data, model)
    data = normalize_rope(data)
    _check_numbers(data, model, POSITIVE_INTS, POSITIVE_FLOATS)
    return HFConfig(data), generation_config


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_kinds(data: dict[str, Any], model: str) -> None:
    """The keys whose wrong kind of value would fail later, deep in the engine.

    Raises:
        ModelLoadError: ``architectures`` not a non-empty list of names, ``eos_token_id``
            not a token id or list of them, ``sliding_window`` not null or an integer >= 0.
    """
    arch = data["architectures"]
    if not isinstance(arch, list) or not arch or not all(isinstance(a, str) for a in arch):
        raise ModelLoadError(
            f"the config of {model}: architectures must be a non-empty list of names, got "
            f"{arch!r}"
        )
    eos = data.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    if eos is not None and not all(_is_int(i) and i >= 0 for i in ids):
        raise ModelLoadError(
            f"the config of {model}: eos_token_id must be a token id or a list of them, got "
            f"{eos!r}"
        )
    window = data.get("sliding_window")
    if window is not None and not (_is_int(window) and window >= 0):
        raise ModelLoadError(
            f"the config of {model}: sliding_window must be null or an integer >= 0, got "
            f"{window!r}"
        )


def _check_heads(data: dict[str, Any], model: str) -> None:
    """Head counts the attention layers can be built from (lists of per-layer counts are
    checked by the model).

    Raises:
        ModelLoadError: a head count that is not a positive integer, or query heads that
            the key/value heads do not divide.
    """
    counts = ("num_attention_heads", "num_key_value_heads")
    _check_numbers(data, model, tuple(k for k in counts
                                      if not isinstance(data.get(k), (list, tuple))), ())
    heads = data["num_attention_heads"]
    kv = data.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ModelLoadError(
            f"the config of {model}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv})"
        )


# Sizes that must be positive integers and constants that must be positive finite numbers,
# where a config has them (a wrong one would build a model that answers garbage or fails
# mid-start-up).
POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
                 "head_dim", "moe_intermediate_size", "num_local_experts", "num_experts",
                 "max_position_embeddings")
POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta")
_GGUF_KEY_OF = {hf: gguf for gguf, hf in GGUF_KEYS.items()}


def _check_numbers(
    data: dict[str, Any], model: str, ints: tuple[str, ...], floats: tuple[str, ...]
) -> None:
    """The keys ``ints`` positive integers and ``floats`` positive finite numbers, where
    ``data`` has them.

    Raises:
        ModelLoadError: a value out of range, naming its key (and for GGUF files the GGUF
            key it came from).
    """
    for keys, what, ok in (
        (ints, "a positive integer", lambda v: isinstance(v, int) and v >= 1),
        (floats, "a positive finite number",
         lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 0),
    ):
        for key in keys:
            value = data.get(key)
            # bool is an int in Python: `true` is not a size.
            if value is None or (ok(value) and not isinstance(value, bool)):
                continue
            where = key
            if model.endswith(".gguf") and key in _GGUF_KEY_OF:
                where = f"{key} (GGUF key {_GGUF_KEY_OF[key]})"
            raise ModelLoadError(
                f"the config of {model}: {where} must be {what}, got {value!r}"
            )


def derive_max_model_len(config: HFConfig) -> int:
    """The longest context the model supports, as vLLM derives it from config.json."""
    derived = None
    for key in (
        "max_position_embeddings",
        "n_positions",
        "max_seq_len",
        "seq_length",
        "max_sequence_length",
    ):
        value = config.get(key)
        if value is not None:
            derived = value if derived is None else min(derived, value)
    if derived is None:
        derived = 2048
    scaling = config.get("rope_scaling")
    # Gemma 3's max_position_embeddings already counts its (global layers') linear scaling.
    if isinstance(scaling, dict) and config.get("model_type") not in ("gemma3", "gemma3_text"):
        rope_type = scaling.get("rope_type")
        factor = scaling.get("factor", 1.0)
        if rope_type == "yarn" and "original_max_position_embeddings" in scaling:
            derived = int(scaling["original_max_position_embeddings"] * factor)
        elif rope_type in ("linear", "dynamic"):
            derived = int(derived * factor)
    return int(derived)

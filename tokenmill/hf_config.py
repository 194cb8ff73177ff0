"""Read a model's configuration from a Hugging Face folder or a GGUF file's metadata.

Both end up as an ``HFConfig``: the keys of config.json (GGUF metadata is mapped onto
them), with the rotary-embedding settings normalised to ``rope_theta`` plus
``rope_scaling`` (a dict with ``rope_type``, or None) whichever transformers version
wrote the file. Torch-free, so configuration can be resolved without loading torch.
"""

from __future__ import annotations

import json
import os
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
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        rope_type = scaling.pop("type", None) or scaling.get("rope_type", "default")
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
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}

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
}

# llama.cpp's Gemma 3 graph: five sliding-window layers per global one, local RoPE base 1e4.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_27B_LAYERS = 62


def _gguf_field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.contents()
    return value


def read_gguf_config(path: str) -> dict[str, Any]:
    """Map a GGUF file's metadata onto config.json keys.

    Raises:
        ModelLoadError: the file cannot be parsed or its architecture is not known.
    """
    import gguf  # imported here: only GGUF users pay for it

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors on bad files
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
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
    data["_gguf_architecture"] = arch
    _derive_moe_config(data, arch, _gguf_field(reader, f"{arch}.expert_weights_norm"))
    if arch == "gemma3":
        _derive_gemma3_config(data, _gguf_field(reader, f"{arch}.attention.sliding_window_pattern"))
    return data


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


def load_hf_config(model: str) -> tuple[HFConfig, dict[str, Any]]:
    """Read a model's config and generation config.

    Args:
        model: a Hugging Face model folder (with config.json) or a ``.gguf`` file.

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
        gen_path = os.path.join(model, "generation_config.json")
        if os.path.isfile(gen_path):
            generation_config = _read_json(gen_path)
    # Multimodal wrappers keep the language model's settings in text_config.
    if "text_config" in data and "num_hidden_layers" not in data:
        text = dict(data["text_config"])
        text.setdefault("architectures", data.get("architectures"))
        data = text
    for key in ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        if key not in data:
            raise ModelLoadError(f"the config of {model} has no {key!r}")
    return HFConfig(normalize_rope(data)), generation_config


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

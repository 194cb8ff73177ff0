"""Read a model's configuration from a Hugging Face folder or a GGUF file's metadata.

Both end up as an ``HFConfig``: the keys of config.json (``tokenmill.gguf_config`` maps
GGUF metadata onto them), with the rotary-embedding settings normalised to ``rope_theta``
plus ``rope_scaling`` (a dict with ``rope_type``, or None) whichever transformers version
wrote the file. Torch-free, so configuration can be resolved without loading torch.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from tokenmill.gguf_config import GGUF_KEYS, read_gguf_config
from tokenmill.load_errors import ModelLoadError as ModelLoadError


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

"""PEFT adapter folders: ``adapter_config.json`` + ``adapter_model.safetensors`` (or
``adapter_model.bin`` is refused: safetensors only), as ``peft``'s ``save_pretrained``
writes them.

A LoRA adapter adds ``scale * B (A x)`` to a linear layer's output, ``A [r, in]``,
``B [out, r]``; ``scale = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA (Kalajdzievski
2023, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA"), each module's r and
alpha those of ``rank_pattern``/``alpha_pattern`` where a key names it. Weight names are
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``, ``<module>`` the base
model's (e.g. ``model.layers.3.self_attn.q_proj``).

Targets are the attention and MLP projections, or the checkpoint tensors that fuse them
(Phi-3's ``qkv_proj`` and ``gate_up_proj``: one A, B over every part's output features).

Checked here, so that an adapter the engine cannot serve is refused in one line: a rank above
``--max-lora-rank``, DoRA and peft's other variants whose forward is not ``B A x``
(activated LoRA, Arrow, KaSA, MonteCLoRA, BD-LoRA), ``modules_to_save``, embedding or LM-head
targets, LoRA biases, and targets other than the attention and MLP projections.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

# The projections an adapter may target: tokenmill's LoRA layers wrap these.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Checkpoint projections that hold several of them (Phi-3's): an adapter of one adds
# ``B A x`` over all of their output features.
FUSED_TARGETS = ("qkv_proj", "gate_up_proj")
TARGETS = SUPPORTED_TARGETS + FUSED_TARGETS
CONFIG_NAME = "adapter_config.json"
# peft's shorthand for every linear layer but the output layer, as target_modules
ALL_LINEAR = "all-linear"
WEIGHT_DTYPES = ("float16", "bfloat16", "float32", "float64")
WEIGHTS_NAME = "adapter_model.safetensors"
_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<ab>lora_[AB])(?:\.default)?\.weight$"
)


class LoRAAdapterError(ValueError):
    """An adapter folder that cannot be served; the message says why."""


@dataclass(frozen=True)
class PEFTConfig:
    """The parts of ``adapter_config.json`` serving needs.

    Attributes:
        rank: ``r``.
        scale: the factor on ``B A x`` (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).
        target_modules: module names (or dotted suffixes of them) the adapter targets, a
            regular expression over full module names, or ``"all-linear"``.
        base_model_name: ``base_model_name_or_path``, if given.
        rank_pattern, alpha_pattern: ``(pattern, r or lora_alpha)`` of the modules whose
            rank or alpha is not the adapter's (peft's ``rank_pattern``/``alpha_pattern``;
            ``module_rank_scale`` reads them).
        alpha: ``lora_alpha``.
        rslora: ``use_rslora``.
        layers: ``layers_to_transform``: the layer indices a listed target applies to
            (None: all).
        layers_pattern: ``layers_pattern``: the names of the layer lists those indices
            follow (empty: the first numbered part of a module name).
        exclude_modules: modules left out, named as in ``target_modules`` (None: none).
    """

    rank: int
    scale: float
    target_modules: tuple[str, ...] | str
    base_model_name: str | None
    layers: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] | str | None = None
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    alpha: float = 8.0
    rslora: bool = False


def read_peft_config(path: str, max_rank: int) -> PEFTConfig:
    """Read and check an adapter folder's ``adapter_config.json`` (no weights are read).

    Args:
        path: the adapter folder.
        max_rank: ``--max-lora-rank``.

    Raises:
        LoRAAdapterError: no such folder or files, not a LoRA adapter, a rank above
            ``max_rank``, or a feature tokenmill does not serve (the message names it).
    """
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"no adapter folder at {path!r}")
    if not os.path.isfile(config_path):
        raise LoRAAdapterError(f"{path!r} has no {CONFIG_NAME}")
    if not os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        raise LoRAAdapterError(f"{path!r} has no {WEIGHTS_NAME} (only safetensors are read)")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, not UTF-8
        raise LoRAAdapterError(f"cannot read {config_path}: {e}") from None
    if not isinstance(raw, dict):
        raise LoRAAdapterError(f"{config_path} is not a JSON object")
    return _check_config(raw, path, max_rank)


def _check_config(raw: dict[str, Any], path: str, max_rank: int) -> PEFTConfig:
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{path!r} is a {peft_type} adapter; only LoRA adapters are served")
    refused = {
        "use_dora": "DoRA adapters",
        "modules_to_save": "adapters with modules_to_save (fully trained layers)",
        "fan_in_fan_out": "fan_in_fan_out weights",
        "lora_bias": "LoRA biases (lora_bias)",
        "layer_replication": "layer_replication",
        "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
        "target_parameters": "adapters of parameters (target_parameters)",
        # peft's variants whose forward is not B A x: served as plain LoRA they would give
        # other outputs than peft's
        "alora_invocation_tokens": "activated LoRA adapters (alora_invocation_tokens)",
    }
    # variants that peft turns on by a config object, even an empty one
    refused_objects = {
        "arrow_config": "Arrow routing adapters (arrow_config)",
        "kasa_config": "KaSA adapters (kasa_config)",
        "monteclora_config": "MonteCLoRA adapters (monteclora_config)",
        "use_bdlora": "block-diagonal LoRA adapters (use_bdlora)",
    }
    for key, what in refused.items():
        if raw.get(key):
            raise LoRAAdapterError(f"{path!r}: {what} are not supported")
    for key, what in refused_objects.items():
        if raw.get(key) not in (None, False):
            raise LoRAAdapterError(f"{path!r}: {what} are not supported")
    if raw.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{path!r}: LoRA biases (bias={raw['bias']!r}) are not supported")
    rank = raw.get("r")
    # bool is an int in Python: `"r": true` is not a rank.
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"{path!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(
            f"{path!r}: LoRA rank {rank} is greater than max_lora_rank {max_rank}"
        )
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"{path!r}: lora_alpha must be a number, got {alpha!r}")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool) and rslora is not None:
        raise LoRAAdapterError(f"{path!r}: use_rslora must be true or false, got {rslora!r}")
    patterns = _patterns(raw, path, max_rank)
    # A NaN or Inf scale would reach the other rows of a batch (see ``LoRAManager._read``).
    for a in {alpha, *(v for _, v in patterns[1])}:
        for r in {rank, *(v for _, v in patterns[0])}:
            if not math.isfinite(_scale(a, r, bool(rslora))):
                raise LoRAAdapterError(
                    f"{path!r}: lora_alpha {a!r} gives a scale that is not a finite number"
                )
    scale = _scale(alpha, rank, bool(rslora))
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        if not all(isinstance(t, str) for t in targets):
            raise LoRAAdapterError(f"{path!r}: target_modules must list module names (strings)")
        # peft's rule: an entry names a module by its name or a dotted suffix of it
        # ("self_attn.q_proj", "model.layers.0.mlp.down_proj").
        bad = sorted(t for t in set(targets) if t.rsplit(".", 1)[-1] not in TARGETS)
        if bad:
            raise LoRAAdapterError(
                f"{path!r}: target modules {bad} are not supported (only "
                f"{', '.join(TARGETS)})"
            )
        targets = tuple(targets)
    elif isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        targets = ALL_LINEAR
    elif isinstance(targets, str):
        _regex(targets, path, "target_modules")
    else:
        raise LoRAAdapterError(f"{path!r}: target_modules must be a list or a regex")
    base = raw.get("base_model_name_or_path")
    base = base if isinstance(base, str) else None
    return PEFTConfig(rank, scale, targets, base, *_layer_config(raw, path), *patterns,
                      float(alpha), bool(rslora))  # fmt: skip


def _scale(alpha: float, rank: int, rslora: bool) -> float:
    try:
        return float(alpha) / (math.sqrt(rank) if rslora else rank)
    except OverflowError:
        return math.inf


def _patterns(
    raw: dict[str, Any], path: str, max_rank: int
) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, float], ...]]:
    """``rank_pattern`` and ``alpha_pattern`` as ``(pattern, value)`` pairs, in order."""
    out = []
    for key, what in (("rank_pattern", "a rank"), ("alpha_pattern", "an alpha")):
        value = raw.get(key) or {}
        if not isinstance(value, dict):
            raise LoRAAdapterError(f"{path!r}: {key} must map module patterns to {what}s")
        for pattern, v in value.items():
            _names(pattern, path, f"{key} key")  # a regular expression, as peft uses it
            bad = not isinstance(v, (int, float)) or isinstance(v, bool)
            if key == "rank_pattern":
                bad = bad or not isinstance(v, int) or not 1 <= v <= max_rank
            if bad:
                raise LoRAAdapterError(
                    f"{path!r}: {key}[{pattern!r}] must be {what}"
                    + (f" from 1 to max_lora_rank {max_rank}" if key == "rank_pattern" else "")
                    + f", got {v!r}"
                )
        out.append(tuple(value.items()))
    return out[0], out[1]


def module_rank_scale(config: PEFTConfig, module: str) -> tuple[int, float]:
    """``(r, scale)`` of ``module`` (a full module name): the first ``rank_pattern`` /
    ``alpha_pattern`` key that matches the end of its name after a dot gives its r / alpha
    (peft's ``get_pattern_key``), else the adapter's."""

    def pick(pairs, default):
        return next((v for k, v in pairs if re.match(rf"(.*\.)?({k})$", module)), default)

    rank = pick(config.rank_pattern, config.rank)
    return rank, _scale(pick(config.alpha_pattern, config.alpha), rank, config.rslora)


def _names(value: Any, path: str, key: str) -> tuple[str, ...] | str | None:
    """``value`` of ``key`` as module names: None, a regular expression or a list of
    names."""
    if value is None or isinstance(value, str) and not value:
        return None
    if isinstance(value, str):
        return _regex(value, path, key)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise LoRAAdapterError(f"{path!r}: {key} must be a list of module names or a regex")


def _regex(value: str, path: str, key: str) -> str:
    """``value`` of ``key``, checked to be a regular expression (peft matches with it).

    Raises:
        LoRAAdapterError: it does not compile.
    """
    try:
        re.compile(value)
    except re.error as e:
        raise LoRAAdapterError(
            f"{path!r}: {key} {value!r} is not a regular expression: {e}"
        ) from None
    return value


def _layer_config(
    raw: dict[str, Any], path: str
) -> tuple[tuple[int, ...] | None, tuple[str, ...], tuple[str, ...] | str | None]:
    """``(layers, layers_pattern, exclude_modules)`` of ``PEFTConfig``, checked."""
    layers = raw.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = (layers,)
    elif isinstance(layers, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in layers
    ):
        layers = tuple(layers) or None  # peft: an empty list transforms every layer
    elif layers is not None:
        raise LoRAAdapterError(
            f"{path!r}: layers_to_transform must be a layer index or a list of them, "
            f"got {layers!r}"
        )
    pattern = raw.get("layers_pattern") or ()
    pattern = (pattern,) if isinstance(pattern, str) else pattern
    if not isinstance(pattern, (list, tuple)) or not all(isinstance(p, str) for p in pattern):
        raise LoRAAdapterError(f"{path!r}: layers_pattern must be a name or a list of names")
    for p in pattern:  # peft puts them into a regular expression as they are
        _names(p, path, "layers_pattern")
    exclude = _names(raw.get("exclude_modules"), path, "exclude_modules")
    return layers, tuple(pattern), exclude


def _names_match(names: tuple[str, ...] | str, module: str) -> bool:
    """peft's rule: a full match of a regular expression, or a listed name or dotted
    suffix."""
    if isinstance(names, str):
        return re.fullmatch(names, module) is not None
    return any(module == n or module.endswith("." + n) for n in names)


def _layer_index(module: str, patterns: tuple[str, ...]) -> int | None:
    """The layer index in ``module``'s name (peft's rule: the first number after one of
    ``patterns``, or after any name part when there are none)."""
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        match = next(
            (m for p in patterns if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module))),
            None,
        )
    return None if match is None else int(match["idx"])


def is_targeted(config: PEFTConfig, module: str) -> bool:
    """Whether peft gives ``module`` (a full module name) a LoRA layer of this adapter:
    ``exclude_modules`` does not name it, and ``target_modules`` does (a full match of the
    regular expression; a listed name or dotted suffix of it; any linear layer but the LM
    head for ``"all-linear"``), in one of ``layers_to_transform`` for a list."""
    if config.exclude_modules is not None and _names_match(config.exclude_modules, module):
        return False
    targets = config.target_modules
    if targets == ALL_LINEAR:
        pass  # peft lists the model's linear layers; the weights name only projections
    elif isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    elif not _names_match(targets, module):
        return False
    return config.layers is None or _layer_index(module, config.layers_pattern) in config.layers


def load_peft_weights(path: str) -> dict[str, dict[str, Any]]:
    """The adapter's tensors by module: ``{module: {"lora_A": [r, in], "lora_B": [out, r]}}``
    (torch tensors, the checkpoint's dtype, on the CPU).

    Raises:
        LoRAAdapterError: an unreadable file, a tensor that is not a LoRA A/B weight (e.g.
            embedding adapters, ``lora_embedding_A``), an A without its B, or a target other
            than the supported projections.
    """
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    dtypes = {getattr(torch, name) for name in WEIGHT_DTYPES}

    try:
        tensors = load_file(os.path.join(path, WEIGHTS_NAME))
    except (OSError, SafetensorError) as e:
        raise LoRAAdapterError(f"cannot read {path!r}'s {WEIGHTS_NAME}: {e}") from None
    modules: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        match = _KEY_RE.match(key)
        if match is None:
            raise LoRAAdapterError(
                f"{path!r}: tensor {key!r} is not a LoRA A/B weight of a linear layer "
                "(embedding, LM-head and fully trained modules are not supported)"
            )
        module = match["module"]
        if module.rsplit(".", 1)[-1] not in TARGETS:
            raise LoRAAdapterError(
                f"{path!r}: {module} is not a supported target (only {', '.join(TARGETS)})"
            )
        if tensor.dtype not in dtypes or tensor.dim() != 2:
            raise LoRAAdapterError(
                f"{path!r}: tensor {key!r} is a {tensor.dim()}-dimensional {tensor.dtype} "
                f"tensor; LoRA weights are matrices of {', '.join(WEIGHT_DTYPES)}"
            )
        modules.setdefault(module, {})[match["ab"]] = tensor
    for module, ab in modules.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(f"{path!r}: {module} lacks its lora_A or lora_B weight")
    if not modules:
        raise LoRAAdapterError(f"{path!r}: the adapter has no LoRA weights")
    return modules

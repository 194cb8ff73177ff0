"""Pooling of token states into one embedding per input, as sentence-transformers configures it.

A sentence-transformers model folder (Reimers & Gurevych 2019, arXiv:1908.10084) lists its
modules in ``modules.json``: the transformer, a ``Pooling`` module whose
``1_Pooling/config.json`` picks the pooling mode, and optionally ``Normalize`` (L2). Its
``sentence_bert_config.json`` gives ``max_seq_length``, the longest input it was trained on.
A folder without those files gets CLS pooling with normalization (BERT's own convention).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.arg_types import json_object
from tokenmill.config import ConfigError, PoolerConfig
from tokenmill.hf_config import ModelLoadError

POOLING_TYPES = ("MEAN", "CLS", "LAST")
# Defaults for a folder with no sentence-transformers files.
DEFAULT_POOLING_TYPE = "CLS"
DEFAULT_NORMALIZE = True

# sentence-transformers pooling mode (newer ``pooling_mode`` string, or the name of the older
# boolean key without its ``pooling_mode_`` prefix) -> tokenmill pooling type.
_ST_POOLING_MODES = {
    "mean": "MEAN",
    "mean_tokens": "MEAN",
    "cls": "CLS",
    "cls_token": "CLS",
    "lasttoken": "LAST",
}
# Module types of modules.json that change nothing tokenmill computes differently.
_ST_PASSIVE_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class SentenceTransformersConfig:
    """What a model folder's sentence-transformers files ask for (None: not said).

    Attributes:
        pooling_type: one of POOLING_TYPES.
        normalize: whether a ``Normalize`` module follows the pooling.
        max_seq_length: the longest input in tokens (special tokens included).
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    max_seq_length: int | None = None


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _pooling_type(config: dict[str, Any], path: str) -> str:
    """The pooling type of a ``1_Pooling/config.json``.

    Raises:
        ModelLoadError: it asks for a mode tokenmill does not implement (max, weighted
            mean, mean_sqrt_len) or for several at once.
    """
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        modes = [mode]
    else:
        modes = [
            key.removeprefix("pooling_mode_")
            for key, value in config.items()
            if key.startswith("pooling_mode_") and value is True
        ]
    if len(modes) != 1 or modes[0] not in _ST_POOLING_MODES:
        raise ModelLoadError(
            f"{path}: pooling mode {modes or 'none'} is not supported; tokenmill implements "
            f"one of mean, cls, lasttoken"
        )
    return _ST_POOLING_MODES[modes[0]]


def read_sentence_transformers_config(folder: str) -> SentenceTransformersConfig:
    """Read ``modules.json``, the pooling config and ``sentence_bert_config.json`` of a folder.

    Raises:
        ModelLoadError: a file is unreadable, or a module (e.g. ``Dense``) or pooling mode
            that tokenmill does not implement is listed: the embeddings would be wrong.
    """
    if not os.path.isdir(folder):
        return SentenceTransformersConfig()
    pooling_type = normalize = max_seq_length = None
    modules_path = os.path.join(folder, "modules.json")
    if os.path.isfile(modules_path):
        normalize = False
        for module in _read_json(modules_path):
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            if kind not in _ST_PASSIVE_MODULES:
                raise ModelLoadError(
                    f"{modules_path}: module {module.get('type')!r} is not supported "
                    f"(tokenmill implements {', '.join(_ST_PASSIVE_MODULES)})"
                )
            if kind == "Normalize":
                normalize = True
            elif kind == "Pooling":
                path = os.path.join(folder, module.get("path", ""), "config.json")
                pooling_type = _pooling_type(_read_json(path), path)
    bert_config = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(bert_config):
        value = _read_json(bert_config).get("max_seq_length")
        max_seq_length = int(value) if value else None
    return SentenceTransformersConfig(pooling_type, normalize, max_seq_length)


def resolve_pooler_config(
    model: str, override: PoolerConfig | None = None
) -> tuple[PoolerConfig, int | None]:
    """The pooling of a model: its folder's choice, overridden field by field by ``override``.

    Args:
        model: the model folder.
        override: fields that are not None replace the folder's choice.

    Returns:
        ``(resolved PoolerConfig, max_seq_length or None)``.

    Raises:
        ConfigError: ``override`` names an unknown pooling type.
        ModelLoadError: see read_sentence_transformers_config.
    """
    st = read_sentence_transformers_config(model)
    override = override or PoolerConfig()
    pooling_type = (override.pooling_type or st.pooling_type or DEFAULT_POOLING_TYPE).upper()
    if pooling_type not in POOLING_TYPES:
        raise ConfigError(
            f"pooler_config pooling_type {override.pooling_type!r} is not supported; "
            f"choose one of {', '.join(POOLING_TYPES)}"
        )
    normalize = override.normalize
    if normalize is None:
        normalize = DEFAULT_NORMALIZE if st.normalize is None else st.normalize
    return PoolerConfig(pooling_type, normalize), st.max_seq_length


def parse_pooler_config(value: PoolerConfig | dict[str, Any] | str | None) -> PoolerConfig | None:
    """``--pooler-config`` (a JSON object), a dict or a PoolerConfig -> PoolerConfig.

    Raises:
        ConfigError: not a JSON object, or it has fields other than pooling_type/normalize.
    """
    if value is None or isinstance(value, PoolerConfig):
        return value
    try:
        value = json_object(value, "--pooler-config")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    unknown = set(value) - {"pooling_type", "normalize"}
    if unknown:
        raise ConfigError(
            f"--pooler-config: unknown field(s) {sorted(unknown)}; known: pooling_type, normalize"
        )
    return PoolerConfig(value.get("pooling_type"), value.get("normalize"))


class Pooler(nn.Module):
    """Token states of a right-padded batch -> one vector per input.

    ``forward(hidden [B, L, H], attention_mask [B, L] bool) -> [B, H] float32``:

    - MEAN: the average over real tokens (padding masked out);
    - CLS: the first token's state;
    - LAST: the last real token's state.

    ``postprocess`` then keeps the first ``dimensions`` values (Matryoshka embeddings,
    Kusupati et al. 2022, arXiv:2205.13147) and L2-normalizes when configured.

    Args:
        config: a resolved PoolerConfig (both fields set).
    """

    def __init__(self, config: PoolerConfig) -> None:
        super().__init__()
        if config.pooling_type not in POOLING_TYPES:
            raise ValueError(f"unknown pooling type {config.pooling_type!r}")
        self.pooling_type = config.pooling_type
        self.normalize = bool(config.normalize)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = hidden.float()
        if self.pooling_type == "CLS":
            return hidden[:, 0]
        mask = attention_mask.bool()
        if self.pooling_type == "LAST":
            last = mask.sum(dim=1) - 1
            return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        # NOTE: clamp guards an all-padding row (never built by the engine) against 0/0.
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)

    def postprocess(self, pooled: torch.Tensor, dimensions: int | None = None) -> torch.Tensor:
        """``[..., H] -> [..., dimensions or H]``: truncate, then normalize if configured."""
        if dimensions is not None:
            pooled = pooled[..., :dimensions]
        return F.normalize(pooled, p=2.0, dim=-1) if self.normalize else pooled

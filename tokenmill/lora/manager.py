"""The worker's adapters: LoRA layers wrapped around a model's projections, the slots on the
device (``max_loras``) and an LRU of adapters loaded in host memory (``max_cpu_loras``),
as S-LoRA (Sheng et al. 2023) keeps many adapters in host memory and few on the device.

The scheduler never runs more distinct adapters in a step than there are slots, so
``slots_for`` can always give every adapter of a step a slot, evicting the least recently
used adapters that the step does not use.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenmill.config import ConfigError, LoRAConfig
from tokenmill.lora.layers import LoRABatch, LoRALinear, lora_layer
from tokenmill.lora.peft import (
    FUSED_TARGETS,
    SUPPORTED_TARGETS,
    LoRAAdapterError,
    is_targeted,
    load_peft_weights,
    module_rank_scale,
    read_peft_config,
)
from tokenmill.lora.request import LoRARequest
from tokenmill.model.loader.weights import other_stage_prefixes

logger = logging.getLogger(__name__)

# shard id -> (A [r, in], B [part out, r] scaled), per tokenmill module name
AdapterWeights = dict[str, dict[Any, tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class LoadedAdapter:
    request: LoRARequest
    weights: AdapterWeights


def _target_map(model: nn.Module) -> dict[str, tuple[str, Any]]:
    """Checkpoint projection name -> (tokenmill module name part, shard id), from the model
    class's ``stacked_params_mapping`` (q_proj -> (qkv_proj, "q"), ...)."""
    mapping = {name: (name, None) for name in SUPPORTED_TARGETS}
    for param, weight, shard in getattr(model, "stacked_params_mapping", []):
        if weight in mapping:
            mapping[weight] = (param, shard)
    return mapping


def wrap_lora_layers(
    model: nn.Module, config: LoRAConfig, dtype: torch.dtype, batch: LoRABatch
) -> dict[str, LoRALinear]:
    """Replace every projection an adapter may target with a LoRA layer around it, for its
    tensor-parallel split (``lora_layer``). Under pipeline parallelism only this stage's
    layers exist, so only they are wrapped.

    Returns:
        Module name -> its LoRA layer.

    Raises:
        ValueError: ``--fully-sharded-loras`` with sizes the tensor-parallel size does not
            divide, or slots that do not fit in the free memory (``check_slots_fit``).
    """
    targets = _target_map(model)
    parts_of: dict[str, list[Any]] = {}
    for param, shard in targets.values():
        parts_of.setdefault(param, []).append(shard)
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in parts_of or not hasattr(module, "shard_slices"):
            continue
        parts = []
        for shard in parts_of[leaf]:
            if shard is None:
                parts.append((None, 0, module.output_size))
            else:
                s = module.shard_slices(shard)[0]
                parts.append((shard, s.dst_start, s.size))
        # No slots yet: the stacks are allocated once all of them are known to fit.
        wrapped[name] = lora_layer(
            module, parts, 0, config.max_lora_rank, dtype, batch, config.fully_sharded_loras
        )
    num_slots = config.max_loras + 1
    if wrapped:
        device = next(iter(wrapped.values())).lora_a.device
        check_slots_fit(num_slots * sum(w.slot_bytes() for w in wrapped.values()), device,
                        config)  # fmt: skip
    for name, layer in wrapped.items():
        layer.allocate_slots(num_slots, dtype)
        leaf = name.rsplit(".", 1)[-1]
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, leaf, layer)
    return wrapped


def check_slots_fit(need: int, device: torch.device, config: LoRAConfig) -> None:
    """Refuse adapter slots of ``need`` bytes that the free memory of ``device`` cannot
    hold (host memory on the CPU), before any is allocated.

    Raises:
        ConfigError: names the flags that size the slots (a user error: no traceback).
    """
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    if need > 0.9 * free:
        raise ConfigError(
            f"the adapter slots (--max-loras {config.max_loras}, --max-lora-rank "
            f"{config.max_lora_rank}) need {need / 2**30:.1f} GiB and only "
            f"{free / 2**30:.1f} GiB of {device.type} memory are free: lower --max-loras or "
            "--max-lora-rank"
        )


class LoRAManager:
    """Adapters of one model runner.

    Args:
        model: the loaded model; its projections are wrapped in place.
        config: slots, rank, host cache size.
        dtype: the slots' dtype.
        token_slots: the runner's persistent ``[max_num_batched_tokens]`` int32 buffer of
            the step's slot per token.
    """

    def __init__(
        self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, token_slots: torch.Tensor
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.batch = LoRABatch(token_slots)
        self.layers = wrap_lora_layers(model, config, dtype, self.batch)
        self.targets = _target_map(model)
        # Modules other pipeline stages hold: an adapter's weights for them are skipped.
        self.other_stages = other_stage_prefixes(model)
        self.host: OrderedDict[int, LoadedAdapter] = OrderedDict()
        self.known: dict[int, LoRARequest] = {}
        # adapter id -> slot (1..max_loras), least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()

    # ---- host cache --------------------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> None:
        """Load ``request``'s adapter into host memory (a no-op when loaded).

        Raises:
            LoRAAdapterError: the folder cannot be served or does not fit the model.
        """
        self.known[request.lora_int_id] = request
        try:
            self._load(request.lora_int_id)
        except LoRAAdapterError:
            del self.known[request.lora_int_id]
            raise

    def remember(self, request: LoRARequest) -> None:
        """Know ``request``'s adapter without reading it (read when a step needs it)."""
        self.known.setdefault(request.lora_int_id, request)

    def _load(self, lora_id: int) -> LoadedAdapter:
        loaded = self.host.get(lora_id)
        if loaded is not None:
            self.host.move_to_end(lora_id)
            return loaded
        request = self.known.get(lora_id)
        if request is None:
            raise LoRAAdapterError(f"adapter id {lora_id} is not loaded")
        loaded = LoadedAdapter(request, self._read(request))
        self.host[lora_id] = loaded
        while len(self.host) > self.config.max_cpu_loras:
            evicted, _ = self.host.popitem(last=False)
            logger.info("LoRA adapter %d evicted from host memory", evicted)
        return loaded

    def _read(self, request: LoRARequest) -> AdapterWeights:
        """The adapter's weights as this rank's layers hold them (``shard_weights``: its
        tensor-parallel slices, this pipeline stage's layers only), B scaled.

        Raises:
            LoRAAdapterError: a module the model lacks, or A/B shapes that do not fit it.
        """
        path = request.lora_path
        peft = read_peft_config(path, self.config.max_lora_rank)
        pin = any(layer.lora_a.is_cuda for layer in self.layers.values())
        weights: AdapterWeights = {}
        for module, ab in load_peft_weights(path).items():
            prefix, _, leaf = module.rpartition(".")
            fused = leaf in FUSED_TARGETS  # checked whole (shard None), then split by part
            param, shard = (leaf, None) if fused else self.targets[leaf]
            name = f"{prefix}.{param}" if prefix else param
            layer = self.layers.get(name)
            if layer is None:
                if f"{name}.".startswith(self.other_stages):
                    continue
                raise LoRAAdapterError(f"{path!r}: the model has no layer {module}")
            if not is_targeted(peft, module):
                # peft would leave such weights unused; serving them would differ from it.
                raise LoRAAdapterError(
                    f"{path!r}: has weights for {module}, which its target_modules "
                    f"{peft.target_modules!r} does not name"
                )
            a, b = ab["lora_A"], ab["lora_B"]
            out, inp = layer.checkpoint_shape(shard)
            if a.shape[0] > self.config.max_lora_rank or tuple(a.shape) != (
                b.shape[1], inp
            ) or b.shape[0] != out:
                raise LoRAAdapterError(
                    f"{path!r}: {module}'s lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                    f"do not fit the model's layer ({inp} in, {out} out, rank "
                    f"<= {self.config.max_lora_rank})"
                )
            rank, scale = module_rank_scale(peft, module)
            if a.shape[0] != rank:
                raise LoRAAdapterError(
                    f"{path!r}: {module}'s lora_A has rank {a.shape[0]}, adapter_config.json "
                    f"says r={rank}"
                )
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                # On the CPU every slot's product is computed and masked: a NaN would reach
                # every row of the batch, not only this adapter's.
                raise LoRAAdapterError(f"{path!r}: {module}'s lora_A/lora_B hold NaN or Inf")
            parts = weights.setdefault(name, {})
            for part, part_a, part_b in layer.split_fused(a, b) if fused else [(shard, a, b)]:
                if part in parts:  # e.g. q_proj beside a fused qkv_proj of the same layer
                    raise LoRAAdapterError(f"{path!r}: two adapters of {name} ({module})")
                parts[part] = self._prepare(layer, part, part_a, part_b, scale, pin, module,
                                            path)  # fmt: skip
        return weights

    def _prepare(self, layer: LoRALinear, shard: Any, a: torch.Tensor, b: torch.Tensor,
                 scale: float, pin: bool, module: str, path: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Part ``shard``'s A and scaled B as this rank's ``layer`` holds them, in the slots'
        dtype (copies: the checkpoint's whole tensors are not kept)."""
        a, b = layer.shard_weights(shard, a, b)
        a = a.to(self.dtype, copy=True)
        b = (b.float() * scale).to(self.dtype)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAAdapterError(
                f"{path!r}: {module}'s lora_A, or lora_B times its scale {scale:g}, "
                f"overflows {self.dtype}"
            )
        if pin:
            a, b = a.pin_memory(), b.pin_memory()
        return a, b

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (its slot is freed); False when it was not known."""
        known = self.known.pop(lora_id, None) is not None
        self.host.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear_slot(slot)
        return known

    # ---- slots -------------------------------------------------------------------------

    def slots_for(
        self, lora_ids: np.ndarray, req_ids: list[str]
    ) -> tuple[np.ndarray, dict[str, str]]:
        """The slot of each entry of ``lora_ids`` (0 for 0: no adapter), putting adapters
        that have none into a free slot or the least recently used one this call does not
        need; and the requests whose adapter no longer loads.

        An adapter that no longer loads (it had left host memory and its folder changed or
        went since it was loaded) is forgotten and its rows take slot 0: its requests end,
        the step runs for the others.

        Args:
            lora_ids: ``[R]`` int64, each request's adapter id (0: none).
            req_ids: the ``R`` requests' ids.

        Returns:
            ``(slots [R] int32, failed)``: ``failed`` maps the id of each request whose
            adapter no longer loads to the reason.

        Raises:
            RuntimeError: more distinct adapters than slots (a scheduler bug).
        """
        ids, inverse = np.unique(lora_ids, return_inverse=True)
        wanted = [int(i) for i in ids if i]
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(
                f"{len(wanted)} adapters in one step, more than max_loras={self.config.max_loras}"
            )
        reasons: dict[int, str] = {}
        for lora_id in wanted:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            try:
                self._activate(lora_id, set(wanted))
            except LoRAAdapterError as e:
                logger.warning("LoRA adapter %d no longer loads: %s", lora_id, e)
                reasons[lora_id] = str(e)
                self.remove_lora(lora_id)
        failed = {}
        if reasons:  # rare: no per-step work otherwise
            rows = np.flatnonzero(np.isin(lora_ids, list(reasons)))
            failed = {req_ids[r]: reasons[int(lora_ids[r])] for r in rows}
        slots = np.array([self.slot_of.get(int(i), 0) for i in ids], dtype=np.int32)
        return slots[inverse.reshape(-1)], failed

    def _activate(self, lora_id: int, keep: set[int]) -> None:
        weights = self._load(lora_id).weights  # first: a failed load takes no slot
        used = set(self.slot_of.values())
        free = [s for s in range(1, self.config.max_loras + 1) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slot_of if i not in keep)
            slot = self.slot_of.pop(victim)
        for name, layer in self.layers.items():
            parts = weights.get(name)
            if parts:
                layer.set_slot(slot, parts)
            else:
                layer.clear_slot(slot)
        self.slot_of[lora_id] = slot

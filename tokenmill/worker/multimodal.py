"""The worker's side of images: the encoder cache, the encoder run of a step, the merge of
image embeddings into the input embeddings, and multimodal rotary positions.

Per step (``SchedulerOutput``): drop the encoder outputs the scheduler evicted, run the
vision encoder over the images it scheduled (all of them in one call) and cache the outputs
by image hash; then, for the tokens of the step that are image placeholders, gather their
rows of the cached outputs. A step with placeholders runs over ``inputs_embeds`` (token
embeddings with those rows replaced, ``step_embeds``): through the piecewise CUDA graphs
captured over embeddings where they take it, else eagerly; other steps take the usual path.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenmill.core.scheduler_output import NewRequestData, SchedulerOutput
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.multimodal.inputs import MultiModalFeature, SharedImageData

logger = logging.getLogger(__name__)


@dataclass
class _RequestImages:
    features: list[MultiModalFeature]
    # M-RoPE models: the prompt's three position streams [3, L] and the offset of the
    # generated tokens' positions (position p >= L sits at p + delta).
    mrope: np.ndarray | None = None
    delta: int = 0


@dataclass
class StepImages:
    """The image placeholders of one step.

    Attributes:
        token_index: ``[K]`` int64 indices (in the step's tokens) of placeholder tokens.
        embeds: ``[K, H]`` their embeddings.
        mrope_positions: ``[3, T]`` int64 rotary positions of the step when some token's
            three streams differ, else None.
        last_key_pos: ``[T]`` int32, the last key each token sees
            (``AttentionMetadata.last_key_pos``): a placeholder sees its whole image, for
            models whose image tokens attend to each other both ways; else None.
    """

    token_index: torch.Tensor | None
    embeds: torch.Tensor | None
    mrope_positions: torch.Tensor | None
    last_key_pos: torch.Tensor | None = None


class MultiModalState:
    """Encoder cache and per-request image state of one ModelRunner.

    Args:
        model: a multimodal model (``embed_input_ids``, ``encode_images``; with
            ``uses_mrope`` also ``mrope_positions``; ``bidirectional_image_attention``:
            an image's placeholders attend to each other both ways, Gemma 3;
            ``deepstack_layers``: features added inside its first layers, Qwen3-VL).
        device: the model's device.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.bidirectional = bool(getattr(model, "bidirectional_image_attention", False))
        self.deepstack_layers = int(getattr(model, "deepstack_layers", 0))
        # Image steps replay graphs over input embeddings, unless features enter inside
        # the layers (DeepStack), which those graphs do not capture: such steps run eagerly.
        self.graph_image_steps = not self.deepstack_layers
        self.cache: dict[str, torch.Tensor] = {}  # image hash -> [length, H] embeddings
        self.requests: dict[str, _RequestImages] = {}
        self.images = SharedImageData()
        self.num_encoded = 0  # images run through the encoder (for tests and logs)
        # image hash -> why the vision encoder failed on it (its requests fail)
        self.failed_images: dict[str, str] = {}

    # ---- requests --------------------------------------------------------------------

    def add_request(self, new: NewRequestData) -> None:
        # Requests with the same image (n > 1 children) hold one copy of its inputs here
        # too, where each reached this process as its own message.
        self.images.share(new.mm_features)
        features = list(new.mm_features or [])
        state = _RequestImages(features)
        if self.uses_mrope and features:
            items = [(f.offset, f.length, _unpack(f)) for f in features]
            pos, delta = self.model.mrope_positions(len(new.prompt_token_ids), items)
            state.mrope, state.delta = pos, delta
        if features or self.uses_mrope:
            self.requests[new.req_id] = state

    def remove_request(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    # ---- one step ----------------------------------------------------------------------

    def run_encoder(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's evictions and encode the images it scheduled.

        An image the vision tower fails on (or answers with the wrong number of embeddings)
        fails the requests that carry it (``failed_requests``), not the engine: the batch
        is encoded again one image at a time, and a failed image's placeholders read zeros
        until its requests end.
        """
        for identifier in so.free_encoder_ids:
            self.cache.pop(identifier, None)
            self.failed_images.pop(identifier, None)
        todo: dict[str, MultiModalFeature] = {}
        for req_id, indices in so.scheduled_encoder_inputs.items():
            features = self.requests[req_id].features
            for i in indices:
                todo.setdefault(features[i].identifier, features[i])
        if not todo:
            return
        try:
            outputs = self._encode([_unpack(f) for f in todo.values()])
        except Exception:
            outputs = [self._encode_alone(f) for f in todo.values()]
        for (identifier, f), out in zip(todo.items(), outputs, strict=True):
            if isinstance(out, torch.Tensor) and out.shape[0] != f.length:
                out = (f"the encoder gave {out.shape[0]} embeddings for {f.length} "
                       "placeholders")  # fmt: skip
            if isinstance(out, str):
                logger.warning("image %s failed in the vision encoder: %s", identifier[:12], out)
                self.failed_images[identifier] = out
                out = torch.zeros_like(self.model.embed_input_ids(
                    torch.zeros(1, dtype=torch.long, device=self.device))).expand(f.length, -1)
            self.cache[identifier] = out
        self.num_encoded += len(todo)

    def _encode(self, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """The encoder outputs of ``items``: the vision tower's, or the embeddings a
        request gave (``image_embeds``: ``multimodal/embeds.py``) in the model's dtype."""
        given = [i for i, d in enumerate(items) if "image_embeds" in d]
        if not given:
            return self.model.encode_images(items)
        dtype = self.model.embed_input_ids(torch.zeros(1, dtype=torch.long,
                                                       device=self.device)).dtype  # fmt: skip
        outputs: list[torch.Tensor | None] = [None] * len(items)
        for i in given:
            outputs[i] = torch.from_numpy(np.array(items[i]["image_embeds"])).to(self.device,
                                                                                 dtype)  # fmt: skip
        rest = [i for i in range(len(items)) if outputs[i] is None]
        if rest:
            for i, out in zip(rest, self.model.encode_images([items[i] for i in rest]),
                              strict=True):  # fmt: skip
                outputs[i] = out
        return outputs  # type: ignore[return-value]

    def _encode_alone(self, feature: MultiModalFeature) -> torch.Tensor | str:
        """One image's embeddings, or why the vision tower failed on it."""
        try:
            return self._encode([_unpack(feature)])[0]
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    def failed_requests(self, req_ids: list[str]) -> dict[str, str]:
        """Of ``req_ids``, those carrying an image the vision encoder failed on, with why."""
        failed = {}
        for req_id in req_ids:
            state = self.requests.get(req_id)
            for f in state.features if state is not None else ():
                reason = self.failed_images.get(f.identifier)
                if reason is not None:
                    failed[req_id] = f"its image could not be encoded ({reason})"
                    break
        return failed

    def rope_positions(
        self, req_ids: list[str], req_idx: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The step's rotary positions from its token positions ``[T]``.

        Returns:
            ``(positions [T], mrope [3, T] or None)``: for M-RoPE requests, prompt tokens
            take their first stream (equal to the others for text) and generated tokens
            ``p + delta``; the three streams are returned when some token's differ.
        """
        if not self.uses_mrope:
            return positions, None
        streams = np.broadcast_to(positions, (3, len(positions))).copy()
        differ = False
        for i, req_id in enumerate(req_ids):
            state = self.requests.get(req_id)
            if state is None or state.mrope is None:
                continue
            sel = np.nonzero(req_idx == i)[0]
            p = positions[sel]
            length = state.mrope.shape[1]
            rows = np.where(
                p < length, state.mrope[:, np.minimum(p, length - 1)], p + state.delta
            )
            streams[:, sel] = rows
            differ = differ or bool((rows != rows[0]).any())
        return streams[0].copy(), (streams if differ else None)

    def step_images(
        self,
        req_ids: list[str],
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        mrope: np.ndarray | None,
    ) -> StepImages | None:
        """The placeholders among the step's tokens and their embeddings (None: none).

        For bidirectional models, each placeholder's last visible key is its image's last
        placeholder: the scheduler keeps an image's placeholders in one chunk
        (``EncoderCacheManager``), so that key is in this step or already cached."""
        index: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        last: list[np.ndarray] = []
        start = 0
        for req_id, c, s in zip(req_ids, num_computed.tolist(), num_scheduled.tolist(),
                                strict=True):  # fmt: skip
            state = self.requests.get(req_id)
            own = np.arange(c, c + s, dtype=np.int32) if self.bidirectional else None
            if state is not None:
                for f in state.features:
                    lo, hi = max(f.offset, c), min(f.end, c + s)
                    if lo >= hi:
                        continue
                    index.append(np.arange(start + lo - c, start + hi - c))
                    rows.append(self.cache[f.identifier][lo - f.offset : hi - f.offset])
                    if own is not None:
                        own[lo - c : hi - c] = f.end - 1
            if own is not None:
                last.append(own)
            start += s
        if not index and mrope is None:
            return None
        mrope_t = None if mrope is None else torch.from_numpy(mrope).to(self.device)
        if not index:
            return StepImages(None, None, mrope_t)
        token_index = torch.from_numpy(np.concatenate(index)).to(self.device)
        last_key_pos = None
        if last:
            last_key_pos = torch.from_numpy(np.concatenate(last)).to(self.device)
        return StepImages(token_index, torch.cat(rows), mrope_t, last_key_pos)

    def step_metadata(self, metadata: AttentionMetadata, images: StepImages) -> AttentionMetadata:
        """``metadata`` with the step's ``last_key_pos`` (bidirectional models)."""
        if images.last_key_pos is None:
            return metadata
        return dataclasses.replace(metadata, last_key_pos=images.last_key_pos)

    def step_embeds(self, input_ids: torch.Tensor, images: StepImages) -> torch.Tensor:
        """The step's input embeddings ``[T, H]``: the tokens', with the placeholders' rows
        replaced by their images' embeddings (a model with DeepStack features gets them
        for its next forward pass, ``set_deepstack``)."""
        embeds = self.model.embed_input_ids(input_ids)
        if images.token_index is not None:
            rows = images.embeds
            if self.deepstack_layers:  # Qwen3-VL: the DeepStack features follow
                hidden = embeds.shape[1]
                features = rows[:, hidden:].view(rows.shape[0], self.deepstack_layers, hidden)
                self.model.set_deepstack(images.token_index, features)
                rows = rows[:, :hidden]
            embeds[images.token_index] = rows.to(embeds.dtype)
        return embeds

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        images: StepImages,
        embeds: torch.Tensor,
    ) -> torch.Tensor:
        """The model over a step with image placeholders (eager); ``metadata`` and
        ``embeds`` as ``step_metadata`` and ``step_embeds`` give them."""
        if self.uses_mrope:
            return self.model(
                input_ids, positions, metadata, inputs_embeds=embeds,
                mrope_positions=images.mrope_positions,
            )  # fmt: skip
        return self.model(input_ids, positions, metadata, inputs_embeds=embeds)


def _unpack(feature: MultiModalFeature) -> dict[str, np.ndarray]:
    return {k: v.unpack() for k, v in feature.data.items()}

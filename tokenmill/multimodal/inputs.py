"""The multimodal items of a request as they cross to the engine core and the worker.

Plain dataclasses of builtins and bytes (msgspec encodes them as they are; ``core/`` reads
them without torch). A ``MultiModalFeature`` is one image after the model's processor: the
arrays the vision encoder takes, where its placeholder tokens sit in the prompt, and the
hash of its content, which keys the encoder cache and enters the prefix-cache block hashes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np


@dataclass
class PackedArray:
    """A numpy array as bytes: ``dtype`` (numpy name), ``shape`` and the C-order data."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def pack(cls, array: np.ndarray) -> PackedArray:
        array = np.ascontiguousarray(array)
        return cls(array.dtype.name, list(array.shape), array.tobytes())

    def unpack(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


@dataclass
class MultiModalFeature:
    """One multimodal item of a prompt, processed.

    Attributes:
        modality: ``"image"``.
        identifier: sha256 hex digest of the item's content (mode, size and pixels) and
            processor arguments; two items with the same identifier have the same encoder
            output.
        offset: index of the item's first placeholder token in the prompt.
        length: number of placeholder tokens (= rows of its encoder output).
        data: the encoder's inputs by name (e.g. ``pixel_values``, ``image_grid_thw``).
    """

    modality: str
    identifier: str
    offset: int
    length: int
    data: dict[str, PackedArray] = field(default_factory=dict)

    @property
    def end(self) -> int:
        """One past the item's last placeholder position."""
        return self.offset + self.length


class _SharedData(dict):
    """A feature's ``data``, held once for every request with the same image (a dict that
    can be weakly referenced)."""


class SharedImageData:
    """One copy of each image's encoder inputs for all the requests that carry it.

    The children of an ``n > 1`` / ``best_of`` request share their parent's images: the
    first child carries each image's data, the others only its identifier (its ``data``
    empty), and ``share`` gives them the first one's. Requests that carry the same image
    again are also given the copy already held, so theirs is freed. The copy lives while
    some request holds it (a weak registry; nothing to release by hand).
    """

    def __init__(self) -> None:
        self._by_identifier: weakref.WeakValueDictionary[str, _SharedData] = (
            weakref.WeakValueDictionary()
        )

    def share(self, features: list[MultiModalFeature] | None) -> None:
        """Point each feature's ``data`` at the one held copy, in place.

        Raises:
            ValueError: a feature without data whose image no live request carries.
        """
        for f in features or ():
            held = self._by_identifier.get(f.identifier)
            if held is None:
                if not f.data:
                    raise ValueError(
                        f"image {f.identifier[:12]} arrived without its data and no other "
                        "request carries it"
                    )
                # A copy another registry of this process holds (the engine core's, given
                # to an in-process worker) is registered as it is: wrapped anew and put in
                # its place, the other registry's entry would lose its last holder.
                held = f.data if isinstance(f.data, _SharedData) else _SharedData(f.data)
                self._by_identifier[f.identifier] = held
            f.data = held


def without_data(features: list[MultiModalFeature] | None) -> list[MultiModalFeature] | None:
    """The features with their identifiers and placeholder ranges but no data (the later
    children of a fanned-out request: ``SharedImageData.share`` fills it in)."""
    if not features:
        return features
    return [MultiModalFeature(f.modality, f.identifier, f.offset, f.length) for f in features]

"""The multimodal items of a request as they cross to the engine core and the worker.

Plain dataclasses of builtins and bytes (msgspec encodes them as they are; ``core/`` reads
them without torch). A ``MultiModalFeature`` is one image after the model's processor: the
arrays the vision encoder takes, where its placeholder tokens sit in the prompt, and the
hash of its content, which keys the encoder cache and enters the prefix-cache block hashes.
"""

from __future__ import annotations

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

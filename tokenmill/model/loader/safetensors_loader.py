"""Read tensors from safetensors checkpoints (single file or sharded with an index).

Files are memory-mapped and each tensor is handed out as a ``TensorSlice``: the weight
loaders narrow it to the part their rank holds (tensor, pipeline and expert parallelism)
and only that part is read, so no rank reads or holds a full copy of the model. For a dry
run of a load the slices read nothing: they stand for meta tensors of the header's shapes.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from tokenmill.hf_config import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def list_safetensors_files(folder: str) -> list[str]:
    """The checkpoint files of ``folder``: those named by the index, else all ``*.safetensors``.

    Raises:
        ModelLoadError: no safetensors file, or the index names a missing file.
    """
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"{index} names missing file(s): {', '.join(missing)}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(
            f"{folder} has no *.safetensors file (use --load-format dummy for random weights)"
        )
    return files


def _diagnose(path: str) -> str:
    """Explain why a safetensors file cannot be opened, naming the first cut-off tensor."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                return f"{path}: the header ({header_len} bytes) runs past the end of the file"
            header = json.loads(f.read(header_len))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"{path}: unreadable safetensors header ({e})"
    data_size = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if end > data_size:
            return (
                f"{path}: tensor {name!r} is truncated (needs bytes {start}..{end} of the data "
                f"section, the file has {data_size}); the file is incomplete or corrupt"
            )
    return f"{path}: not a valid safetensors file"


# safetensors' dtype names.
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class TensorSlice:
    """A region of one checkpoint tensor, read from its file only when used.

    ``narrow`` (as ``torch.Tensor.narrow``) selects a smaller region without reading;
    ``read()`` returns the region as a CPU tensor. It also stands in for a tensor in torch
    calls: ``param.data.copy_(tensor_slice)`` reads the region and copies it (the torch
    function protocol, ``__torch_function__``); ``.dtype`` comes from the file's header;
    indexing and any other tensor attribute (``.to(...)``) are the read region's, so weight
    loaders written for tensors take it unchanged.

    Args:
        handle: the tensor's ``safe_open(...).get_slice(name)``.
        shape: the region's shape.
        where: ``"file: tensor 'name'"``, for errors.
        index: the region, one slice per dimension (None: the whole tensor).
        shapes_only: ``read()`` gives a meta tensor of the region's shape and dtype (no
            values are read unless the header's dtype is not one torch names).
    """

    def __init__(
        self,
        handle: Any,
        shape: tuple[int, ...],
        where: str,
        index: tuple[slice, ...] | None = None,
        shapes_only: bool = False,
    ) -> None:
        self._handle = handle
        self.shape = torch.Size(shape)
        self._where = where
        self._index = index if index is not None else tuple(slice(0, n) for n in shape)
        self._shapes_only = shapes_only

    def dim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> torch.dtype:
        """The tensor's dtype, from the file's header (nothing read)."""
        return _DTYPES.get(self._handle.get_dtype()) or self.read().dtype

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def narrow(self, dim: int, start: int, length: int) -> TensorSlice:
        """The sub-region ``[start, start + length)`` along ``dim``.

        Raises:
            IndexError: the range is outside the region.
        """
        dim = dim % self.dim()
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(
                f"narrow({dim}, {start}, {length}) outside a tensor of shape {tuple(self.shape)}"
            )
        offset = self._index[dim].start
        index = list(self._index)
        index[dim] = slice(offset + start, offset + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return TensorSlice(
            self._handle, tuple(shape), self._where, tuple(index), self._shapes_only
        )

    def read(self) -> torch.Tensor:
        """The region as a CPU tensor (read from the file now).

        Raises:
            ModelLoadError: the file cannot be read there (truncated, corrupt).
        """
        dtype = _DTYPES.get(self._handle.get_dtype())
        if self._shapes_only and dtype is not None:
            return torch.empty(self.shape, dtype=dtype, device="meta")
        try:
            values = self._handle[self._index]  # () for a scalar
        except Exception as e:
            raise ModelLoadError(f"{self._where}: cannot read: {e}") from e
        return values.to("meta") if self._shapes_only else values

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.read()[index]

    def __len__(self) -> int:
        return self.shape[0]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        args = tuple(a.read() if isinstance(a, TensorSlice) else a for a in args)
        return func(*args, **(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        # Any other tensor attribute or method (``.to``, ``.view``...) is the
        # read region's: loaders that need the values read them where they use them.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.read(), name)


def iterate_safetensors(
    files: list[str], shapes_only: bool = False
) -> Iterator[tuple[str, TensorSlice]]:
    """Yield ``(name, TensorSlice)`` for every tensor of ``files``, one at a time (mmap);
    with ``shapes_only`` the slices read nothing (``TensorSlice``).

    Raises:
        ModelLoadError: a file is missing, truncated or corrupt (names the tensor when it
            can tell which one is cut off).
    """
    for path in files:
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except FileNotFoundError as e:
            raise ModelLoadError(f"checkpoint file {path} does not exist") from e
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ModelLoadError(f"{_diagnose(path)} ({e})") from e
        with handle as f:
            for name in f.keys():
                try:
                    handle = f.get_slice(name)
                    where = f"{path}: tensor {name!r}"
                    shape = tuple(handle.get_shape())
                    tensor = TensorSlice(handle, shape, where, shapes_only=shapes_only)
                except Exception as e:
                    raise ModelLoadError(f"{path}: cannot read tensor {name!r}: {e}") from e
                yield name, tensor

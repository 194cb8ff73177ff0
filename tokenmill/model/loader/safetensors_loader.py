"""Read tensors from safetensors checkpoints (single file or sharded with an index).

Files are memory-mapped and read tensor by tensor, so loading never holds a second full
copy of the model in host memory.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterator

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


def iterate_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``files``, one at a time (CPU, mmap).

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
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(f"{path}: cannot read tensor {name!r}: {e}") from e
                yield name, tensor

"""The safetensors format, read memory-mapped (zero-copy) and written tensor by tensor (streaming).

Layout: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the data.
Reading validates the header against the file, so a truncated or corrupt file fails with the file and tensor named.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hybrid.errors import CheckpointError

DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BF16": torch.bfloat16, "F16": torch.float16,
    "F32": torch.float32, "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """The tensors of one .safetensors file, as views of a private (copy-on-write) memory map."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries, self._data_start = _read_header(self.path)
        self._map = None

    def keys(self) -> list[str]:
        return list(self.entries)

    def dtype_name(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def tensor(self, name: str) -> torch.Tensor:
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        e = self.entries[name]
        begin, end = e["data_offsets"]
        dtype = DTYPES[e["dtype"]]
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin, offset=self._data_start + begin)
        if (self._data_start + begin) % dtype.itemsize:
            raw = raw.clone()  # unaligned: copy this one tensor rather than fail
        return raw.view(dtype).reshape(e["shape"])


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated ({size} bytes; not even a safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors header (claims {n} bytes, file "
                                      f"has {size})")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard file not found")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON: {e})")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, e in header.items():
        _check_entry(path, name, e, data_size)
    return header, 8 + n


def _check_entry(path: Path, name: str, e: dict, data_size: int) -> None:
    try:
        dtype = DTYPES[e["dtype"]]
        begin, end = e["data_offsets"]
        numel = 1
        for d in e["shape"]:
            numel *= int(d)
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: tensor {name!r}: corrupt header entry {e!r}")
    if end - begin != numel * dtype.itemsize or begin < 0:
        raise CheckpointError(f"{path}: tensor {name!r}: header offsets {e['data_offsets']} do not match its "
                              f"shape {e['shape']} and dtype {e['dtype']}")
    if end > data_size:
        raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {end} of the data, but the file "
                              f"holds only {data_size} bytes of data")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its name, shape and dtype up front (for the header), its data made on demand."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def write(path: Path, specs: Sequence[TensorSpec], metadata: dict | None = None) -> int:
    """Write a safetensors file one tensor at a time: memory holds one tensor at most. Returns the data bytes."""
    entries, offset = {}, 0
    for s in specs:
        entries[s.name] = {"dtype": NAMES[s.dtype], "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    blob = json.dumps({"__metadata__": metadata or {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for s in specs:
            t = s.make()
            if tuple(t.shape) != tuple(s.shape) or t.dtype != s.dtype:
                raise ValueError(f"{s.name}: made {tuple(t.shape)} {t.dtype}, declared {s.shape} {s.dtype}")
            f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
    os.replace(tmp, path)
    return offset

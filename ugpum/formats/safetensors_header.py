"""Read a safetensors header (names, dtypes, shapes) without reading any weight."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# A header is a few MB even for a 60 GB model; anything far larger is not a safetensors file.
MAX_HEADER_BYTES = 256 * 1024 * 1024

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # byte range inside the data section

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int  # file offset of the data section

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: v.shape for k, v in self.tensors.items()}


class HeaderError(ValueError):
    pass


def read_header(path: str | Path) -> Header:
    path = Path(path)
    if not path.is_file():
        raise HeaderError(f"{path}: no such file")
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise HeaderError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw_len)
        if n > MAX_HEADER_BYTES or n > path.stat().st_size - 8:
            raise HeaderError(f"{path}: not a safetensors file (header length {n} is implausible)")
        try:
            obj = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HeaderError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(obj, dict):
        raise HeaderError(f"{path}: not a safetensors file (header is not an object)")
    metadata = obj.pop("__metadata__", None) or {}
    tensors = {}
    for name, info in obj.items():
        try:
            tensors[name] = TensorInfo(info["dtype"], tuple(info["shape"]), tuple(info["data_offsets"]))
        except (KeyError, TypeError) as e:
            raise HeaderError(f"{path}: entry {name!r} is malformed ({e})") from None
    return Header(path, tensors, dict(metadata), 8 + n)

"""Read a safetensors header (names, dtypes, shapes) without reading any weight."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from ..wording import EngineError

# A header is a few MB even for a 60 GB model; the safetensors library itself refuses one over 100 MB.
MAX_HEADER_BYTES = 100_000_000

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
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


class HeaderError(ValueError, EngineError):
    pass


class DamagedFile(HeaderError):
    """A safetensors file whose header disagrees with itself or with the file's size: truncated, tensors
    overlapping or leaving gaps, a byte count that is not shape x dtype, absurd sizes. The message is one
    sentence naming the file and the tensor."""


def _parse(path: Path) -> tuple[dict, int, int]:
    """(header object, header length, file size): the length checked against the file, the JSON parsed
    (duplicate names refused), nothing else; no weight is read."""
    if not path.is_file():
        raise HeaderError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise HeaderError(f"{path}: too short to be a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw_len)
        if n > MAX_HEADER_BYTES or n > size - 8:
            limit = (f"the file holds only {size - 8} bytes after the length field" if n > size - 8
                     else f"the safetensors library refuses headers over {MAX_HEADER_BYTES // 10**6} MB")
            raise HeaderError(f"{path}: not a safetensors file (header length {n} is implausible: {limit})")
        text = f.read(n)

    def no_duplicates(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise HeaderError(f"{path}: not a safetensors file (the header names {key!r} twice)")
            seen[key] = value
        return seen
    try:
        obj = json.loads(text, object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeaderError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    except RecursionError:
        raise HeaderError(f"{path}: not a safetensors file (header is nested too deeply)") from None
    if not isinstance(obj, dict):
        raise HeaderError(f"{path}: not a safetensors file (header is not an object)")
    return obj, n, size


def _whole_number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(path: Path, name: str, info) -> TensorInfo:
    """One tensor's entry, its types checked and its byte count = shape x dtype."""
    bad = f"{path}: tensor {name!r} has a malformed header entry"
    if not isinstance(info, dict):
        raise DamagedFile(f"{bad} ({type(info).__name__} {json.dumps(info)[:60]} instead of "
                          "{dtype, shape, data_offsets})")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise DamagedFile(f"{bad} (no {', '.join(missing)})")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise DamagedFile(f"{bad} (dtype {dtype!r} is none of {', '.join(DTYPE_BYTES)})")
    if not isinstance(shape, list) or not all(_whole_number(s) for s in shape):
        raise DamagedFile(f"{bad} (shape {json.dumps(shape)[:80]} is not a list of sizes >= 0)")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_whole_number(o) for o in offsets)
            or offsets[0] > offsets[1]):
        raise DamagedFile(f"{bad} (data_offsets {json.dumps(offsets)[:80]} is not [begin, end] with "
                          "0 <= begin <= end)")
    tensor = TensorInfo(dtype, tuple(shape), (offsets[0], offsets[1]))
    expected = tensor.numel * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise DamagedFile(f"{path}: tensor {name!r} ({dtype} {list(shape)}) needs {expected} bytes, but its "
                          f"data_offsets {offsets} span {offsets[1] - offsets[0]}; the file is damaged, "
                          "download or export it again")
    return tensor


def _metadata(path: Path, obj: dict) -> dict[str, str]:
    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise DamagedFile(f"{path}: the header's __metadata__ must map names to text, got "
                          f"{json.dumps(metadata)[:80]}; the file is damaged, download or export it again")
    return dict(metadata)


def read_header(path: str | Path) -> Header:
    """The header as written: the JSON parsed and each entry's types checked (no file-size checks;
    see check_file for those)."""
    path = Path(path)
    obj, n, _ = _parse(path)
    metadata = _metadata(path, obj)
    tensors = {name: _entry(path, name, info) for name, info in obj.items()}
    return Header(path, tensors, metadata, 8 + n)


def check_file(path: str | Path) -> Header:
    """The header of a safetensors file that agrees with itself and with the file's size, from the header
    and `stat` alone (no weight is read): every tensor's bytes are shape x dtype, the tensors tile the
    data section from 0 without gaps or overlaps, and the data section ends where the file ends (as the
    safetensors library requires when it loads the file). Anything else raises DamagedFile naming the
    file and the tensor."""
    header = read_header(path)
    path = header.path
    data_bytes = path.stat().st_size - header.data_start
    fix = "download or export it again"
    position, before = 0, None
    for name, info in sorted(header.tensors.items(), key=lambda kv: (kv[1].offsets, kv[0])):
        begin, end = info.offsets
        if end > data_bytes:
            raise DamagedFile(f"{path}: tensor {name!r} ({info.dtype} {list(info.shape)}) lies at bytes "
                              f"{begin}..{end} of the data, but the file holds only {data_bytes} bytes of data: "
                              f"the file is truncated or its header claims too much; {fix}")
        if begin < position:
            raise DamagedFile(f"{path}: tensor {name!r} (bytes {begin}..{end}) overlaps tensor {before!r} "
                              f"(which ends at byte {position}); the file is damaged, {fix}")
        if begin > position:
            where = f"after tensor {before!r}" if before else "at the start of the data"
            raise DamagedFile(f"{path}: {begin - position} unaccounted bytes {where}, before tensor {name!r}; "
                              f"the file is damaged, {fix}")
        position, before = end, name
    if position != data_bytes:
        last = f"tensor {before!r}" if before else "the header"
        raise DamagedFile(f"{path}: {data_bytes - position} unaccounted bytes after {last} at the end of the "
                          f"file; the file is damaged or was appended to, {fix}")
    return header

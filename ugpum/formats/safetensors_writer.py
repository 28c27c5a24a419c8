"""Write a safetensors file tensor by tensor (header first): for files larger than host RAM, and for every
file UGPUM writes (`write_tensors`: LoRAs, checkpoints, the feature cache). Written here rather than by
the safetensors library, whose writer makes a temporary file of its own beside the target: a process
killed during it left that file (`.tmpXXXXXX`) where nothing knew to remove it. Here the only temporary
name is atomic_path's, which the next run clears; a write the system refuses is an OSError with its
number, which atomic_path words as one sentence."""
from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from typing import Callable

import torch

from .atomic import atomic_path

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def write_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                  needed: int | None = None, kept: str | None = None, atomic: bool = True) -> Path:
    """`tensors` (name -> tensor, any device) as one safetensors file, written atomically (`needed`, `kept`:
    as atomic_path takes them); `atomic=False` writes `path` itself, for a file in a folder that is
    itself temporary (a checkpoint's), with the system's error as it comes."""
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    return write_streaming(path, shapes, lambda name, shape, dtype: tensors[name].detach(), metadata, needed, kept,
                           atomic)


def write_streaming(path: str | Path, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                    make: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor],
                    metadata: dict[str, str] | None = None, needed: int | None = None,
                    kept: str | None = None, atomic: bool = True) -> Path:
    """`make(name, shape, dtype)` is called once per tensor, in order; only that tensor is in memory."""
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"safetensors metadata maps text to text; {key!r} holds a {type(value).__name__}")
    unknown = sorted({str(dtype) for _, dtype in shapes.values()} - {str(d) for d in SAFETENSORS_DTYPES})
    if unknown:
        raise ValueError(f"safetensors files here hold {', '.join(SAFETENSORS_DTYPES.values())}, not {unknown}")
    header, offset = {}, 0
    for name, (shape, dtype) in shapes.items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                       # keep the data section 8-byte aligned
    path = Path(path)
    with (atomic_path(path, needed=needed, kept=kept) if atomic else contextlib.nullcontext(path)) as tmp, \
            open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, (shape, dtype) in shapes.items():
            t = make(name, shape, dtype).to("cpu", dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: made shape {tuple(t.shape)}, declared {tuple(shape)}")
            if t.numel():                                       # (0-d: scales; the bytes as they lie, no copy)
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return path

"""Write a safetensors file tensor by tensor (header first), for checkpoints larger than host RAM."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import torch

from .atomic import atomic_path

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
    torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
}


def write_streaming(path: str | Path, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                    make: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor],
                    metadata: dict[str, str] | None = None) -> Path:
    """`make(name, shape, dtype)` is called once per tensor, in order; only that tensor is in memory."""
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
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, (shape, dtype) in shapes.items():
            t = make(name, shape, dtype).to("cpu", dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: made shape {tuple(t.shape)}, declared {tuple(shape)}")
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # 0-d: scales
    return path

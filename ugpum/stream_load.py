"""Fill a meta-device model from a safetensors file, one tensor at a time, each onto its device.

Reads tensors with plain file reads at the offsets in the header (not a memory map), so the process
never holds more than one tensor in host RAM, whatever the size of the model.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .safetensors_header import Header, read_header

TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointMismatch(ValueError):
    pass


def read_tensor(f, header: Header, key: str) -> torch.Tensor:
    info = header.tensors[key]
    start, end = info.offsets
    dtype = TORCH_DTYPES.get(info.dtype)
    if dtype is None:
        raise CheckpointMismatch(f"{header.path}: tensor {key} has unsupported dtype {info.dtype}")
    if end == start:
        return torch.empty(info.shape, dtype=dtype)
    buf = bytearray(end - start)
    f.seek(header.data_start + start)
    if f.readinto(buf) != len(buf):
        raise CheckpointMismatch(f"{header.path}: file is truncated (tensor {key})")
    return torch.frombuffer(buf, dtype=dtype).reshape(info.shape)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not t.is_floating_point():
        return t
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and t.dim() < 2:
        return t.to(torch.bfloat16)          # norms and biases stay in bf16 next to fp8 matrices
    return t.to(dtype)


def file_key(name: str, key_prefix: str, header: Header) -> str | None:
    """The file's key for module tensor `name`. Newer ComfyUI names FLUX.2's q/k norm scales
    `.weight` where checkpoints store `.scale` (and renames them on load); accept both."""
    for candidate in (name, name[:-len(".weight")] + ".scale" if name.endswith(".weight") else None):
        if candidate is not None and key_prefix + candidate in header.tensors:
            return key_prefix + candidate
    return None


def fill_from_file(model: nn.Module, layout, path: Path, key_prefix: str = "",
                   dtype: torch.dtype | None = None) -> None:
    header = read_header(path)
    names = dict(model.named_parameters())
    names.update(dict(model.named_buffers()))
    keys = {n: file_key(n, key_prefix, header) for n in names}
    missing = [n for n, k in keys.items() if k is None]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointMismatch(f"{path}: the model expects tensors the file lacks: {shown}")
    with open(path, "rb") as f:
        for name, old in names.items():
            owner_path, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_path) if owner_path else model
            device = torch.device(layout.device_of(owner_path))
            t = read_tensor(f, header, keys[name])
            if tuple(t.shape) != tuple(old.shape):
                raise CheckpointMismatch(f"{path}: {name} has shape {tuple(t.shape)}, the model expects "
                                         f"{tuple(old.shape)}: this file is another model size")
            t = _cast(t, dtype).to(device)
            if isinstance(old, nn.Parameter):
                owner._parameters[attr] = nn.Parameter(t, requires_grad=old.requires_grad)
            else:
                owner._buffers[attr] = t

"""Fill a meta-device model from a safetensors file, one tensor at a time, each onto its device.

Reads tensors with plain file reads at the offsets in the header (not a memory map), so the process
never holds more than one tensor in host RAM, whatever the size of the model. A tensor is cast to the
training dtype after it reaches its device (a bf16 file trained in fp8 never exists as fp8 on the host).

Scaled fp8 files store a matrix as fp8 codes plus one fp32 factor, the true weight being codes x factor:
ComfyUI's "fp8mixed" files (e.g. flux2_dev_fp8mixed.safetensors) name the factor `<layer>.weight_scale`,
the older "scaled_fp8" files `<layer>.scale_weight`. Trained in fp8, the codes stay on the device (1 byte
per weight) and the factor is applied after ComfyUI's op casts the weight for compute (its
`weight_function` hook); trained in another dtype, the weight is multiplied out while loading. A bf16
matrix trained in fp8 is scaled the same way (one factor per tensor, its largest value at fp8's largest).
Every tensor is checked for NaN and infinity as it lands (NonFiniteWeight names it).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..formats.finite import is_finite
from ..formats.safetensors_header import Header, read_header
from ..wording import EngineError

TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIXES = (".weight_scale", ".scale_weight")     # ComfyUI's fp8mixed, older scaled_fp8


class CheckpointMismatch(ValueError, EngineError):
    pass


class NonFiniteWeight(CheckpointMismatch):
    """A weight of the model file holds NaN or infinity: training on it could only give NaN."""


class ScaledWeight:
    """A ComfyUI op's `weight_function`: the weight, already cast to the compute dtype, times its
    scale factor (a Python float: kept at full precision, and nothing to place or swap)."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.scale


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


def weight_scale(f, header: Header, key: str) -> float | None:
    """The scale factor a scaled-fp8 file stores next to weight `key`, or None."""
    if not key.endswith(".weight"):
        return None
    for suffix in SCALE_SUFFIXES:
        scale_key = key[: -len(".weight")] + suffix
        if scale_key in header.tensors:
            s = read_tensor(f, header, scale_key)
            if s.numel() != 1:
                raise CheckpointMismatch(
                    f"{header.path}: {scale_key} holds {s.numel()} scale factors; only one per tensor "
                    "(ComfyUI's tensorwise fp8) is supported: use the model's bf16 or plain fp8 file")
            return float(s.float())
    return None


def _load(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None, scale: float | None,
          owner: nn.Module | None) -> torch.Tensor:
    """`t` on `device` in the training dtype. `owner`: the ComfyUI op whose `.weight` this is (None
    for anything else); a scale factor, the file's or one chosen here, is attached to it."""
    t = t.to(device)                           # cast on the device: fast on a GPU, host RAM holds one tensor
    scalable = isinstance(getattr(owner, "weight_function", None), list)
    if scale is not None:
        if (dtype is None or dtype == t.dtype) and scalable:
            owner.weight_function = [ScaledWeight(scale)]   # a list of its own: the op class's list is shared
            return t
        t, dtype = t.float() * scale, dtype or torch.bfloat16
    if dtype in FP8_DTYPES and t.dtype not in FP8_DTYPES and t.dim() >= 2 and scalable:
        # a wider matrix into fp8: scaled so its largest value meets fp8's largest (small weights would
        # otherwise fall into fp8's coarse subnormal range)
        amax = float(t.abs().max())
        scale = amax / torch.finfo(dtype).max if amax > 0 else 1.0
        owner.weight_function = [ScaledWeight(scale)]
        return (t.float() / scale).to(dtype)
    return _cast(t, dtype)


def file_key(name: str, key_prefix: str, header: Header) -> str | None:
    """The file's key for module tensor `name`. Newer ComfyUI names FLUX.2's q/k norm scales
    `.weight` where checkpoints store `.scale` (and renames them on load); accept both."""
    for candidate in (name, name[:-len(".weight")] + ".scale" if name.endswith(".weight") else None):
        if candidate is not None and key_prefix + candidate in header.tensors:
            return key_prefix + candidate
    return None


def fill_from_file(model: nn.Module, layout, path: Path, key_prefix: str = "",
                   dtype: torch.dtype | None = None, on_weight=None) -> None:
    """Allocate and fill every parameter and buffer of a meta-built `model` from `path` that is still on the
    meta device (a module put in already, such as another replica's `swap.SwapHandle.block_copy`, is left as
    it is), on the device `layout` gives its module. `on_weight(module_path, module)`, if given, is called as
    soon as a module's `weight` is in place (e.g. to quantise it before the next one arrives)."""
    header = read_header(path)
    names = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta}
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
            if old.is_floating_point() and not t.is_floating_point():
                raise CheckpointMismatch(f"{path}: {keys[name]} is stored as {header.tensors[keys[name]].dtype} "
                                         "(an integer-quantised format this trainer cannot read); use the "
                                         "model's bf16 or fp8 file")
            scale = weight_scale(f, header, keys[name]) if t.dtype in FP8_DTYPES else None
            t = _load(t, device, dtype, scale, owner if attr == "weight" else None)
            if not is_finite(t):                # checked on its device: a GPU reads it in microseconds
                raise NonFiniteWeight(f"{path}: tensor {keys[name]} holds NaN or infinite values, so training "
                                      "on it can only give NaN; the file is damaged or was saved from a diverged "
                                      "run: download or export the model again")
            if isinstance(old, nn.Parameter):
                owner._parameters[attr] = nn.Parameter(t, requires_grad=old.requires_grad)
            else:
                owner._buffers[attr] = t
            if on_weight is not None and attr == "weight":
                on_weight(owner_path, owner)

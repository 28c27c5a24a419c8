"""Model families the planner knows: look one up by id, or recognise it from a checkpoint header."""
from __future__ import annotations

from pathlib import Path

from ..formats.safetensors_header import Header, check_file
from ..wording import EngineError
from . import flux2, wan
from .base import ArchSpec, BlockSpec, LinearSpec, Workload

FAMILIES = (flux2, wan)
PREFIXES = ("model.diffusion_model.", "diffusion_model.")


class UnknownModel(ValueError, EngineError):
    pass


def model_ids() -> list[str]:
    return [id for fam in FAMILIES for id in fam.VARIANTS]


def get_spec(model_id: str) -> ArchSpec:
    for fam in FAMILIES:
        if model_id in fam.VARIANTS:
            return fam.spec(model_id)
    raise UnknownModel(f"unknown model id {model_id!r}; known: {', '.join(model_ids())}")


def strip_prefix(shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], str]:
    """Remove the key prefix ComfyUI checkpoints may carry; returns (shapes, prefix)."""
    for prefix in PREFIXES:
        if any(k.startswith(prefix) for k in shapes):
            return {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}, prefix
    return shapes, ""


def weight_dtype(header: Header) -> str:
    """The storage dtype of the block weights: 'fp8', 'bf16', 'fp16' or 'fp32'."""
    counts: dict[str, int] = {}
    for name, info in header.tensors.items():
        if "blocks." in name and name.endswith(".weight") and len(info.shape) == 2:
            counts[info.dtype] = counts.get(info.dtype, 0) + info.numel
    top = max(counts, key=counts.get) if counts else "BF16"
    return {"F8_E4M3": "fp8", "F8_E5M2": "fp8", "BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(top, "bf16")


def recognise(path: str | Path) -> tuple[ArchSpec, str, str]:
    """(spec, key prefix, weight dtype) of a DiT checkpoint, from its header alone (checked against the
    file's size, so a truncated or inconsistent file is named here, before any work starts)."""
    header = check_file(path)
    shapes, prefix = strip_prefix(header.shapes())
    for fam in FAMILIES:
        spec = fam.recognise(shapes, Path(path).name)
        if spec is not None:
            return spec, prefix, weight_dtype(header)
    raise UnknownModel(f"{path}: not a FLUX.2 or Wan 2.1 diffusion model "
                       "(no double_stream_modulation_img or head.modulation tensor in its header)")


__all__ = ["ArchSpec", "BlockSpec", "LinearSpec", "Workload", "UnknownModel", "get_spec",
           "model_ids", "recognise", "strip_prefix"]

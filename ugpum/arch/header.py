"""What a DiT checkpoint's header tells before any weight is read: the key prefix ComfyUI files may
carry, the storage dtype of the block weights, and how many blocks of a kind the file holds (the
families' `recognise` read their sizes with it)."""
from __future__ import annotations

from ..formats.safetensors_header import Header

PREFIXES = ("model.diffusion_model.", "diffusion_model.")


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


def count_blocks(shapes: dict[str, tuple[int, ...]], prefix: str) -> int:
    """Blocks numbered under `prefix` ("double_blocks." holds double_blocks.0 ... double_blocks.N-1)."""
    idx = {int(k[len(prefix):].split(".")[0]) for k in shapes if k.startswith(prefix)}
    return max(idx) + 1 if idx else 0

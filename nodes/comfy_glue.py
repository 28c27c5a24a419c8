"""What the nodes need from the running ComfyUI: its DiT class on the meta device and its CLIP and VAE
objects behind ugpum's `Encoders` interface (both in comfy_bridge, shared with the CLI), its memory
manager, and image conversion. (ugpum never imports comfy; DESIGN §2/§3.)"""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from comfy_bridge import ComfyEncoders, build_meta, free_comfy_memory, return_memory  # noqa: F401  (shared with the CLI)

def build_meta_model(spec, dtype: torch.dtype) -> torch.nn.Module:
    """ComfyUI's own FLUX.2 / Wan 2.1 module for `spec` on the meta device (this running ComfyUI's
    classes); `ugpum.placement.place` streams each block's weights from the file straight to its device."""
    return build_meta(spec, dtype)


def pil_to_image(images: list[Image.Image]) -> torch.Tensor:
    """PIL images (same size) -> ComfyUI IMAGE [B,H,W,3] float in [0,1]."""
    arrays = [np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0 for im in images]
    return torch.from_numpy(np.stack(arrays))


def text_image(lines: list[str], width: int = 512, height: int = 160) -> Image.Image:
    """A plain picture of a few lines of text, for an IMAGE output that has nothing else to show."""
    from PIL import ImageDraw
    im = Image.new("RGB", (width, height), (32, 32, 32))
    d = ImageDraw.Draw(im)
    for i, line in enumerate(lines):
        d.text((12, 12 + 18 * i), line, fill=(220, 220, 220))
    return im

"""What the training node needs from the running ComfyUI: its DiT class on the meta device, its CLIP
and VAE objects behind ugpum's `Encoders` interface, its memory manager, and image conversion.
(ugpum never imports comfy; this module is where the two meet, DESIGN §2/§3.)"""
from __future__ import annotations

import hashlib

import numpy as np
import torch
from PIL import Image

import comfy.latent_formats
import comfy.ldm.flux.model
import comfy.ldm.wan.model
import comfy.model_management
import comfy.ops

WEIGHT_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
LATENT_FORMATS = {"flux2": "Flux2", "wan": "Wan21"}


def build_meta_model(spec, dtype: torch.dtype) -> torch.nn.Module:
    """ComfyUI's own FLUX.2 / Wan 2.1 module for `spec` on the meta device (this running ComfyUI's
    classes); `ugpum.place` streams each block's weights from the file straight to its device."""
    from comfy_bridge import build_meta
    return build_meta(spec, dtype)


def free_comfy_memory() -> None:
    """Make ComfyUI let go of every model it holds on a GPU before UGPUM places its own."""
    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()


def _fingerprint(module) -> str:
    """A cheap identity for cache keys: class name plus a sample of the first weights."""
    h = hashlib.sha256(type(module).__name__.encode())
    try:
        for i, (name, t) in enumerate(module.state_dict().items()):
            if i >= 4:
                break
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode())
            if t.numel() and t.device.type != "meta":
                h.update(t.flatten()[:1024].detach().float().cpu().numpy().tobytes())
    except Exception:  # noqa: BLE001 - an unusual weight type only costs cache precision
        pass
    return h.hexdigest()[:16]


class ComfyEncoders:
    """ComfyUI's CLIP (text encoder) and VAE as ugpum's `Encoders` (ugpum/train/encoders.py)."""

    def __init__(self, clip, vae, family: str):
        self.clip, self.vae = clip, vae
        self.latent_format = getattr(comfy.latent_formats, LATENT_FORMATS[family])()
        self.video = family == "wan"
        self.identity = (f"comfy/{family}/clip-{_fingerprint(clip.cond_stage_model)}"
                         f"/vae-{_fingerprint(vae.first_stage_model)}")

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B,3,H,W] in [-1,1] -> the latent the DiT sees (after ComfyUI's latent format)."""
        images = ((pixels.float() + 1) / 2).clamp(0, 1).movedim(1, -1)      # ComfyUI IMAGE: [B,H,W,C]
        latent = self.vae.encode(images)
        return self.latent_format.process_in(latent.float())

    def encode_text(self, captions: list[str]) -> torch.Tensor:
        """[B,L,C] conditioning; shorter ones zero-padded to the longest."""
        conds = [self.clip.encode_from_tokens(self.clip.tokenize(c)).float().cpu()[0] for c in captions]
        longest = max(c.shape[0] for c in conds)
        out = torch.zeros(len(conds), longest, conds[0].shape[-1])
        for i, c in enumerate(conds):
            out[i, : c.shape[0]] = c
        return out

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        images = self.vae.decode(self.latent_format.process_out(latents.float()))
        if images.ndim == 5:                                                  # video: first frame
            images = images[:, 0]
        return (images.float() * 2 - 1).movedim(-1, 1).cpu()

    def release(self) -> None:
        free_comfy_memory()


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

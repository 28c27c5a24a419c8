"""What turns images and captions into the DiT's inputs.

Real training uses ComfyUI's VAE and text encoder (the nodes wrap ComfyUI's CLIP and VAE objects in
this interface). Tiny random-weight models have no real encoders: `StandInEncoders` is a fixed,
seeded, invertible pixel projection and a hashed word embedding, honest stand-ins that make the
same pipeline (caching, training, sampling, decoding) run end to end without any weights.
"""
from __future__ import annotations

import hashlib
from typing import Protocol

import torch
import torch.nn.functional as F

from ..arch.base import ArchSpec


class Encoders(Protocol):
    identity: str                                          # part of every cache key

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor: ...   # [B,3,H,W] in [-1,1]
    def encode_video(self, frames: torch.Tensor) -> torch.Tensor: ...    # one clip [T,3,H,W] -> [1,C,T',h,w]
    def encode_text(self, captions: list[str]) -> torch.Tensor: ...      # [B,L,C]
    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...         # -> [B,3,H,W] in [-1,1]; a
    # clip's latent [1,C,T',h,w] -> its frames [T,3,H,W], as ComfyUI's VAEDecode batches them


class StandInEncoders:
    """Pixel-unshuffle + fixed projection (latent) and hashed words (text), for tiny models."""

    def __init__(self, spec: ArchSpec, text_tokens: int = 16, seed: int = 1234):
        self.spec, self.text_tokens = spec, text_tokens
        self.factor, self.channels = spec.latent_factor, spec.latent_channels    # the family's latent
        g = torch.Generator().manual_seed(seed)
        pixels = 3 * self.factor ** 2
        q, _ = torch.linalg.qr(torch.randn(pixels, self.channels, generator=g, dtype=torch.float64))
        self.project = q.float()                            # orthonormal columns: decode is its transpose
        self.word_seed = seed
        self.identity = f"stand-in/{spec.family}/{spec.context_dim}/{text_tokens}/{seed}"

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        z = F.pixel_unshuffle(pixels.float(), self.factor)              # [B, 3f², h, w]
        z = torch.einsum("bphw,pc->bchw", z, self.project) * 2.0
        return z.unsqueeze(2) if self.spec.takes_clips else z          # a clip family's latents have a time axis

    def encode_video(self, frames: torch.Tensor) -> torch.Tensor:
        """A causal video VAE's time compression in miniature (ArchSpec.latent_frames): latent frame 0 from
        frame 0 alone, each later latent frame from the mean of the next `frames_per_latent` frames (Wan: 4)."""
        spec = self.spec
        problem = spec.frames_error(frames.shape[0]) if spec.takes_clips else f"{spec.id} takes no clips"
        if problem:
            raise ValueError(f"stand-in video encoding of {frames.shape[0]} frames: {problem}")
        n = spec.frames_per_latent
        groups = [frames[:1]] + [frames[i:i + n] for i in range(1, frames.shape[0], n)]
        latent = torch.cat([self.encode_images(g.float().mean(0, keepdim=True)) for g in groups], dim=2)
        return latent                                                   # [1, C, T', h, w]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if latents.dim() == 5:                    # one clip: latent frame 0 is frame 0, each later one
            if latents.shape[0] != 1:             # stands for the frames it was averaged from
                raise ValueError(f"decode takes one clip's latent [1,C,T',h,w], got {tuple(latents.shape)}")
            frames = self.decode(latents[0].movedim(1, 0))
            return torch.cat([frames[:1], frames[1:].repeat_interleave(self.spec.frames_per_latent, dim=0)])
        pixels = torch.einsum("bchw,pc->bphw", latents.float() / 2.0, self.project)
        return F.pixel_shuffle(pixels, self.factor).clamp(-1, 1)

    def _word(self, word: str) -> torch.Tensor:
        digest = hashlib.sha256(f"{self.word_seed}:{word}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.randn(self.spec.context_dim, generator=g)

    def encode_text(self, captions: list[str]) -> torch.Tensor:
        out = torch.zeros(len(captions), self.text_tokens, self.spec.context_dim)
        for i, caption in enumerate(captions):
            words = caption.lower().replace(",", " ").split()[: self.text_tokens]
            for j, word in enumerate(words):
                out[i, j] = self._word(word)
        return out

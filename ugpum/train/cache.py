"""Latents and caption embeddings computed once, stored as safetensors, keyed by content.

A key covers the image's content digest (a clip's, with its frames and stride; or the caption text),
the bucket and the encoders' identity, so a changed image, clip, caption or encoder gives a new key
(the stale entry is simply not used); a damaged file is rebuilt. Files are written under a temporary name and
renamed. A clip's latent is [C, T', h, w] with T' the model's latent frames (`ArchSpec.latent_frames`; Wan's
VAE: 1 + (frames - 1) / 4).
The folder is checked writable before anything is computed, and each entry's size against the free
space before it is written: either problem is one sentence naming the folder and the fix.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..arch import family_of
from ..folders import check_writable
from ..formats.safetensors_writer import write_tensors
from .dataset import ImageItem, load_bucketed_image
from .encoders import Encoders
from .video import ClipItem, content_digest, load_bucketed_clip


# How pictures are decoded (ugpum/train/pictures.py), in every latent's key: a change in decoding (2: high
# bit depths scaled, transparency laid over white) makes new latents rather than reusing stale ones.
PIXELS = b"pixels=3"
# What a full disk during caching keeps (said in the DiskFull sentence).
KEPT = "the features cached so far are kept (or set cache_dir to a folder on another disk)"


class FeatureCache:
    KINDS = ("latents", "text")          # a subfolder each

    def __init__(self, folder: str | Path, encoders: Encoders, spec, setting: str = "cache_dir"):
        self.folder = check_writable(folder, setting, "set cache_dir to a folder you can write in, or make "
                                                      "this one writable")
        self.encoders, self.spec = encoders, spec
        self.hits = 0
        self.misses = 0

    def _key(self, *parts: bytes) -> str:
        h = hashlib.sha256(self.encoders.identity.encode())
        for p in parts:
            h.update(len(p).to_bytes(8, "little"))
            h.update(p)
        return h.hexdigest()[:40]

    def _get(self, kind: str, key: str, compute) -> torch.Tensor:
        path = self.folder / kind / f"{key}.safetensors"
        if path.is_file():
            try:
                tensor = load_file(str(path))["value"]
                self.hits += 1
                return tensor
            except Exception:  # noqa: BLE001 - any damage (truncated, not safetensors, wrong key)
                pass                                   # damaged entry: rebuild it below
        tensor = compute().detach().cpu().contiguous()
        path.parent.mkdir(parents=True, exist_ok=True)
        needed = tensor.numel() * tensor.element_size() + 1024
        write_tensors(path, {"value": tensor}, {"encoders": self.encoders.identity}, needed=needed, kept=KEPT)
        self.misses += 1
        return tensor

    def latent(self, item: ImageItem) -> torch.Tensor:
        if isinstance(item, ClipItem):
            return self.clip_latent(item)
        key = self._key(content_digest(item.path), repr(item.bucket).encode(), PIXELS)
        return self._get(self.KINDS[0], key, lambda: self.encoders.encode_images(load_bucketed_image(item)[None])[0])

    def clip_latent(self, item: ClipItem) -> torch.Tensor:
        def encode() -> torch.Tensor:
            latent = self.encoders.encode_video(load_bucketed_clip(item))[0]
            expected = self.spec.latent_frames(item.frames)
            if latent.dim() != 4 or latent.shape[1] != expected:
                raise ValueError(f"clip {item.path}: the VAE gave a latent of shape {tuple(latent.shape)} for "
                                 f"{item.frames} frames, not [C, {expected}, h, w]; connect the "
                                 f"{family_of(self.spec).title} VAE")
            return latent
        key = self._key(content_digest(item.path), repr(item.bucket).encode(),
                        f"frames={item.frames} stride={item.stride}".encode(), PIXELS)
        return self._get(self.KINDS[0], key, encode)

    def text(self, caption: str) -> torch.Tensor:
        return self._get(self.KINDS[1], self._key(caption.encode()), lambda: self.encoders.encode_text([caption])[0])


def dataset_hash(items: Iterable) -> str:
    """A sha256 hex digest of the images' (and clips') contents and their captions, for the LoRA's
    metadata. Items are anything with `.path` and `.caption`. The order of items and the file names
    do not matter (except the names inside a frame folder, which order its frames); contents,
    captions and how often each pair occurs (repeats) do."""
    digests: dict[Path, str] = {}
    entries = []
    for item in items:
        path = Path(item.path)
        if path not in digests:
            digests[path] = content_digest(path).hex()
        entries.append(json.dumps([digests[path], item.caption]))
    digest = hashlib.sha256()
    for entry in sorted(entries):
        digest.update(entry.encode("utf-8") + b"\n")
    return digest.hexdigest()

"""What the steps eat: the dataset's items, their cached features (latents and caption embeddings),
and which items the k-th micro-batch takes."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from .cache import FeatureCache
from .config import TrainConfig
from .dataset import ImageItem, caption_dropout
from .pictures import skipped_note, skipped_pictures
from .run.layout import RunFolder
from .musubi_toml import check_inside, load_musubi_toml
from .objective import model_context
from .video import load_folder


def load_items(cfg: TrainConfig, spec, log=print) -> list[ImageItem]:
    """The run's dataset for `spec`'s model, read; `log` hears of every folder holding pictures of a kind
    it does not read, and of every picture with damaged metadata."""
    path = Path(cfg.dataset)
    if cfg.dataset_root:                 # the nodes: checked again as it is read (a TOML may have changed)
        check_inside(path, cfg.dataset_root)
    if path.suffix == ".toml":
        items = load_musubi_toml(path, cfg.trigger, spec, cfg.frames, cfg.frame_stride, cfg.resolution, log)
    else:
        items = load_folder(path, spec, frames=cfg.frames, stride=cfg.frame_stride,
                            resolution=cfg.resolution, repeats=cfg.repeats, trigger=cfg.trigger, log=log)
    folders = {Path(i.path).parent for i in items} | {Path(i.path) for i in items if Path(i.path).is_dir()}
    for folder in sorted(folders):                 # the dataset's folders, and each clip's folder of frames
        skipped = skipped_pictures(folder)
        if skipped:
            log(f"note: {folder}: {skipped_note(skipped)}")
    return items


@dataclass
class Features:
    latents: list[torch.Tensor]
    contexts: list[torch.Tensor]
    prompt: torch.Tensor | None = None        # the sample prompt's embedding (runs that sample)
    negative: torch.Tensor | None = None
    hits: int = 0
    misses: int = 0


def encode_features(cfg: TrainConfig, spec, items, encoders, out: Path, log=print) -> Features:
    """Every latent and caption embedding for `spec`'s model through the feature cache (and the sample
    prompts for runs that sample); the encoders are released after, also on failure, so they leave the
    GPUs before the DiT is placed."""
    cache = FeatureCache(RunFolder(out, cfg.cache_dir).cache, encoders, spec)
    try:
        latents = [cache.latent(item) for item in items]
        rng = random.Random(cfg.seed)
        contexts = [cache.text(caption_dropout(item.caption, cfg.caption_dropout, rng)) for item in items]
        features = Features(latents, contexts)
        if cfg.sample_every:
            features.prompt = cache.text(cfg.sample_prompt or items[0].caption)
            features.negative = cache.text("")
    finally:
        release = getattr(encoders, "release", None)
        if release:
            release()
    features.hits, features.misses = cache.hits, cache.misses
    log(f"features: {len(items)} items, cache {cache.hits} hit(s), {cache.misses} computed")
    return features


class MicroBatches:
    """Which dataset items the k-th micro-batch takes. Every epoch is a fresh seeded shuffle; items
    of one shape (latent and text tokens: one tensor stacks them) are grouped `batch` at a time in
    the order they come, and a group left short at the epoch's end is a smaller micro-batch. With
    batch 1 it is the shuffle itself."""

    def __init__(self, shapes: list[tuple], batch: int, seed: int):
        self.shapes, self.batch, self.seed = shapes, batch, seed
        self._epoch, self._groups = -1, []
        self.per_epoch = len(self._for_epoch(0))

    @classmethod
    def of(cls, spec, features: Features, cfg: TrainConfig) -> "MicroBatches":
        """The micro-batches of a run's features (shape: latent shape and model text length)."""
        return cls([(tuple(latent.shape), model_context(spec, context).shape[1])
                    for latent, context in zip(features.latents, features.contexts)], cfg.batch, cfg.seed)

    def _for_epoch(self, epoch: int) -> list[list[int]]:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            filling: dict[tuple, list[int]] = {}
            groups = []
            for i in torch.randperm(len(self.shapes), generator=g).tolist():
                group = filling.setdefault(self.shapes[i], [])
                group.append(i)
                if len(group) == self.batch:
                    groups.append(filling.pop(self.shapes[i]))
            self._epoch, self._groups = epoch, groups + list(filling.values())
        return self._groups

    def __call__(self, k: int) -> list[int]:
        epoch, j = divmod(k, self.per_epoch)
        return self._for_epoch(epoch)[j]

    def runs(self, ks: list[int]) -> list[list[tuple[int, list[int]]]]:
        """The micro-batches `ks` as runs of consecutive ones of one static shape: [(k, items), ...]
        (a pipeline schedule takes one shape)."""
        runs: list[list[tuple[int, list[int]]]] = []
        previous = None
        for k in ks:
            picked = self(k)
            key = (self.shapes[picked[0]], len(picked))
            if key != previous:
                runs.append([])
                previous = key
            runs[-1].append((k, picked))
        return runs

"""Preview samples during a run: "before" (the LoRA starts as a no-op), one every `sample_every`
steps, "after", and the before/after grid the nodes and the README show.

A sample is a preview: one that cannot be rendered (the GPU out of memory) or written (a folder or a
file in the way, a full disk) is said in one sentence, and the run trains on without samples rather
than stopping."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..render.prompt import render
from ..formats.atomic import atomic_path
from ..formats.refused import SaveRefused
from ..render.report import grid, save_animation, to_pil
from .run.layout import RunFolder
from .video import ClipItem


class Samples:
    def __init__(self, cfg, spec, out: Path, model, decode, prompt, negative, items,
                 on_sample: Callable[[int, object], None] | None = None, log: Callable[[str], None] = print):
        self.cfg, self.spec, self.run, self.model, self.decode, self.log = cfg, spec, RunFolder(out), model, decode, log
        self.failed = False                  # a sample failed: no more are taken (said once)
        self.prompt, self.negative, self.on_sample = prompt, negative, on_sample
        # clips preview at the first clip's bucket (e.g. 832x480): the first frame as PNG (the
        # before/after grid, the node's preview) and the whole sampled clip as an animated WebP beside it
        self.width, self.height = next((i.bucket for i in items if isinstance(i, ClipItem)), (cfg.resolution,) * 2)
        self.paths: list[Path] = []

    def take(self, at: int) -> None:
        """The sample of step `at`, rendered, saved and shown (see the module's note on failures)."""
        if self.failed:
            return
        try:
            self._take(at)
        except (OSError, torch.OutOfMemoryError) as error:
            self._failed(f"the sample of step {at}", error)

    def _failed(self, what: str, error: BaseException) -> None:
        self.failed = True
        folder = self.run.samples
        if isinstance(error, torch.OutOfMemoryError):
            why, fix = "the GPU ran out of memory rendering it", "set sample_every = 0, or lower sample_steps"
        elif isinstance(error, SaveRefused):                # a full disk, a quota, a read-only disk, ...
            why, fix = str(error), "do as it says for samples in later runs"
        else:
            # (a rename names its target second)
            target = getattr(error, "filename2", None) or getattr(error, "filename", None) or folder
            why = f"cannot write {target}: {(error.strerror or str(error)).lower()}"
            fix = f"move what is in the way in {folder}, or make it writable, for samples in later runs"
        self.log(f"samples: {what} failed ({why}); the run trains on without samples (nothing trained is lost): "
                 f"{fix}")

    def _take(self, at: int) -> None:
        cfg = self.cfg
        frames = [to_pil(f) for f in render(self.model, self.spec, self.decode, self.prompt, self.negative,
                                            self.width, self.height, cfg.sample_seed, cfg.sample_steps, cfg.frames,
                                            cfg.sample_guidance)]
        image = frames[0]
        path = self.run.sample(at)
        path.parent.mkdir(exist_ok=True)
        if len(frames) > 1:
            with atomic_path(path.with_suffix(".webp")) as tmp:
                save_animation(frames, tmp, self.spec.frame_rate)
        with atomic_path(path) as tmp:
            image.save(tmp, format="PNG")
        self.paths.append(path)
        if self.on_sample:
            self.on_sample(at, image)

    def before_after(self, step: int) -> Path | None:
        """The first and the last sample side by side (None when a sample failed)."""
        from PIL import Image
        if self.failed or not self.paths:
            return None
        path = self.run.before_after
        try:
            with Image.open(self.paths[0]) as before, Image.open(self.paths[-1]) as after, atomic_path(path) as tmp:
                grid([("before", [before.copy()]), (f"after {step}", [after.copy()])]).save(tmp, format="PNG")
        except OSError as error:
            self._failed("the before/after picture", error)
            return None
        return path

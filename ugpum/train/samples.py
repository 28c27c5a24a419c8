"""Preview samples during a run: "before" (the LoRA starts as a no-op), one every `sample_every`
steps, "after", and the before/after grid the nodes and the README show."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..diffusion.render_prompt import render
from ..formats.atomic import atomic_path
from ..report import grid, save_animation, to_pil
from .video import ClipItem


class Samples:
    def __init__(self, cfg, spec, out: Path, model, decode, prompt, negative, items,
                 on_sample: Callable[[int, object], None] | None = None):
        self.cfg, self.spec, self.out, self.model, self.decode = cfg, spec, Path(out), model, decode
        self.prompt, self.negative, self.on_sample = prompt, negative, on_sample
        # clips preview at the first clip's bucket (e.g. 832x480): the first frame as PNG (the
        # before/after grid, the node's preview) and the whole sampled clip as an animated WebP beside it
        self.width, self.height = next((i.bucket for i in items if isinstance(i, ClipItem)), (cfg.resolution,) * 2)
        self.paths: list[Path] = []

    def take(self, at: int) -> None:
        cfg = self.cfg
        frames = [to_pil(f) for f in render(self.model, self.spec, self.decode, self.prompt, self.negative,
                                            self.width, self.height, cfg.sample_seed, cfg.sample_steps, cfg.frames,
                                            cfg.sample_guidance)]
        image = frames[0]
        path = self.out / "samples" / f"step_{at:05d}.png"
        path.parent.mkdir(exist_ok=True)
        if len(frames) > 1:
            with atomic_path(path.with_suffix(".webp")) as tmp:
                save_animation(frames, tmp)
        with atomic_path(path) as tmp:
            image.save(tmp, format="PNG")
        self.paths.append(path)
        if self.on_sample:
            self.on_sample(at, image)

    def before_after(self, step: int) -> Path:
        """The first and the last sample side by side."""
        from PIL import Image
        path = self.out / "samples" / "before_after.png"
        with Image.open(self.paths[0]) as before, Image.open(self.paths[-1]) as after, atomic_path(path) as tmp:
            grid([("before", [before.copy()]), (f"after {step}", [after.copy()])]).save(tmp, format="PNG")
        return path

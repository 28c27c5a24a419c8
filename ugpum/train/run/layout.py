"""What a run folder holds, and where: the one place that names its files and folders. Everything that
reads or writes a run (the loop, saves, resumes, samples, the feature cache, the nodes) asks a
`RunFolder` for the path, so the layout can change here alone.

    OUT/
      NAME.safetensors, NAME_stepN.safetensors   the LoRA, and the LoRA of each periodic save
      metrics.jsonl                             one line per step
      plan.json                                 the plan the run used
      checkpoints/step_NNNNNN/                   LoRA, optimizer state and state.json (checkpoint.py)
      samples/                                  preview images, and before_after.png
      cache/                                    the feature cache (unless cache_dir puts it elsewhere)
      .ugpum_run.lock                           held while a run writes here (lock.py)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = ".ugpum_run.lock"


@dataclass(frozen=True)
class RunFolder:
    root: Path
    cache_dir: Path | None = None        # where the feature cache lives when not in the run folder

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))
        object.__setattr__(self, "cache_dir", Path(self.cache_dir) if self.cache_dir else None)   # ('': unset)

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def lock(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def cache(self) -> Path:
        return self.cache_dir or self.root / "cache"

    def lora(self, file_name: str) -> Path:
        return self.root / file_name

    def loras(self, output_name: str) -> list[Path]:
        """The LoRA files a run of `output_name` wrote here (the final one and those of periodic saves)."""
        return sorted(self.root.glob(f"{output_name}*.safetensors"))

    def sample(self, step: int) -> Path:
        return self.samples / f"step_{step:05d}.png"

    @property
    def before_after(self) -> Path:
        return self.samples / "before_after.png"

    def run_files(self) -> tuple[Path, ...]:
        """What a run writes besides its LoRA files and the cache (removed when a run is replaced)."""
        return self.metrics, self.checkpoints, self.plan, self.samples

    def written_folders(self) -> list[Path]:
        """The folders a run writes files into by temporary names (checked for leftovers of killed writers);
        the cache's own folders are listed by the cache."""
        return [self.root, self.checkpoints, self.samples]

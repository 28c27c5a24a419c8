"""The learning rate of each step, and what a resume with a new number of steps does to it.

The schedule (constant or cosine, after a linear warmup) spans the run's `steps`. A resume that changes
them (more steps for a finished run, or fewer) stretches the schedule over the new total from the step it
resumes at: a cosine run then trains on at the rate the stretched curve has there, not where the old one
had arrived. The run's log says so with both rates (`resume_note`), so the change is never a silent jump.
"""
from __future__ import annotations

import dataclasses
import math

from ..wording import setting
from .config import TrainConfig


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """The factor of `cfg.lr` the step of 0-based index `step` trains at."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return 1.0


def resume_note(cfg: TrainConfig, started_steps: int, at: int) -> str | None:
    """What a resume at step `at` of a run started with `started_steps` steps does to the learning rate
    now that it trains `cfg.steps`: None when the rates are the same."""
    if started_steps == cfg.steps or not isinstance(started_steps, int):
        return None
    before = cfg.lr * lr_factor(dataclasses.replace(cfg, steps=started_steps), at - 1)
    after = cfg.lr * lr_factor(cfg, at)
    if math.isclose(before, after, rel_tol=1e-9) and cfg.lr_schedule == "constant":
        return None
    return (f"learning rate: {setting('steps', cfg.steps)} where the run started with {started_steps}, so its "
            f"{cfg.lr_schedule} schedule is stretched over {cfg.steps} steps: step {at} trained at lr {before:.3g}, "
            f"step {at + 1} trains at lr {after:.3g}")

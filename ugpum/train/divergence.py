"""A step whose loss or gradients are not finite numbers stops the run before the optimizer applies
it: the LoRA stays as the last good step left it, and the sentence names the step."""
from __future__ import annotations

import math

import torch

from .errors import TrainingError


class NonFiniteStep(TrainingError):
    """The loss or a gradient of a step is NaN or infinite; nothing of that step was applied."""


def _total_norm(grads: list[torch.Tensor]) -> float:
    """The gradients' joint 2-norm (inf or NaN when any value is), read with one device sync."""
    if hasattr(torch.nn.utils, "get_total_norm"):
        return float(torch.nn.utils.get_total_norm(grads))
    first = grads[0].device
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).to(first) for g in grads])))


def check_step(step: int, loss: float, params: list[torch.nn.Parameter], cfg) -> None:
    """Raise NonFiniteStep for step `step` (counted from 1) when its loss or its gradients are not finite."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = _total_norm(grads) if grads else 0.0
    if math.isfinite(loss) and math.isfinite(norm):
        return
    what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradients' norm is {norm}"
    clip = "" if cfg.max_grad_norm else ", turn gradient clipping on (max_grad_norm = 1.0)"
    raise NonFiniteStep(f"step {step}: {what}, so the run stopped before applying it (the LoRA stays as step "
                        f"{step - 1} left it); training diverged or a training image or caption gives a bad "
                        f"value: lower lr (now {cfg.lr:g}){clip}, then resume from the last checkpoint")

"""A step whose loss or gradients are not finite numbers stops the run before the optimizer applies
it: the LoRA stays as the last good step left it, and the sentence names the step."""
from __future__ import annotations

import math

import torch

from .errors import TrainingError


class NonFiniteStep(TrainingError):
    """The loss or a gradient of a step is NaN or infinite; nothing of that step was applied."""


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradients' joint 2-norm (inf or NaN when any value is), on the device: not read yet."""
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads)
    first = grads[0].device
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).to(first) for g in grads]))


def _read(values: list[torch.Tensor]) -> list[float]:
    """One-value tensors on any devices, read in one host sync (`float(t)` waits for the device each time)."""
    first = values[0].device
    return torch.stack([v.detach().reshape(()).to(first, torch.float64) for v in values]).tolist()   # (exact)


def clip_with_norm(params: list[torch.nn.Parameter], max_norm: float, norm: torch.Tensor | None) -> None:
    """`torch.nn.utils.clip_grad_norm_(params, max_norm)` with their joint norm already measured (`check_step`'s):
    the same scaling, without a second pass over every gradient."""
    if norm is None:
        return                                   # (no gradients)
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    else:
        torch.nn.utils.clip_grad_norm_(params, max_norm)


def check_step(step: int, loss: float | list[torch.Tensor], params: list[torch.nn.Parameter],
               cfg) -> tuple[float, torch.Tensor | None]:
    """Raise NonFiniteStep for step `step` (counted from 1) when its loss or its gradients are not finite;
    else (the step's loss, the gradients' joint norm on their device, None without gradients: `clip_with_norm`
    takes it). `loss`: a number, or the micro-batches' losses as tensors, summed in order once read: they and
    the gradients' norm are read together, the step's one host sync."""
    grads = [p.grad for p in params if p.grad is not None]
    losses = loss if isinstance(loss, list) else []
    norm_tensor = _total_norm(grads) if grads else None
    *parts, norm = _read([*losses, norm_tensor if norm_tensor is not None else torch.zeros(())])
    if isinstance(loss, list):
        loss = sum(parts)
    if math.isfinite(loss) and math.isfinite(norm):
        return loss, norm_tensor
    what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradients' norm is {norm}"
    clip = "" if cfg.max_grad_norm else ", turn gradient clipping on (max_grad_norm = 1.0)"
    raise NonFiniteStep(f"step {step}: {what}, so the run stopped before applying it (the LoRA stays as step "
                        f"{step - 1} left it); training diverged or a training image or caption gives a bad "
                        f"value: lower lr (now {cfg.lr:g}){clip}, then resume from the last checkpoint")

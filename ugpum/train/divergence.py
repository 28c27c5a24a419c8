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


def clip_with_norm(params: list[torch.nn.Parameter], max_norm: float, norm: torch.Tensor | None) -> None:
    """`torch.nn.utils.clip_grad_norm_(params, max_norm)` with their joint norm already measured (`StepReading`'s):
    the same scaling, without a second pass over every gradient."""
    if norm is None:
        return                                   # (no gradients)
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    else:
        torch.nn.utils.clip_grad_norm_(params, max_norm)


class StepReading:
    """Step `step`'s loss and its gradients' joint norm, measured on the device and read on the host in one sync.

    `loss`: a number, or the micro-batches' losses as tensors, summed in order once read. With `skip_on_device` (an
    optimizer that skips a step on the device where told to: `skips_on_device`), nothing waits for the device
    here: the optimizer is told to skip this step where its values are not finite, and they travel to the host
    while the next step runs, read by `read()`. Without it they are read now, and a step that is not finite
    raises before the optimizer sees it."""

    def __init__(self, step: int, loss: float | list[torch.Tensor], params: list[torch.nn.Parameter], cfg,
                 skip_on_device: torch.optim.Optimizer | None = None):
        grads = [p.grad for p in params if p.grad is not None]
        self.step, self.cfg, self.number = step, cfg, None if isinstance(loss, list) else loss
        self.norm = _total_norm(grads) if grads else None            # on the device: `clip_with_norm` takes it
        parts = [*(loss if isinstance(loss, list) else []), self.norm if grads else torch.zeros(())]
        values = torch.stack([v.detach().reshape(()).to(parts[0].device, torch.float64) for v in parts])  # (exact)
        self.values, self.ready = values, None
        if skip_on_device is None or self.number is not None:    # (a number was read already: checked now)
            self.values = values.cpu()
            self.read()
            return
        skip_on_device.found_inf = (~torch.isfinite(values).all()).float()
        if values.is_cuda:                   # a copy the host can wait for alone, behind what is queued there now
            with torch.cuda.device(values.device):
                self.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                self.values.copy_(values, non_blocking=True)
                self.ready = torch.cuda.Event()
                self.ready.record(torch.cuda.current_stream(values.device))

    def read(self) -> float:
        """The step's loss, once the device has it; NonFiniteStep where the loss or the gradients are not finite
        (then the optimizer did not apply the step)."""
        if self.ready is not None:
            self.ready.synchronize()
        *parts, norm = self.values.tolist()
        loss = sum(parts) if self.number is None else self.number
        if math.isfinite(loss) and math.isfinite(norm):
            return loss
        what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradients' norm is {norm}"
        cfg, step = self.cfg, self.step
        clip = "" if cfg.max_grad_norm else ", turn gradient clipping on (max_grad_norm = 1.0)"
        raise NonFiniteStep(f"step {step}: {what}, so the run stopped before applying it (the LoRA stays as step "
                            f"{step - 1} left it); training diverged or a training image or caption gives a bad "
                            f"value: lower lr (now {cfg.lr:g}){clip}, then resume from the last checkpoint")


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` skips a step on the device when its `found_inf` says so (torch's fused Adam and AdamW,
    which GradScaler tells the same way), leaving its parameters, moments and step counts as they were."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused") for group in optimizer.param_groups)

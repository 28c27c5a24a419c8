"""Sampling previews on the (placed) training model, the way ComfyUI samples its rectified-flow models.

x_sigma = (1 - sigma) x0 + sigma noise, and the network predicts the velocity v = noise - x0 (ComfyUI's
CONST model sampling: denoised = x - sigma v). Sampling walks a decreasing list of sigmas from 1 to 0
with Euler steps

    x <- x + (sigma_next - sigma) * v(x, sigma)

which is ComfyUI's ``euler`` sampler (k-diffusion's Euler: d = (x - denoised) / sigma = v). With
classifier-free guidance, v = v_neg + cfg (v_pos - v_neg); ComfyUI forms the same mix on the denoised
predictions, which is the same thing because both share x and sigma. At cfg == 1 the negative pass is
skipped, as ComfyUI does.

Each family supplies its sigmas and its model wrapped as a `ModelFn` (ugpum/arch/<family>/sampler.py,
through `ArchSpec.sampler_model_fn`); this module holds what they share: ComfyUI's ``simple`` scheduler's
table reads, the model's input dtype and device, ComfyUI's seeded noise and the sampler itself. ComfyUI
evaluates its schedules in float32; the families' schedules do the same arithmetic.

The result is the model-space latent, i.e. what ComfyUI's sampler holds before
``latent_format.process_out``. Apply that before handing it to a VAE decode the way ComfyUI's KSampler does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class SamplingDefaults:
    steps: int
    cfg: float
    guidance: float | None = None   # a guidance-distilled model's guidance input (FLUX.2 dev; not CFG)


def simple_ks(steps: int, table_size: int) -> list[int]:
    """ComfyUI's ``simple`` scheduler reads ``steps`` entries of a sigma table that holds the
    sigmas of t = k / table_size, k = 1..table_size, starting at the top and striding by
    table_size / steps (float stride, floored index, exactly as ComfyUI indexes). Returns the k."""
    stride = table_size / steps
    return [table_size - int(i * stride) for i in range(steps)]


def check_steps(steps: int) -> None:
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")


def with_zero(sigmas: torch.Tensor) -> torch.Tensor:
    return torch.cat([sigmas.to(torch.float32), torch.zeros(1, dtype=torch.float32)])


# --------------------------------------------------------------------------- model wrappers


class ModelFn:
    """``fn(x, sigma, context) -> velocity`` plus the family's default schedule.

    ``x``: the latent in the sampler's dtype; ``sigma``: one sigma per sample, shape [B];
    ``context``: the text-encoder output for this pass. The call converts sigma to the model's
    timestep convention, casts inputs to the model's dtype and device and the output back.
    """

    def __init__(self, call: Callable, sigmas_for: Callable[[int, torch.Tensor], torch.Tensor]):
        self._call = call
        self._sigmas_for = sigmas_for

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self._call(x, sigma, context)

    def sigmas(self, steps: int, latent: torch.Tensor) -> torch.Tensor:
        """The family's default sigmas for ``steps`` steps on a latent shaped like ``latent``."""
        return self._sigmas_for(steps, latent)


_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def model_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the model's inputs are cast to (ComfyUI: the model dtype, or its manual-cast
    dtype when the weights are stored in fp8). Stored fp8 falls back to bfloat16."""
    if dtype is not None:
        return dtype
    d = getattr(model, "dtype", None)   # ComfyUI's model classes record their weight dtype
    if not isinstance(d, torch.dtype):
        d = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return d if d in _COMPUTE_DTYPES else torch.bfloat16


def input_device(module: torch.nn.Module, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


# --------------------------------------------------------------------------- noise and sampling


def comfy_noise(shape, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The initial noise ComfyUI draws for ``seed`` (standard normal, float32, CPU generator),
    so a preview can be reproduced in ComfyUI with the same seed and empty latent."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32, device="cpu").to(dtype)


def _batched(context: torch.Tensor, batch: int, name: str) -> torch.Tensor:
    if context.shape[0] == batch:
        return context
    if context.shape[0] == 1:
        return context.expand(batch, *context.shape[1:])
    raise ValueError(f"{name} has batch {context.shape[0]}, the latent {batch}")


@torch.no_grad()
def sample(model_fn: Callable, noise: torch.Tensor, positive: torch.Tensor,
           negative: torch.Tensor | None = None, steps: int | None = None, cfg: float = 1.0,
           sigmas: torch.Tensor | None = None, *, latent_image: torch.Tensor | None = None,
           callback: Callable[[int, float, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Flow-matching Euler from ``noise`` to a latent, ComfyUI's ``euler`` sampler.

    model_fn: ``(x, sigma[B], context) -> velocity``; a family's (``ArchSpec.sampler_model_fn``) also
    supplies the default sigmas. sigmas: decreasing, usually 1 ... 0 (a family's schedule); when omitted,
    ``model_fn.sigmas(steps, noise)``. cfg: guidance scale;
    1 runs the positive pass only (ComfyUI skips the negative pass at cfg 1), otherwise
    ``negative`` is required. latent_image: a model-space latent to start from (img2img with
    truncated sigmas); ComfyUI's start is sigmas[0] * noise + (1 - sigmas[0]) * latent_image.
    callback(i, sigma, x) after each step.

    Works in float32, or float64 when ``noise`` is float64 (ComfyUI always keeps the latent in
    float32 and casts only the model's input to the model's dtype).
    """
    if sigmas is None:
        if steps is None:
            raise ValueError("give sigmas or steps")
        if not hasattr(model_fn, "sigmas"):
            raise ValueError("this model_fn has no default schedule: pass sigmas (a family's schedule) or use "
                             "a family's model function (ArchSpec.sampler_model_fn)")
        sigmas = model_fn.sigmas(steps, noise)
    sigmas = torch.as_tensor(sigmas)
    if sigmas.ndim != 1 or sigmas.numel() < 1:
        raise ValueError(f"sigmas must be a 1-D tensor, got shape {tuple(sigmas.shape)}")
    use_cfg = not math.isclose(float(cfg), 1.0)
    if use_cfg and negative is None:
        raise ValueError(f"cfg {cfg} needs a negative context (or use cfg 1)")

    dtype = torch.promote_types(noise.dtype, torch.float32)
    sigmas = sigmas.to(noise.device, dtype)
    b = noise.shape[0]
    pos = _batched(positive, b, "positive")
    neg = _batched(negative, b, "negative") if use_cfg else None

    x = noise.to(dtype)
    x = sigmas[0] * x if latent_image is None else sigmas[0] * x + (1 - sigmas[0]) * latent_image.to(x)
    ones = x.new_ones(b)
    for i in range(sigmas.numel() - 1):
        sigma = sigmas[i]
        s = sigma * ones
        v = model_fn(x, s, pos)
        if use_cfg:
            v_neg = model_fn(x, s, neg)
            v = v_neg + (v - v_neg) * cfg
        x = x + v * (sigmas[i + 1] - sigma)
        if callback is not None:
            callback(i, float(sigma), x)
    return x

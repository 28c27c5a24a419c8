"""How ComfyUI samples FLUX.2, for previews on the training model (`ugpum.diffusion.flow_sampler` walks
the sigmas): its sigmas, its model wrapped as the sampler's velocity function, its text padding and its
sampling defaults.

Where the sigmas come from, two ComfyUI routes (float32, as ComfyUI hands them to its samplers):

- ``schedule="flux2"`` (default): ComfyUI's FLUX.2 scheduler node ``Flux2Scheduler``
  (comfy_extras/nodes_flux.py; BFL's reference schedule): ``steps + 1`` evenly spaced t from 1 to 0,
  each moved by FLUX.2's resolution- and step-dependent log-shift mu (``ugpum.diffusion.flow.flux2_mu``,
  the same empirical fit);
- ``schedule="simple"``: the plain KSampler with scheduler ``simple`` on the model's own
  ``ModelSamplingFlux`` (``Flux2.sampling_settings['shift'] = 2.02``, a log-shift: the factor is
  e^2.02 ~ 7.5, independent of resolution).

The FLUX.2 time shift, written as ComfyUI and BFL write it, is sigma = e^mu / (e^mu + (1/t - 1)), i.e.
the flow shift s t / (1 + (s - 1) t) with s = e^mu. The model takes ``timestep = sigma`` (it multiplies
by 1000 inside its time embedding). tests/integration/test_sampler.py checks that the sigmas are the very
float32 values ComfyUI uses (bit for bit, over 1..100 steps and a grid of FLUX.2 resolutions).

Usage on ComfyUI's ``comfy.ldm.flux.model.Flux``::

    fn = flux2_model_fn(dit)                       # klein: no guidance embedder
    noise = comfy_noise((1, 128, 64, 64), seed=42)  # 1024x1024, same noise as ComfyUI's seed 42
    latent = sample(fn, noise, positive=ctx, steps=4, cfg=1.0)        # distilled klein
    latent = sample(fn, noise, positive=ctx, negative=neg, steps=50, cfg=4.0)  # klein base
"""
from __future__ import annotations

import math

import torch

from ...diffusion.flow import flux2_mu
from ...diffusion.flow_sampler import (ModelFn, SamplingDefaults, check_steps, input_device, model_dtype,
                                       simple_ks, with_zero)

FLUX2_SHIFT_MU = 2.02      # Flux2.sampling_settings["shift"]; ModelSamplingFlux applies e^shift
FLUX_TABLE_SIZE = 10000    # ModelSamplingFlux keeps 10000 sigmas for t = 1/10000 ... 1
FLUX2_TEXT_TOKENS = 512    # ComfyUI's FLUX.2 model pads the text context to this many tokens
FLUX2_SCHEDULES = ("flux2", "simple")

# Distilled klein: 4 steps, guidance 1 (no negative pass). klein base: about 50 steps with real CFG ~4.
# FLUX.2 dev: guidance-distilled: its guidance embedding takes the scale (BFL's default 4; ComfyUI's
# FluxGuidance node feeds it, 3.5 when no such node is present) and CFG stays 1.
SAMPLING_DEFAULTS: dict[str, SamplingDefaults] = {
    "flux2-klein": SamplingDefaults(steps=4, cfg=1.0),
    "flux2-klein-base": SamplingDefaults(steps=50, cfg=4.0),
    "flux2-dev": SamplingDefaults(steps=50, cfg=1.0, guidance=4.0),
}


def flux_time_shift(t: torch.Tensor, mu: float) -> torch.Tensor:
    """sigma = e^mu / (e^mu + (1/t - 1)); t = 1 -> 1, t = 0 -> 0. Same rounding as ComfyUI's."""
    e = math.exp(mu)
    return e / (e + (1.0 / t - 1.0))


def flux2_sigmas(steps: int, image_seq_len: int | None = None, *, mu: float | None = None,
                 schedule: str = "flux2") -> torch.Tensor:
    """``steps + 1`` float32 sigmas from 1 down to 0 for FLUX.2 (the first can be 1 - 2^-24,
    as in ComfyUI: e^mu * (1 / e^mu) rounded in float32).

    schedule="flux2" (ComfyUI's ``Flux2Scheduler``): t evenly spaced from 1 to 0, shifted by
    mu = flux2_mu(image_seq_len, steps) unless ``mu`` is given. ``image_seq_len`` is the number of
    image tokens, (height // 16) * (width // 16) of the image = h * w of the 128-channel latent.

    schedule="simple" (ComfyUI's KSampler, scheduler "simple", on the model's ModelSamplingFlux):
    the model's fixed log-shift mu (default 2.02), whatever the resolution; ``image_seq_len`` is
    not used.
    """
    check_steps(steps)
    if schedule == "flux2":
        if mu is None:
            if image_seq_len is None:
                raise ValueError("flux2_sigmas(schedule='flux2') needs image_seq_len (or mu)")
            mu = flux2_mu(int(image_seq_len), steps)
        t = torch.linspace(1, 0, steps + 1, dtype=torch.float32)
        return flux_time_shift(t, mu)
    if schedule == "simple":
        mu = FLUX2_SHIFT_MU if mu is None else mu
        t = torch.tensor(simple_ks(steps, FLUX_TABLE_SIZE), dtype=torch.int64) / FLUX_TABLE_SIZE
        return with_zero(flux_time_shift(t, mu))
    raise ValueError(f"unknown FLUX.2 schedule {schedule!r}; use one of {', '.join(FLUX2_SCHEDULES)}")


def pad_flux2_context(context: torch.Tensor, tokens: int = FLUX2_TEXT_TOKENS) -> torch.Tensor:
    """Zero tokens in front up to ``tokens``, as ComfyUI's FLUX.2 model does with shorter text
    (the padding changes the result: the zero tokens take part in attention and RoPE positions)."""
    n = context.shape[1]
    if n >= tokens:
        return context
    pad = context.new_zeros(context.shape[0], tokens - n, *context.shape[2:])
    return torch.cat([pad, context], dim=1)


def flux2_model_fn(model: torch.nn.Module, guidance: float | None = None, *,
                   schedule: str = "flux2", mu: float | None = None,
                   dtype: torch.dtype | None = None, device=None,
                   pad_context_to: int | None = FLUX2_TEXT_TOKENS) -> ModelFn:
    """Wrap ComfyUI's FLUX.2 ``Flux`` module (placed or not) as a sampler model function.

    timestep = sigma in float32 (ComfyUI passes ``model_sampling.timestep(sigma).float()``);
    x and context in the model's dtype on the device of ``img_in``; ``transformer_options={}``.
    ``guidance`` feeds the guidance embedder of models that have one (dev; default
    SAMPLING_DEFAULTS['flux2-dev'].guidance); klein has none and ignores it, as ComfyUI does.
    ``schedule`` / ``mu`` choose the default sigmas (see ``flux2_sigmas``).
    """
    if schedule not in FLUX2_SCHEDULES:
        raise ValueError(f"unknown FLUX.2 schedule {schedule!r}; use one of {', '.join(FLUX2_SCHEDULES)}")
    mdtype = model_dtype(model, dtype)
    params = getattr(model, "params", None)
    has_guidance = bool(getattr(params, "guidance_embed", False))
    g = None
    if has_guidance:
        g = SAMPLING_DEFAULTS["flux2-dev"].guidance if guidance is None else float(guidance)
    entry = getattr(model, "img_in", model)

    def call(x, sigma, context):
        dev = input_device(entry, device)
        b = x.shape[0]
        ctx = context if pad_context_to is None else pad_flux2_context(context, pad_context_to)
        kwargs = {}
        if g is not None:
            kwargs["guidance"] = torch.full((b,), g, dtype=mdtype, device=dev)
        out = model(x.to(dev, mdtype), sigma.reshape(b).float().to(dev),
                    context=ctx.to(dev, mdtype), transformer_options={}, **kwargs)
        return out.to(x.device, x.dtype)

    def sigmas_for(steps, latent):
        return flux2_sigmas(steps, latent.shape[-2] * latent.shape[-1], mu=mu, schedule=schedule)

    return ModelFn(call, sigmas_for)

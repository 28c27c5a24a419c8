"""Sampling previews on the (placed) training model, the way ComfyUI samples FLUX.2 and Wan 2.1.

Both families are rectified-flow models: x_sigma = (1 - sigma) x0 + sigma noise, and the network
predicts the velocity v = noise - x0 (ComfyUI's CONST model sampling: denoised = x - sigma v).
Sampling walks a decreasing list of sigmas from 1 to 0 with Euler steps

    x <- x + (sigma_next - sigma) * v(x, sigma)

which is ComfyUI's ``euler`` sampler (k-diffusion's Euler: d = (x - denoised) / sigma = v).
With classifier-free guidance, v = v_neg + cfg (v_pos - v_neg); ComfyUI forms the same mix on the
denoised predictions, which is the same thing because both share x and sigma. At cfg == 1 the
negative pass is skipped, as ComfyUI does.

Where the sigmas come from (float32, as ComfyUI hands them to its samplers):

* Wan 2.1 (``wan_sigmas``): ComfyUI's ``ModelSamplingDiscreteFlow`` with the model's shift
  (``WAN21_T2V.sampling_settings['shift'] = 8.0``) and multiplier 1000, read by the ``simple``
  scheduler. The model takes ``timestep = 1000 sigma``.
* FLUX.2 (``flux2_sigmas``), two ComfyUI routes:
  - ``schedule="flux2"`` (default): ComfyUI's FLUX.2 scheduler node ``Flux2Scheduler``
    (comfy_extras/nodes_flux.py; BFL's reference schedule): ``steps + 1`` evenly spaced t from 1
    to 0, each moved by FLUX.2's resolution- and step-dependent log-shift mu
    (``ugpum.diffusion.flow.flux2_mu``, the same empirical fit);
  - ``schedule="simple"``: the plain KSampler with scheduler ``simple`` on the model's own
    ``ModelSamplingFlux`` (``Flux2.sampling_settings['shift'] = 2.02``, a log-shift: the factor
    is e^2.02 ~ 7.5, independent of resolution).
  The model takes ``timestep = sigma`` (it multiplies by 1000 inside its time embedding).

ComfyUI evaluates its schedules in float32; this module does the same arithmetic, and
tests/test_sampler.py checks that the sigmas are the very float32 values ComfyUI uses (bit for bit,
over 1..100 steps and a grid of FLUX.2 resolutions).

The FLUX.2 time shift, written as ComfyUI and BFL write it, is
sigma = e^mu / (e^mu + (1/t - 1)), i.e. the flow shift s t / (1 + (s - 1) t) with s = e^mu.

Usage on a ComfyUI model (``comfy.ldm.flux.model.Flux`` / ``comfy.ldm.wan.model.WanModel``)::

    fn = flux2_model_fn(dit)                       # klein: no guidance embedder
    noise = comfy_noise((1, 128, 64, 64), seed=42)  # 1024x1024, same noise as ComfyUI's seed 42
    latent = sample(fn, noise, positive=ctx, steps=4, cfg=1.0)        # distilled klein
    latent = sample(fn, noise, positive=ctx, negative=neg, steps=50, cfg=4.0)  # klein base

The result is the model-space latent, i.e. what ComfyUI's sampler holds before
``latent_format.process_out``: identity for FLUX.2, Wan 2.1's per-channel mean/std for Wan. Apply
that before handing it to a VAE decode the way ComfyUI's KSampler does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .flow import flux2_mu, shift_timesteps

# ComfyUI's sampling settings for the two families (comfy/supported_models.py)
FLUX2_SHIFT_MU = 2.02      # Flux2.sampling_settings["shift"]; ModelSamplingFlux applies e^shift
WAN21_SHIFT = 8.0          # WAN21_T2V.sampling_settings["shift"]; ModelSamplingDiscreteFlow
WAN21_MULTIPLIER = 1000    # default multiplier: Wan's timestep = 1000 * sigma
FLUX_TABLE_SIZE = 10000    # ModelSamplingFlux keeps 10000 sigmas for t = 1/10000 ... 1
FLOW_TABLE_SIZE = 1000     # ModelSamplingDiscreteFlow keeps 1000
FLUX2_TEXT_TOKENS = 512    # ComfyUI's FLUX.2 model pads the text context to this many tokens

FLUX2_SCHEDULES = ("flux2", "simple")


@dataclass(frozen=True)
class SamplingDefaults:
    steps: int
    cfg: float
    guidance: float | None = None   # FLUX.2 dev's distilled-guidance input (not CFG)


# Per model kind. Distilled klein: 4 steps, guidance 1 (no negative pass). klein base: about 50
# steps with real CFG ~4. FLUX.2 dev: guidance-distilled: its guidance embedding takes the scale
# (BFL's default 4; ComfyUI's FluxGuidance node feeds it, 3.5 when no such node is present) and
# CFG stays 1. Wan 2.1: CFG with a negative prompt; the shift is the model's 8.0.
SAMPLING_DEFAULTS: dict[str, SamplingDefaults] = {
    "flux2-klein": SamplingDefaults(steps=4, cfg=1.0),
    "flux2-klein-base": SamplingDefaults(steps=50, cfg=4.0),
    "flux2-dev": SamplingDefaults(steps=50, cfg=1.0, guidance=4.0),
    "wan2.1": SamplingDefaults(steps=30, cfg=6.0),
}


# --------------------------------------------------------------------------- schedules


def flux_time_shift(t: torch.Tensor, mu: float) -> torch.Tensor:
    """sigma = e^mu / (e^mu + (1/t - 1)); t = 1 -> 1, t = 0 -> 0. Same rounding as ComfyUI's."""
    e = math.exp(mu)
    return e / (e + (1.0 / t - 1.0))


def _simple_ks(steps: int, table_size: int) -> list[int]:
    """ComfyUI's ``simple`` scheduler reads ``steps`` entries of a sigma table that holds the
    sigmas of t = k / table_size, k = 1..table_size, starting at the top and striding by
    table_size / steps (float stride, floored index, exactly as ComfyUI indexes). Returns the k."""
    stride = table_size / steps
    return [table_size - int(i * stride) for i in range(steps)]


def _check_steps(steps: int) -> None:
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")


def _with_zero(sigmas: torch.Tensor) -> torch.Tensor:
    return torch.cat([sigmas.to(torch.float32), torch.zeros(1, dtype=torch.float32)])


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
    _check_steps(steps)
    if schedule == "flux2":
        if mu is None:
            if image_seq_len is None:
                raise ValueError("flux2_sigmas(schedule='flux2') needs image_seq_len (or mu)")
            mu = flux2_mu(int(image_seq_len), steps)
        t = torch.linspace(1, 0, steps + 1, dtype=torch.float32)
        return flux_time_shift(t, mu)
    if schedule == "simple":
        mu = FLUX2_SHIFT_MU if mu is None else mu
        t = torch.tensor(_simple_ks(steps, FLUX_TABLE_SIZE), dtype=torch.int64) / FLUX_TABLE_SIZE
        return _with_zero(flux_time_shift(t, mu))
    raise ValueError(f"unknown FLUX.2 schedule {schedule!r}; use one of {', '.join(FLUX2_SCHEDULES)}")


def wan_sigmas(steps: int, shift: float = WAN21_SHIFT) -> torch.Tensor:
    """``steps + 1`` float32 sigmas from 1 down to 0 for Wan 2.1: the ``simple`` scheduler on
    ComfyUI's ModelSamplingDiscreteFlow (1000 entries, flow shift ``shift``, multiplier 1000)."""
    _check_steps(steps)
    # (ComfyUI stores these as timesteps 1000 t and divides by 1000 again; in float32 that round
    # trip returns every k / 1000 unchanged: tests/test_sampler.py compares with ComfyUI's table.)
    t = torch.tensor(_simple_ks(steps, FLOW_TABLE_SIZE), dtype=torch.int64) / FLOW_TABLE_SIZE
    sigmas = t if shift == 1.0 else shift_timesteps(t, shift)
    return _with_zero(sigmas)


# --------------------------------------------------------------------------- model wrappers


class ModelFn:
    """``fn(x, sigma, context) -> velocity`` plus what the family needs for its default schedule.

    ``x``: the latent in the sampler's dtype; ``sigma``: one sigma per sample, shape [B];
    ``context``: the text-encoder output for this pass. The call converts sigma to the model's
    timestep convention, casts inputs to the model's dtype and device and the output back.
    """

    def __init__(self, kind: str, call: Callable, sigmas_for: Callable[[int, torch.Tensor], torch.Tensor]):
        self.kind = kind
        self._call = call
        self._sigmas_for = sigmas_for

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self._call(x, sigma, context)

    def sigmas(self, steps: int, latent: torch.Tensor) -> torch.Tensor:
        """The family's default sigmas for ``steps`` steps on a latent shaped like ``latent``."""
        return self._sigmas_for(steps, latent)


_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _model_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the model's inputs are cast to (ComfyUI: the model dtype, or its manual-cast
    dtype when the weights are stored in fp8). Stored fp8 falls back to bfloat16."""
    if dtype is not None:
        return dtype
    d = getattr(model, "dtype", None)   # ComfyUI's Flux / WanModel record their weight dtype
    if not isinstance(d, torch.dtype):
        d = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return d if d in _COMPUTE_DTYPES else torch.bfloat16


def _input_device(module: torch.nn.Module, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


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
    mdtype = _model_dtype(model, dtype)
    params = getattr(model, "params", None)
    has_guidance = bool(getattr(params, "guidance_embed", False))
    g = None
    if has_guidance:
        g = SAMPLING_DEFAULTS["flux2-dev"].guidance if guidance is None else float(guidance)
    entry = getattr(model, "img_in", model)

    def call(x, sigma, context):
        dev = _input_device(entry, device)
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

    return ModelFn("flux2", call, sigmas_for)


def wan_model_fn(model: torch.nn.Module, *, shift: float = WAN21_SHIFT,
                 dtype: torch.dtype | None = None, device=None) -> ModelFn:
    """Wrap ComfyUI's ``WanModel`` (Wan 2.1, placed or not) as a sampler model function.

    timestep = 1000 sigma in float32 (ModelSamplingDiscreteFlow.timestep, then ``.float()``);
    x [B, 16, T, H, W] and context in the model's dtype on the device of ``patch_embedding``;
    ``transformer_options={}``. ``shift`` chooses the default sigmas (see ``wan_sigmas``).
    """
    mdtype = _model_dtype(model, dtype)
    entry = getattr(model, "patch_embedding", model)

    def call(x, sigma, context):
        dev = _input_device(entry, device)
        b = x.shape[0]
        timestep = (sigma.reshape(b) * WAN21_MULTIPLIER).float()
        out = model(x.to(dev, mdtype), timestep.to(dev), context=context.to(dev, mdtype),
                    transformer_options={})
        return out.to(x.device, x.dtype)

    return ModelFn("wan", call, lambda steps, latent: wan_sigmas(steps, shift))


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

    model_fn: ``(x, sigma[B], context) -> velocity``; ``flux2_model_fn`` / ``wan_model_fn`` build
    one and also supply the default sigmas. sigmas: decreasing, usually 1 ... 0 (``flux2_sigmas``,
    ``wan_sigmas``); when omitted, ``model_fn.sigmas(steps, noise)``. cfg: guidance scale;
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
            raise ValueError("this model_fn has no default schedule: pass sigmas "
                             "(flux2_sigmas / wan_sigmas) or use flux2_model_fn / wan_model_fn")
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

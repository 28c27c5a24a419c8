"""How ComfyUI samples Wan 2.1, for previews on the training model (`ugpum.diffusion.flow_sampler` walks
the sigmas): its sigmas, its model wrapped as the sampler's velocity function and its sampling defaults.

The sigmas are ComfyUI's ``ModelSamplingDiscreteFlow`` with the model's shift
(``WAN21_T2V.sampling_settings['shift'] = 8.0``) and multiplier 1000, read by the ``simple`` scheduler
(float32, as ComfyUI hands them to its samplers). The model takes ``timestep = 1000 sigma``; its sampled
latent is the model-space one (Wan 2.1's per-channel mean/std still applied: ComfyUI's
``latent_format.process_out`` takes it off before the VAE).
"""
from __future__ import annotations

import torch

from ...diffusion.flow import shift_timesteps
from ...diffusion.flow_sampler import (ModelFn, SamplingDefaults, check_steps, input_device, model_dtype,
                                       simple_ks, with_zero)

WAN21_SHIFT = 8.0          # WAN21_T2V.sampling_settings["shift"]; ModelSamplingDiscreteFlow
WAN21_MULTIPLIER = 1000    # default multiplier: Wan's timestep = 1000 * sigma
FLOW_TABLE_SIZE = 1000     # ModelSamplingDiscreteFlow keeps 1000
# CFG with a negative prompt; the shift is the model's 8.0
SAMPLING_DEFAULTS = SamplingDefaults(steps=30, cfg=6.0)


def wan_sigmas(steps: int, shift: float = WAN21_SHIFT) -> torch.Tensor:
    """``steps + 1`` float32 sigmas from 1 down to 0 for Wan 2.1: the ``simple`` scheduler on
    ComfyUI's ModelSamplingDiscreteFlow (1000 entries, flow shift ``shift``, multiplier 1000)."""
    check_steps(steps)
    # (ComfyUI stores these as timesteps 1000 t and divides by 1000 again; in float32 that round
    # trip returns every k / 1000 unchanged: tests/integration/test_sampler.py compares with ComfyUI's table.)
    t = torch.tensor(simple_ks(steps, FLOW_TABLE_SIZE), dtype=torch.int64) / FLOW_TABLE_SIZE
    sigmas = t if shift == 1.0 else shift_timesteps(t, shift)
    return with_zero(sigmas)


def wan_model_fn(model: torch.nn.Module, *, shift: float = WAN21_SHIFT,
                 dtype: torch.dtype | None = None, device=None) -> ModelFn:
    """Wrap ComfyUI's ``WanModel`` (Wan 2.1, placed or not) as a sampler model function.

    timestep = 1000 sigma in float32 (ModelSamplingDiscreteFlow.timestep, then ``.float()``);
    x [B, 16, T, H, W] and context in the model's dtype on the device of ``patch_embedding``;
    ``transformer_options={}``. ``shift`` chooses the default sigmas (see ``wan_sigmas``).
    """
    mdtype = model_dtype(model, dtype)
    entry = getattr(model, "patch_embedding", model)

    def call(x, sigma, context):
        dev = input_device(entry, device)
        b = x.shape[0]
        timestep = (sigma.reshape(b) * WAN21_MULTIPLIER).float()
        out = model(x.to(dev, mdtype), timestep.to(dev), context=context.to(dev, mdtype),
                    transformer_options={})
        return out.to(x.device, x.dtype)

    return ModelFn(call, lambda steps, latent: wan_sigmas(steps, shift))

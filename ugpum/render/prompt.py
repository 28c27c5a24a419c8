"""Preview images during training and in Sample Preview: ComfyUI-equivalent sampling of a prompt on
the placed model (flow_sampler.py), then decode. The model's family supplies its latent shape, its
sampling defaults and the sampler's model function (ugpum.arch.base.ArchSpec)."""
from __future__ import annotations

import torch

from ..arch.base import ArchSpec
from ..diffusion.flow_sampler import comfy_noise, sample


def guidance_for(spec: ArchSpec, setting: float | None) -> float | None:
    """The guidance-embedding input of a model that has one (FLUX.2 dev): the setting, else the
    model's default; None for models without that input (klein, Wan), whatever the setting."""
    if not spec.guidance:
        return None
    return spec.sampling_defaults().guidance if setting is None else float(setting)


@torch.no_grad()
def render(model, spec: ArchSpec, decode, positive: torch.Tensor, negative: torch.Tensor | None,
           width: int, height: int, seed: int, steps: int = 0, frames: int = 1,
           guidance: float | None = None) -> torch.Tensor:
    """The frames [T,3,H,W] in [-1,1] of one sample from `positive` ([L,C] text context): T = 1 for an
    image, `frames` for a Wan clip. `guidance`: FLUX.2 dev's guidance input (see `guidance_for`)."""
    defaults = spec.sampling_defaults()                  # the family's steps and CFG
    fn = spec.sampler_model_fn(model, guidance_for(spec, guidance))
    noise = comfy_noise(spec.latent_shape(width, height, frames), seed)
    cfg = defaults.cfg if negative is not None else 1.0
    latent = sample(fn, noise, positive[None], None if cfg == 1.0 else negative[None],
                    steps=steps or defaults.steps, cfg=cfg)
    return decode(latent)

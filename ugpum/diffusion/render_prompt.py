"""Preview images during training and in Sample Preview: ComfyUI-equivalent sampling of a prompt on
the placed model (flow_sampler.py), then decode."""
from __future__ import annotations

import torch

from ..arch.base import ArchSpec, latent_frames
from .flow_sampler import SAMPLING_DEFAULTS, SamplingDefaults, comfy_noise, flux2_model_fn, sample, wan_model_fn


def sampling_defaults(spec: ArchSpec) -> SamplingDefaults:
    if spec.family == "wan":
        return SAMPLING_DEFAULTS["wan2.1"]
    if spec.guidance:
        return SAMPLING_DEFAULTS["flux2-dev"]
    return SAMPLING_DEFAULTS["flux2-klein" if spec.distilled else "flux2-klein-base"]


def guidance_for(spec: ArchSpec, setting: float | None) -> float | None:
    """The guidance-embedding input of a model that has one (FLUX.2 dev): the setting, else the
    model's default; None for models without that input (klein, Wan), whatever the setting."""
    if not spec.guidance:
        return None
    return sampling_defaults(spec).guidance if setting is None else float(setting)


def latent_shape(spec: ArchSpec, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
    if spec.family == "wan":
        return (1, 16, latent_frames(frames), height // 8, width // 8)
    return (1, 128, height // 16, width // 16)


@torch.no_grad()
def render(model, spec: ArchSpec, decode, positive: torch.Tensor, negative: torch.Tensor | None,
           width: int, height: int, seed: int, steps: int = 0, frames: int = 1,
           guidance: float | None = None) -> torch.Tensor:
    """The frames [T,3,H,W] in [-1,1] of one sample from `positive` ([L,C] text context): T = 1 for an
    image, `frames` for a Wan clip. `guidance`: FLUX.2 dev's guidance input (see `guidance_for`)."""
    defaults = sampling_defaults(spec)
    fn = wan_model_fn(model) if spec.family == "wan" else flux2_model_fn(model, guidance_for(spec, guidance))
    noise = comfy_noise(latent_shape(spec, width, height, frames), seed)
    cfg = defaults.cfg if negative is not None else 1.0
    latent = sample(fn, noise, positive[None], None if cfg == 1.0 else negative[None],
                    steps=steps or defaults.steps, cfg=cfg)
    return decode(latent)

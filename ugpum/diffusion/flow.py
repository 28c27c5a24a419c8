"""Rectified flow: how a training sample is noised, what the model must predict, and when.

Convention (FLUX, FLUX.2, Wan): t = 0 is the clean latent, t = 1 pure noise,
x_t = (1 - t) x0 + t noise, and the model predicts the velocity dx_t/dt = noise - x0.
"""

from __future__ import annotations

import math

import torch

# by name, as TrainConfig.timesteps and the Trainer node take them (README "Timestep sampling"):
#   flux2_shift   logit-normal, shifted by exp(mu) with FLUX.1's line through (256 tokens, 0.5) and
#                 (4096 tokens, 1.15): musubi-tuner's FLUX.2 default; the FLUX.2 profiles' default
#   flux2         logit-normal, shifted by BFL's empirical FLUX.2 mu (the sampling shift; 2.02 at 1024²)
#   uniform, logit_normal (= sigmoid), shift (fixed `shift`)
TIMESTEP_METHODS = ("flux2_shift", "flux2", "uniform", "logit_normal", "sigmoid", "shift")


def timestep_method(setting: str, usual: str) -> str:
    """The method a run uses: the setting, or for "auto" (the default setting) `usual`, the model
    family's usual choice (ArchSpec.default_timesteps; Wan: shift 3.0, as musubi-tuner trains Wan)."""
    return usual if setting == "auto" else setting


LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")


def _per_sample(t: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """t as a tensor shaped [B, 1, 1, ...] (or a scalar) so it broadcasts over `like`."""
    t = torch.as_tensor(t, dtype=like.dtype, device=like.device)
    if t.ndim == 0:
        return t
    if t.ndim != 1 or t.shape[0] != like.shape[0]:
        raise ValueError(f"t must be a scalar or one value per sample ({like.shape[0]}), got shape {tuple(t.shape)}")
    return t.view(-1, *([1] * (like.ndim - 1)))


def noisy(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """x_t = (1 - t) * x0 + t * noise, with one t per sample."""
    t = _per_sample(t, x0)
    return (1 - t) * x0 + t * noise


def target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity the model learns to predict: d x_t / d t = noise - x0."""
    return noise - x0


# ---------------------------------------------------------------- timestep shift


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """t' = shift * t / (1 + (shift - 1) * t): shift > 1 moves samples towards noise.

    This equals the "time SNR shift" exp(mu) / (exp(mu) + (1/t - 1)) with shift = exp(mu),
    the form BFL's and ComfyUI's FLUX code write it in.
    """
    if shift <= 0:
        raise ValueError(f"timestep shift must be > 0, got {shift}")
    return shift * t / (1 + (shift - 1) * t)


def flux2_image_seq_len(height: int, width: int) -> int:
    """Image tokens FLUX.2 sees for a height x width pixel image (VAE 8x, then 2x2 patches)."""
    return (height // 16) * (width // 16)


def flux2_mu(image_seq_len: int, num_steps: int = 50) -> float:
    """FLUX.2's resolution-dependent log-shift mu.

    Source: Black Forest Labs' reference code, black-forest-labs/flux2,
    src/flux2/sampling.py, `compute_empirical_mu(image_seq_len, num_steps)`, used by its
    `get_schedule`. Two empirical lines in the sequence length, fitted for 10 and 200
    sampling steps; between them mu is interpolated linearly in the step count, and past
    4300 tokens only the 200-step line is used. At 1024x1024 (4096 tokens) and 50 steps
    mu = 2.02, the value ComfyUI uses as FLUX.2's default sampling "shift" (ComfyUI's FLUX
    model sampling takes mu there and applies exp(mu) itself).

    Training has no step count; `num_steps` should be the steps the LoRA will be sampled
    with (about 50 for the base models we train on).
    """
    if image_seq_len < 1 or num_steps < 1:
        raise ValueError(f"image_seq_len and num_steps must be >= 1, got {image_seq_len}, {num_steps}")
    mu_at_200_steps = 1.6927e-4 * image_seq_len + 0.45666666
    if image_seq_len > 4300:
        return mu_at_200_steps
    mu_at_10_steps = 8.73809524e-5 * image_seq_len + 1.89833333
    slope_per_step = (mu_at_200_steps - mu_at_10_steps) / 190.0
    return mu_at_200_steps + slope_per_step * (num_steps - 200)


def musubi_flux2_mu(image_seq_len: int) -> float:
    """musubi-tuner's FLUX.2 training log-shift (its `flux2_shift` timestep sampling): FLUX.1's
    resolution line, 0.5 at 256 image tokens and 1.15 at 4096 (1024²), in the bucket's tokens.
    Source: kohya-ss/musubi-tuner, the FLUX.2 trainer's `flux2_shift` branch, with FLUX.1's
    `get_lin_function` defaults (x1=256, y1=0.5, x2=4096, y2=1.15)."""
    if image_seq_len < 1:
        raise ValueError(f"image_seq_len must be >= 1, got {image_seq_len}")
    return 0.5 + (1.15 - 0.5) * (image_seq_len - 256) / (4096 - 256)


def flux2_shift(image_seq_len: int, num_steps: int = 50) -> float:
    """The FLUX.2 shift factor for `shift_timesteps`: exp(flux2_mu(...))."""
    return math.exp(flux2_mu(image_seq_len, num_steps))


# ---------------------------------------------------------------- timestep sampling


def _base_timesteps(n, base, generator, device, logit_mean, logit_std) -> torch.Tensor:
    if base == "uniform":
        return torch.rand(n, generator=generator, device=device)
    if base == "logit_normal":
        # SD3 paper (Esser et al. 2024): sigmoid of a normal puts more samples mid-way.
        normal = torch.randn(n, generator=generator, device=device)
        return torch.sigmoid(normal * logit_std + logit_mean)
    raise ValueError(f"unknown base timestep distribution {base!r}; use 'uniform' or 'logit_normal'")


def sample_timesteps(
    n: int,
    method: str = "logit_normal",
    generator: torch.Generator | None = None,
    *,
    shift: float = 3.0,
    image_seq_len: int | None = None,
    num_steps: int = 50,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    base: str = "logit_normal",
) -> torch.Tensor:
    """n training timesteps in [0, 1] (float32, on the generator's device or CPU).

    - "uniform": t ~ U[0, 1).
    - "logit_normal" (or "sigmoid", musubi-tuner's name): t = sigmoid(N(logit_mean, logit_std)).
    - "flux2_shift": a `base` sample moved by exp(musubi_flux2_mu(image_seq_len)).
    - "shift": a `base` sample ("logit_normal" or "uniform") moved by `shift`.
    - "flux2": the same with FLUX.2's shift for `image_seq_len` tokens (see flux2_mu).
    """
    if n < 1:
        raise ValueError(f"number of timesteps must be >= 1, got {n}")
    device = generator.device if generator is not None else None
    if method == "uniform":
        return torch.rand(n, generator=generator, device=device)
    if method in ("logit_normal", "sigmoid"):
        return _base_timesteps(n, "logit_normal", generator, device, logit_mean, logit_std)
    if method == "shift":
        t = _base_timesteps(n, base, generator, device, logit_mean, logit_std)
        return shift_timesteps(t, shift)
    if method in ("flux2", "flux2_shift") and image_seq_len is None:
        raise ValueError(f"timestep method {method!r} needs image_seq_len (the bucket's image tokens)")
    if method == "flux2_shift":
        t = _base_timesteps(n, base, generator, device, logit_mean, logit_std)
        return shift_timesteps(t, math.exp(musubi_flux2_mu(image_seq_len)))
    if method == "flux2":
        if image_seq_len is None:
            raise ValueError("timestep method 'flux2' needs image_seq_len (see flux2_image_seq_len)")
        t = _base_timesteps(n, base, generator, device, logit_mean, logit_std)
        return shift_timesteps(t, flux2_shift(image_seq_len, num_steps))
    raise ValueError(f"unknown timestep method {method!r}; use one of {', '.join(TIMESTEP_METHODS)}")


# ---------------------------------------------------------------- loss


def loss_weight(t: torch.Tensor, scheme: str = "none") -> torch.Tensor:
    """Per-sample loss weight for timesteps t (sigma = t in rectified flow).

    - "none": 1 everywhere (FLUX and most LoRA trainers).
    - "sigma_sqrt": 1 / sigma^2, the SD3 paper's / diffusers' "sigma_sqrt" option; it
      stresses low-noise detail. sigma is clamped at 0.05 (weight <= 400) so a t near 0
      cannot blow up the loss.
    - "cosmap": 2 / (pi * (1 - 2t + 2t^2)), the SD3 paper's cosine-mapped weighting;
      bounded between 2/pi and 4/pi, heaviest mid-way.
    """
    if scheme == "none":
        return torch.ones_like(t)
    if scheme == "sigma_sqrt":
        return t.clamp(min=0.05) ** -2
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * t + 2 * t * t))
    raise ValueError(f"unknown loss weighting {scheme!r}; use one of {', '.join(LOSS_WEIGHTINGS)}")


def flow_loss(
    pred: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    t: torch.Tensor,
    weighting: str = "none",
) -> torch.Tensor:
    """Scalar MSE between the predicted and true velocity, weighted per sample, in float32."""
    if pred.shape != x0.shape or noise.shape != x0.shape:
        raise ValueError(
            f"pred {tuple(pred.shape)}, x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must have one shape"
        )
    error = (pred.float() - target(x0.float(), noise.float())) ** 2
    per_sample = error.reshape(error.shape[0], -1).mean(dim=1)
    weights = loss_weight(torch.as_tensor(t, device=pred.device).float().expand(per_sample.shape), weighting)
    return (weights * per_sample).mean()

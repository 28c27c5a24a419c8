"""What a step minimises: the flow-matching loss of ComfyUI's model on one micro-batch, and the
validation loss (fixed noise at fixed timesteps) that shows progress. Both engines draw the same
inputs from here: the single process feeds the whole model, a pipeline feeds its stages."""
from __future__ import annotations

import torch

from ..arch.attention import training_options
from ..diffusion.flow import flow_loss, noisy, sample_timesteps, timestep_method
from ..compute.dtypes import bf16_autocast

TRAINING_GUIDANCE = 1.0     # guidance-distilled models train at 1.0, as musubi-tuner trains them
VALIDATION_T = (0.25, 0.5, 0.75)


def model_context(spec, context: torch.Tensor) -> torch.Tensor:
    """[1, L, C] text context as ComfyUI feeds it (the family's: FLUX.2 pads it to 512 tokens, zeros in front)."""
    return spec.model_context(context)


def training_guidance(spec, setting: float | None) -> float | None:
    """The guidance-embedding input in training (models that have one): the setting, else 1.0."""
    if not spec.guidance:
        return None
    return TRAINING_GUIDANCE if setting is None else float(setting)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. From the host to a GPU through pinned memory, without waiting: a plain copy from pageable
    memory makes the host wait for the GPU to finish all it was given (six times a step before, klein 9B on an
    H100: bench/results/README.md)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def model_inputs(cfg, spec, x0, noise, t, context, device) -> dict:
    """The keyword inputs of ComfyUI's DiT (and of every pipeline stage) for samples x0 [B, ...]
    noised to timesteps t [B]: the noised latent, the scaled timestep, the text and, for models that
    have it, guidance."""
    device = torch.device(device)
    kw = {"x": to_device(noisy(x0, noise, t), device), "timestep": to_device(t * spec.timestep_scale, device),
          "context": to_device(context, device)}
    guidance = training_guidance(spec, cfg.guidance)      # FLUX.2 dev: without it ComfyUI skips the embedder
    if guidance is not None:
        kw["guidance"] = torch.full((x0.shape[0],), guidance, device=device)
    return kw


def loss_at(model, spec, cfg, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
            context: torch.Tensor, first: str, weighting: str) -> torch.Tensor:
    """The model's flow-matching loss for samples x0 [B, ...] noised to timesteps t [B]; `context`:
    the model's text input [B, L, C] (`model_context`); `first`: the device of the model's inputs."""
    device = torch.device(first)
    kw = model_inputs(cfg, spec, x0, noise, t, context, device)
    with bf16_autocast(cfg.autocast, cfg.weight_dtype, device):
        pred = model(kw.pop("x"), kw.pop("timestep"), kw.pop("context"), transformer_options=training_options(), **kw)
    out = pred.device
    return flow_loss(pred.float(), to_device(x0, out), to_device(noise, out), to_device(t, out), weighting)


def micro_batch_inputs(cfg, spec, latents: list[torch.Tensor], contexts: list[torch.Tensor], k: int,
                       device: torch.device | str | None = None):
    """(x0, noise, t, context) of the k-th micro-batch (latents of one shape, contexts of one length):
    noise and timesteps from a generator seeded by (seed, k), the same draws on any device or rank. With
    `device`, all four are sent there without waiting and the text is padded there: on the host, FLUX.2's pass
    over 512 padded tokens took 3-18 ms of a step (klein 9B on an H100, bench/results/README.md)."""
    g = torch.Generator().manual_seed((cfg.seed * 7_919 + k) % 2**63)
    x0 = torch.stack([latent.float() for latent in latents])
    noise = torch.randn(x0.shape, generator=g)
    t = sample_timesteps(len(latents), timestep_method(cfg.timesteps, spec.default_timesteps), g, shift=cfg.shift,
                         image_seq_len=spec.latent_tokens(latents[0].shape))   # per bucket: its own tokens
    if device is not None:
        device = torch.device(device)
        x0, noise, t = (to_device(v, device) for v in (x0, noise, t))
        contexts = [to_device(c, device) for c in contexts]
    context = torch.cat([model_context(spec, c) for c in contexts])
    return x0, noise, t, context


def micro_loss(model, spec, cfg, latents: list[torch.Tensor], contexts: list[torch.Tensor], k: int,
               first: str) -> torch.Tensor:
    """Forward of the k-th micro-batch: its flow-matching loss, the mean over its samples (the caller
    runs backward)."""
    return loss_at(model, spec, cfg, *micro_batch_inputs(cfg, spec, latents, contexts, k, first), first,
                   cfg.weighting)


class InputsAhead:
    """Micro-batches' inputs made before their turn: the host's share of a step's start (drawing the noise,
    padding the text, the copies to the GPU) done while the GPUs still run the step before, instead of after
    its one host sync, when they would wait for it. `make()`: the inputs (`micro_batch_inputs`)."""

    def __init__(self):
        self._made: dict[tuple[int, str], tuple] = {}

    def prepare(self, k: int, device, make) -> None:
        self._made = {(k, str(device)): make()}         # one micro-batch ahead at most: the next step's first

    def take(self, k: int, device, make) -> tuple:
        made = self._made.pop((k, str(device)), None)
        return made if made is not None else make()


def validation_picks(items, limit: int = 16) -> list[int]:
    """Up to `limit` distinct samples, spread evenly over the dataset: a repeated item counts once, a
    clip taken at two lengths (musubi target_frames) twice."""
    seen, distinct = set(), []
    for n, item in enumerate(items):
        key = (item.path, getattr(item, "frames", 1))
        if key not in seen:
            seen.add(key)
            distinct.append(n)
    if len(distinct) <= limit:
        return distinct
    return [distinct[round(j * (len(distinct) - 1) / (limit - 1))] for j in range(limit)]


def validation_inputs(spec, latents, contexts, picks: list[int]):
    """(x0, noise, t, context) of each validation forward, in order: every picked item (batch 1) on
    its own fixed noise, at each of VALIDATION_T."""
    for seed, i in enumerate(picks):
        g = torch.Generator().manual_seed(10_007 + seed)
        x0 = latents[i][None].float()
        noise = torch.randn(x0.shape, generator=g)
        context = model_context(spec, contexts[i])
        for t in VALIDATION_T:
            yield x0, noise, torch.tensor([t]), context


@torch.no_grad()
def validation_loss(model, spec, cfg, latents, contexts, first: str, picks: list[int]) -> float:
    """Loss on fixed noise at fixed timesteps over the picked items: a smooth measure of progress,
    unlike the training loss, whose random timesteps make it jump from step to step."""
    total, n = 0.0, 0
    for x0, noise, t, context in validation_inputs(spec, latents, contexts, picks):
        total += loss_at(model, spec, cfg, x0, noise, t, context, first, "none").item()
        n += 1
    return total / n

"""The built-in training profiles, as data: settings of `ugpum.train.config.TrainConfig` by name. The
training config starts from them, and the model catalog (`ugpum.catalog.models`) reads which model,
weights and resolution each trains, to download what it needs. Every profile of a real model names
its resolution and base weight dtype.
"""
from __future__ import annotations

PROFILES: dict[str, dict] = {
    # FLUX.2: musubi-tuner's FLUX.2 timestep default (flux2_shift: median sigma 0.76 at 1024², per bucket)
    # klein LoRAs train on the undistilled base (BFL's advice); the workflow renders with the distilled model
    "klein-9b-1024": dict(model="flux2-klein-base-9b", resolution=1024, rank=16, alpha=16.0, steps=50, lr=1e-4,
                          sample_every=10, timesteps="flux2_shift", weight_dtype="bf16"),
    "klein-4b-1024": dict(model="flux2-klein-base-4b", resolution=1024, rank=16, alpha=16.0, steps=50, lr=1e-4,
                          sample_every=10, timesteps="flux2_shift", weight_dtype="bf16"),
    # Wan 2.1 clips at 480p: resolution is the bucket's area (640² ~ 832x480, which 832x480 and 16:9
    # clips get), 17 frames (5 latent frames) from each clip's start; shift 3 as musubi-tuner trains Wan
    "wan14b-480-clip": dict(model="wan2.1-14b", resolution=640, frames=17, rank=32, alpha=32.0, steps=400,
                            lr=1e-4, sample_every=100, timesteps="shift", shift=3.0, weight_dtype="fp8"),
    "wan1.3b-480-clip": dict(model="wan2.1-1.3b", resolution=640, frames=33, rank=32, alpha=32.0, steps=400,
                             lr=2e-4, sample_every=100, timesteps="shift", shift=3.0, weight_dtype="bf16"),
    # FLUX.2 [dev] (32 B): fp8 base weights (32 GB) split over two 24 GB cards, a few blocks swapped, at 1024²;
    # bf16 (64 GB) would swap far more. The guidance-distilled model trains at guidance 1.0, as
    # musubi-tuner trains such models (a LoRA learns the data, not the distilled CFG direction), and
    # previews sample at 4.0 (BFL's default, black-forest-labs/flux2 scripts/cli.py; ComfyUI's FLUX.2
    # template's FluxGuidance). lr 1e-4 and rank 16-32 are what dev LoRAs are commonly trained with.
    "flux2-dev-1024": dict(model="flux2-dev", resolution=1024, rank=16, alpha=16.0, steps=500, lr=1e-4,
                           sample_every=100, sample_steps=20, timesteps="flux2_shift", weight_dtype="fp8",
                           guidance=1.0, sample_guidance=4.0),
    # tiny random-weight models: the same code paths in seconds on a CPU (tests, demo without weights)
    "tiny-flux2": dict(model="tiny-flux2", resolution=64, rank=4, alpha=4.0, steps=50, lr=1e-2,
                       sample_every=25, timesteps="logit_normal", weight_dtype="fp32", autocast=False,
                       stand_in_encoders=True),
    "tiny-wan": dict(model="tiny-wan", resolution=64, rank=4, alpha=4.0, steps=50, lr=1e-2,
                     sample_every=25, timesteps="logit_normal", weight_dtype="fp32", autocast=False,
                     stand_in_encoders=True),
    "tiny-wan-clip": dict(model="tiny-wan", resolution=64, frames=5, rank=4, alpha=4.0, steps=50, lr=1e-2,
                          sample_every=25, timesteps="logit_normal", weight_dtype="fp32", autocast=False,
                          stand_in_encoders=True),
}

"""What the generic code asks of a FLUX.2 model (ArchSpec's family members): its tokens, FLOPs and
shared inputs for the cost model, its latent and text context, its sampler and its pipeline stage."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..base import ArchSpec, BlockSpec, Workload
from .sampler import SAMPLING_DEFAULTS, flux2_model_fn, pad_flux2_context
from .stage import Flux2Stage

TIME_DIM = 256                     # the timestep (and guidance) embedders' sinusoidal input
MODULATIONS = 6 + 6 + 3            # rows of the shared modulation: double img, double txt, single


@dataclass(frozen=True)
class Flux2Spec(ArchSpec):
    takes_clips: ClassVar[bool] = False
    default_timesteps: ClassVar[str] = "flux2_shift"         # musubi-tuner's FLUX.2 default
    latent_channels: ClassVar[int] = 128                     # the VAE's 32 channels, 2x2 patchified
    latent_factor: ClassVar[int] = 16
    frames_per_latent: ClassVar[int] = 1                     # (images)
    frame_rate: ClassVar[int] = 0
    stage_class: ClassVar[type] = Flux2Stage

    def frames_error(self, frames: int) -> str:
        return "" if frames == 1 else f"{self.id} trains on images (frames 1); video frames need a Wan 2.1 model"

    # --- shapes of one step -------------------------------------------------------------------
    def image_tokens(self, w: Workload) -> int:
        return (w.height // 16) * (w.width // 16)            # 16x after 2x2 patchify

    def stream_tokens(self, w: Workload) -> int:
        return self.image_tokens(w) + w.text_tokens          # image and text travel as one stream

    def shared_input_bytes(self, w: Workload) -> int:
        rope = w.batch * self.stream_tokens(w) * self.head_dim * 2 * 4      # cos/sin tables in fp32
        modulation = w.batch * MODULATIONS * self.hidden * 4                # fp32
        return rope + modulation

    def dense_flops(self, block: BlockSpec, w: Workload) -> float:
        t = self.image_tokens(w) + w.text_tokens
        return 2 * block.params * t / (2 if block.kind == "double" else 1)  # a double block: half per stream

    def attention_flops(self, w: Workload) -> int:
        t = self.image_tokens(w) + w.text_tokens
        return 4 * t * t * self.hidden

    def every_stage_params(self) -> int:
        h = self.hidden
        embed = TIME_DIM * h + h * h                         # time_in (and guidance_in): MLP embedders
        return embed + MODULATIONS * h * h + (embed if self.guidance else 0)

    # --- the model's inputs and outputs -------------------------------------------------------
    def latent_tokens(self, latent_shape: tuple[int, ...]) -> int:
        return latent_shape[-2] * latent_shape[-1]           # [C, h, w], one token per latent pixel

    def model_context(self, context):
        return pad_flux2_context(context[None])              # ComfyUI pads to 512 tokens, zeros in front

    def sampling_defaults(self):
        if self.guidance:
            return SAMPLING_DEFAULTS["flux2-dev"]
        return SAMPLING_DEFAULTS["flux2-klein" if self.distilled else "flux2-klein-base"]

    def sampler_model_fn(self, model, guidance: float | None):
        return flux2_model_fn(model, guidance)

"""What the generic code asks of a Wan 2.1 model (ArchSpec's family members): its tokens, FLOPs and
shared inputs for the cost model, its latent (with a time axis: Wan takes clips) and text context, its
sampler and its pipeline stage."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..base import ACT_BYTES, ArchSpec, BlockSpec, Workload
from .sampler import SAMPLING_DEFAULTS, wan_model_fn
from .stage import WanStage

FREQ_DIM = 256                     # the time embedder's sinusoidal input
MODULATIONS = 6                    # rows of the shared modulation every block reads


@dataclass(frozen=True)
class WanSpec(ArchSpec):
    takes_clips: ClassVar[bool] = True
    default_timesteps: ClassVar[str] = "shift"               # shift 3.0, as musubi-tuner trains Wan
    latent_channels: ClassVar[int] = 16
    latent_factor: ClassVar[int] = 8
    frames_per_latent: ClassVar[int] = 4
    frame_rate: ClassVar[int] = 16                           # what ComfyUI's Wan templates save at, too
    stage_class: ClassVar[type] = WanStage

    def frames_error(self, frames: int) -> str:
        if frames >= 1 and (frames - 1) % self.frames_per_latent == 0:
            return ""
        return ("Wan takes 4k+1 frames (1, 5, 17, 33, 81): its VAE packs the first frame alone and every "
                "following 4 frames into one")

    # --- shapes of one step -------------------------------------------------------------------
    def image_tokens(self, w: Workload) -> int:
        return self.latent_frames(w.frames) * (w.height // 16) * (w.width // 16)  # 8x VAE, 2x2 patch

    def stream_tokens(self, w: Workload) -> int:
        return self.image_tokens(w)                          # text is a shared input, not a stream

    def shared_input_bytes(self, w: Workload) -> int:
        rope = w.batch * self.stream_tokens(w) * self.head_dim * 2 * 4      # cos/sin tables in fp32
        context = w.batch * w.text_tokens * self.hidden * ACT_BYTES          # the embedded text
        modulation = w.batch * MODULATIONS * self.hidden * 4                 # fp32
        return rope + context + modulation

    def dense_flops(self, block: BlockSpec, w: Workload) -> float:
        dense = 2 * (6 * self.hidden ** 2 + 2 * self.hidden * self.ffn) * self.image_tokens(w)
        return dense + 2 * 2 * self.hidden ** 2 * w.text_tokens     # cross-attention k, v on the text

    def attention_flops(self, w: Workload) -> int:
        img, txt = self.image_tokens(w), w.text_tokens
        return 4 * img * img * self.hidden + 4 * img * txt * self.hidden    # self- and cross-attention

    def every_stage_params(self) -> int:
        h = self.hidden
        return FREQ_DIM * h + h * h + MODULATIONS * h * h + self.context_dim * h + h * h  # time, projection, text

    # --- the model's inputs and outputs -------------------------------------------------------
    def latent_tokens(self, latent_shape: tuple[int, ...]) -> int:
        return latent_shape[-3] * (latent_shape[-2] // 2) * (latent_shape[-1] // 2)   # [C, T, h, w], 2x2 patches

    def model_context(self, context):
        return context[None]

    def sampling_defaults(self):
        return SAMPLING_DEFAULTS

    def sampler_model_fn(self, model, guidance: float | None):
        return wan_model_fn(model)                           # Wan has no guidance embedding

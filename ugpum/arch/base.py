"""What the planner and the generic code need to know about a diffusion transformer, independent of any
model code: its blocks and sizes (ArchSpec's fields, BlockSpec, LinearSpec), one training step's shape
(Workload), and what each family supplies in its own folder (ArchSpec's abstract members)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import InitVar, dataclass, field

WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
ACT_BYTES = 2  # activations run in bf16 (autocast) on the GPU


# auto: the planner chooses per block; all: every block recomputed in backward; none: every block keeps its
# activations from forward to backward
RECOMPUTE_SETTINGS = ("auto", "all", "none")


@dataclass(frozen=True)
class LinearSpec:
    """A LoRA target: a Linear inside a block, path relative to the block."""
    path: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class BlockSpec:
    path: str        # module path in ComfyUI's layout, e.g. "double_blocks.3"
    kind: str        # "double", "single" or "wan"
    params: int
    linears: tuple[LinearSpec, ...]

    def lora_params(self, rank: int) -> int:
        return sum(rank * (lin.in_features + lin.out_features) for lin in self.linears)


@dataclass(frozen=True)
class Workload:
    """One training step's shape."""
    width: int = 1024
    height: int = 1024
    frames: int = 1
    batch: int = 1
    text_tokens: int = 512
    held_dtype: str = "bf16"             # the base weights as training holds them on the GPUs: bf16 | fp8 | fp32
    #                                      (under a quantising base_compute, its mode's: fp8 for the 8-bit ones)
    loaded_dtype: str = "bf16"           # the weights as loaded (weight_dtype): what a quantising base leaves
    #                                      outside its blocks' Linears keeps it
    rank: int = 16
    compiled: bool = False               # blocks compiled (ugpum.compute.compile): fused elementwise work
    base_compute: str = "bf16"           # the frozen base's matmuls: a mode of ugpum/compute/modes/ (bf16, fp8, int8)
    # Which blocks recompute their forward in backward (per-block checkpointing): all | none | auto (the
    # planner keeps the activations of the resident blocks the memory left over holds, ugpum.planning.plan).
    recompute: str = "all"
    # The recomputed blocks' inputs wait for their backward in pinned host memory, one back on the GPU at a time:
    # the planner's last resort where the GPU cannot hold them (long video clips), ugpum.compute.recompute
    inputs_on_host: bool = False
    # The recomputed blocks keep their self-attention outputs, so their recompute skips attention (selective
    # checkpointing, ugpum.compute.recompute): the planner's choice where it is faster and fits without swapping
    attention_kept: bool = False
    checkpointing: InitVar[bool | None] = None     # the older switch: true is recompute all, false none

    def __post_init__(self, checkpointing):
        if checkpointing is not None:
            object.__setattr__(self, "recompute", "all" if checkpointing else "none")
        if self.recompute not in RECOMPUTE_SETTINGS:
            raise ValueError(f"recompute {self.recompute!r}: must be one of {', '.join(RECOMPUTE_SETTINGS)}")


@dataclass(frozen=True)
class ArchSpec(ABC):
    """One model of a family. The fields are the model's sizes; the abstract members are what its family
    supplies (ugpum/arch/<family>/spec.py, one subclass per family): the generic code (cost, objective,
    sampling, stand-in encoders, the distributed engine) calls them instead of asking which family a
    model is."""
    id: str
    family: str                  # the family's name (its folder in ugpum/arch/): "flux2", "wan", ...
    title: str                   # modelspec architecture prefix, e.g. "Flux.2-klein-9b"
    hidden: int
    heads: int
    blocks: tuple[BlockSpec, ...]
    head_params: int             # embedders etc., placed with the first stage
    tail_params: int             # final layer, placed with the last stage
    context_dim: int
    ffn: int = 0                 # Wan only
    guidance: bool = False
    distilled: bool = False      # sampling defaults: 4 steps / no CFG when distilled
    tail_modules: tuple[str, ...] = ()   # run after the blocks: placed with the last stage
    timestep_scale: float = 1.0          # ComfyUI's models take sigma (FLUX) or sigma x 1000 (Wan)
    # bytes per element of the hidden state between blocks: bf16 for FLUX.2; fp32 for Wan, whose blocks add
    # the fp32 modulation into the residual (comfy.ldm.wan.model: torch.addcmul(x, y, e), e fp32), so every
    # block after the first passes an fp32 stream (measured on an H100: 152.3 MiB at 7800 x 5120 tokens)
    stream_bytes: int = ACT_BYTES
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def params(self) -> int:
        return self.head_params + self.tail_params + sum(b.params for b in self.blocks)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def boundary_bytes(self, w: Workload) -> int:
        """Hidden state crossing one stage boundary in one direction (the gradient is as large)."""
        return w.batch * self.stream_tokens(w) * self.hidden * self.stream_bytes

    def self_attention_flops(self, w: Workload) -> int:
        """Forward FLOPs of one block's self-attention over the stream for one sample (what `attention_kept`
        spares its recompute)."""
        return 4 * self.stream_tokens(w) ** 2 * self.hidden

    def kept_attention_bytes(self, w: Workload) -> int:
        """What a recomputed block keeps of its self-attention under `attention_kept`: the output in the compute
        dtype and the softmax's log-sum-exp (fp32 per head and token), which its backward reads."""
        return w.batch * self.stream_tokens(w) * (self.hidden * ACT_BYTES + self.heads * 4)

    def block_flops(self, block: BlockSpec, w: Workload) -> float:
        """Forward FLOPs of one block: its matmuls plus attention."""
        return w.batch * (self.dense_flops(block, w) + self.attention_flops(w))

    def latent_shape(self, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        """The latent of one sample [1, C, (T,) h, w] as the DiT takes it (T for a family that takes clips)."""
        time = (self.latent_frames(frames),) if self.takes_clips else ()
        return (1, self.latent_channels, *time, height // self.latent_factor, width // self.latent_factor)

    # A video VAE of these models is causal: it encodes the first frame alone, then every
    # `frames_per_latent` frames into one latent frame (so a clip takes 1 + k x frames_per_latent frames).
    def latent_frames(self, frames: int) -> int:
        """Latent frames for `frames` frames of a clip."""
        return 1 + (frames - 1) // self.frames_per_latent

    def frames_within(self, available: int) -> int:
        """The most frames this model takes that a clip of `available` frames holds."""
        return 1 + (max(available, 1) - 1) // self.frames_per_latent * self.frames_per_latent

    # --- what the family supplies: constants ----------------------------------------------------
    # (a subclass sets each as a plain class attribute)
    @property
    @abstractmethod
    def takes_clips(self) -> bool:
        """Trains on video clips too: its latents carry a time axis [C, T, h, w] (T = 1 for an image)."""

    @property
    @abstractmethod
    def default_timesteps(self) -> str:
        """The timestep method the setting "auto" means (one of ugpum.diffusion.flow.TIMESTEP_METHODS)."""

    @property
    @abstractmethod
    def latent_channels(self) -> int:
        """Channels of the latent the DiT takes (after the VAE, and any patchifying the model expects)."""

    @property
    @abstractmethod
    def latent_factor(self) -> int:
        """Pixels per latent pixel along each side."""

    @property
    @abstractmethod
    def frames_per_latent(self) -> int:
        """Clip frames its VAE packs into one latent frame after the first (1 for a family of images)."""

    @property
    @abstractmethod
    def frame_rate(self) -> int:
        """Frames per second its clips are trained and previews saved at (0 for a family of images)."""

    @property
    @abstractmethod
    def stage_class(self) -> type:
        """The pipeline stage module of this family (a ugpum.arch.stage.Stage) for the distributed engine."""

    # --- what the family supplies: shapes and sizes of one step ---------------------------------
    @abstractmethod
    def frames_error(self, frames: int) -> str:
        """Why `frames` per sample cannot be trained on this model ('' when it can)."""

    @abstractmethod
    def image_tokens(self, w: Workload) -> int:
        """Image tokens of one sample."""

    @abstractmethod
    def stream_tokens(self, w: Workload) -> int:
        """Tokens carried by the hidden state that crosses a block boundary."""

    @abstractmethod
    def shared_input_bytes(self, w: Workload) -> int:
        """Per-step inputs every block reads, copied once to each device (not per block)."""

    @abstractmethod
    def dense_flops(self, block: BlockSpec, w: Workload) -> float:
        """Forward FLOPs of one block's matmuls for one sample."""

    @abstractmethod
    def attention_flops(self, w: Workload) -> int:
        """Forward FLOPs of one block's attention for one sample (the cost model times it apart)."""

    @abstractmethod
    def every_stage_params(self) -> int:
        """Parameters each pipeline stage after the first also holds: the small embedders its stage
        module recomputes the timestep's modulation (and any shared text input) with."""

    # --- what the family supplies: the model's inputs and outputs -------------------------------
    @abstractmethod
    def latent_tokens(self, latent_shape: tuple[int, ...]) -> int:
        """Image tokens of one cached latent (its shape without the batch axis)."""

    @abstractmethod
    def model_context(self, context):
        """A caption's text context [L, C] as the model takes it: [1, L', C]."""

    @abstractmethod
    def sampling_defaults(self):
        """Steps, CFG and guidance a preview samples with (a ugpum.diffusion.flow_sampler.SamplingDefaults)."""

    @abstractmethod
    def sampler_model_fn(self, model, guidance: float | None):
        """ComfyUI's model wrapped for the sampler (a ugpum.diffusion.flow_sampler.ModelFn); `guidance`:
        the guidance-embedding input of a model that has one, else None."""

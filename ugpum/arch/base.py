"""What the planner needs to know about a diffusion transformer, independent of any model code."""
from __future__ import annotations

from dataclasses import InitVar, dataclass, field

WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
ACT_BYTES = 2  # activations run in bf16 (autocast) on the GPU


# auto: the planner chooses per block; all: every block recomputed in backward; none: every block keeps its
# activations from forward to backward
RECOMPUTE_SETTINGS = ("auto", "all", "none")

WAN_FPS = 16        # Wan 2.1's frame rate: what it was trained on, what ComfyUI's Wan templates save at


def latent_frames(frames: int) -> int:
    """Frames of the Wan VAE latent for `frames` video frames: the first alone, then 4 per latent frame."""
    return 1 + (frames - 1) // 4


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
    #                                      (fp8 under an 8-bit base_compute, whatever the weight_dtype setting)
    rank: int = 16
    compiled: bool = False               # blocks compiled (ugpum.compile): fused elementwise work
    base_compute: str = "bf16"           # the frozen base's matmuls: bf16 | fp8 | int8 (ugpum.base_compute)
    # Which blocks recompute their forward in backward (per-block checkpointing): all | none | auto (the
    # planner keeps the activations of the resident blocks the memory left over holds, ugpum.plan).
    recompute: str = "all"
    checkpointing: InitVar[bool | None] = None     # the older switch: true is recompute all, false none

    def __post_init__(self, checkpointing):
        if checkpointing is not None:
            object.__setattr__(self, "recompute", "all" if checkpointing else "none")
        if self.recompute not in RECOMPUTE_SETTINGS:
            raise ValueError(f"recompute {self.recompute!r}: must be one of {', '.join(RECOMPUTE_SETTINGS)}")


@dataclass(frozen=True)
class ArchSpec:
    id: str
    family: str                  # "flux2" or "wan"
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

    def frames_error(self, frames: int) -> str:
        """Why `frames` per sample cannot be trained on this model ('' when it can)."""
        if self.family != "wan":
            return "" if frames == 1 else f"{self.id} trains on images (frames 1); video frames need a Wan 2.1 model"
        # Wan's VAE encodes the first frame alone and every next 4 into one latent frame
        return "" if frames >= 1 and (frames - 1) % 4 == 0 else "Wan takes 4k+1 frames (1, 5, 17, 33, 81)"

    # --- shapes of one step -------------------------------------------------------------------
    def image_tokens(self, w: Workload) -> int:
        if self.family == "wan":
            return latent_frames(w.frames) * (w.height // 16) * (w.width // 16)  # 8x VAE, 2x2 patch
        return (w.height // 16) * (w.width // 16)            # FLUX.2: 16x after 2x2 patchify

    def stream_tokens(self, w: Workload) -> int:
        """Tokens carried by the hidden state that crosses a block boundary."""
        if self.family == "wan":
            return self.image_tokens(w)                      # text is a shared input, not a stream
        return self.image_tokens(w) + w.text_tokens

    def boundary_bytes(self, w: Workload) -> int:
        """Hidden state crossing one stage boundary in one direction (the gradient is as large)."""
        return w.batch * self.stream_tokens(w) * self.hidden * self.stream_bytes

    def shared_input_bytes(self, w: Workload) -> int:
        """Per-step inputs every block reads, copied once to each device (not per block)."""
        t = self.stream_tokens(w)
        rope = w.batch * t * self.head_dim * 2 * 4           # cos/sin tables in fp32
        if self.family == "wan":
            context = w.batch * w.text_tokens * self.hidden * ACT_BYTES
            modulation = w.batch * 6 * self.hidden * 4
            return rope + context + modulation
        modulation = w.batch * (6 + 6 + 3) * self.hidden * 4  # double img/txt + single, fp32
        return rope + modulation

    def block_flops(self, block: BlockSpec, w: Workload) -> float:
        """Forward FLOPs of one block: its matmuls plus attention."""
        img, txt = self.image_tokens(w), w.text_tokens
        if self.family == "wan":
            dense = 2 * (6 * self.hidden ** 2 + 2 * self.hidden * self.ffn) * img
            dense += 2 * 2 * self.hidden ** 2 * txt          # cross-attention k, v on the text
            attention = 4 * img * img * self.hidden + 4 * img * txt * self.hidden
        else:
            t = img + txt
            dense = 2 * block.params * t / (2 if block.kind == "double" else 1)
            attention = 4 * t * t * self.hidden
        return w.batch * (dense + attention)

"""Seconds and bytes per block for one training micro-batch: the planner's cost model (DESIGN §5)."""
from __future__ import annotations

from .arch.base import ACT_BYTES, WEIGHT_BYTES, ArchSpec, BlockSpec, Workload

GIB = 1024 ** 3

# A DiT block reaches this fraction of the device's measured square-matmul rate: on the H200 a
# klein 9B block at 1024² does fwd+bwd (5.2 TFLOP) in 12 ms (DESIGN §4) against ~790 TFLOP/s.
BLOCK_EFFICIENCY = 0.55
# Compiled blocks (ugpum.compile) fuse the elementwise and copy kernels around the matmuls: the klein 9B
# step at 1024² fell from 0.6085 to 0.4677 s on one H200 (bench/results/speed.md, 2026-12-04), a block
# rate 1.30x the eager one.
COMPILED_EFFICIENCY = BLOCK_EFFICIENCY * 0.6085 / 0.4677
# The base's dense matmuls in 8-bit (ugpum.base_compute), as a multiple of their bf16 speed, fitted to
# the same H200 runs (attention and the LoRA unchanged): compiled fp8 0.3667 s and int8 0.4572 s against
# compiled bf16 0.4677 s; eager, the unfused per-token quantisation costs more than the kernels save
# (fp8 0.71, int8 1.00 s against 0.61 s). fp8's GEMMs alone ran 1.88x bf16's (139 vs 261 ms a step).
BASE_DENSE_SPEED = {("bf16", False): 1.0, ("bf16", True): 1.0, ("fp8", True): 1.37, ("fp8", False): 0.83,
                    ("int8", True): 1.03, ("int8", False): 0.56}
# Frozen base weights: backward computes only input gradients for the dense part (1x forward);
# flash attention's backward costs about 2.5x its forward.
DENSE_BACKWARD = 1.0
ATTENTION_BACKWARD = 2.5
# LoRA parameter bytes: fp32 master weight + fp32 gradient + AdamW's two fp32 moments.
LORA_BYTES_PER_PARAM = 16
# Under checkpointing the peak comes while one block is recomputed and differentiated; backward frees
# its saved tensors as it goes, so the peak holds about this share of them (klein 9B 1024², H200).
RECOMPUTE_PEAK_SHARE = 0.75


def block_flops_split(spec: ArchSpec, block: BlockSpec, w: Workload) -> tuple[float, float]:
    """(dense, attention) forward FLOPs of one block."""
    img, txt, h = spec.image_tokens(w), w.text_tokens, spec.hidden
    if spec.family == "wan":
        attention = 4 * img * img * h + 4 * img * txt * h
    else:
        attention = 4 * (img + txt) ** 2 * h
    attention *= w.batch
    return spec.block_flops(block, w) - attention, attention


def block_train_flops_split(spec: ArchSpec, block: BlockSpec, w: Workload) -> tuple[float, float]:
    """(dense, attention) FLOPs of one block's forward + backward (+ recompute under checkpointing)."""
    dense, attention = block_flops_split(spec, block, w)
    passes = 1 if w.checkpointing else 0
    return dense * (1 + DENSE_BACKWARD + passes), attention * (1 + ATTENTION_BACKWARD + passes)


def block_train_flops(spec: ArchSpec, block: BlockSpec, w: Workload) -> float:
    """Forward + backward (+ recompute under checkpointing) FLOPs of one block."""
    return sum(block_train_flops_split(spec, block, w))


def block_seconds(spec: ArchSpec, block: BlockSpec, w: Workload, tflops: float) -> float:
    """One block's training time on a device of `tflops` (bf16 matmul rate), in the workload's mode."""
    dense, attention = block_train_flops_split(spec, block, w)
    efficiency = COMPILED_EFFICIENCY if w.compiled else BLOCK_EFFICIENCY
    dense_speed = BASE_DENSE_SPEED[(w.base_compute, w.compiled)]
    return (dense / dense_speed + attention) / (tflops * 1e12 * efficiency)


def forward_share(w: Workload) -> float:
    """Fraction of a block's training time spent in its first forward (what prefetch can hide behind)."""
    return 1 / (4.5 if w.checkpointing else 3.5)


def block_weight_bytes(block: BlockSpec, w: Workload) -> int:
    return block.params * WEIGHT_BYTES[w.weight_dtype]


def cast_copy_bytes(block: BlockSpec, w: Workload) -> float:
    """Weights stored below the compute precision (fp8) are cast per matmul by ComfyUI's manual-cast
    ops, and autograd keeps each cast copy (2 bytes a weight) until that layer's input gradient is
    computed: a block's weights exist a second time from its (re)computed forward to its backward.
    Weights already in the compute dtype are kept by reference and cost nothing extra."""
    return block.params * ACT_BYTES if WEIGHT_BYTES[w.weight_dtype] < ACT_BYTES else 0.0


def block_activation_bytes(spec: ArchSpec, block: BlockSpec, w: Workload) -> float:
    """Bytes a block keeps alive from its forward until its backward."""
    if w.checkpointing:
        return spec.boundary_bytes(w)                     # only the block's input is kept
    return spec.saved_units(block) * spec.boundary_bytes(w) + cast_copy_bytes(block, w)


def block_peak_extra_bytes(spec: ArchSpec, block: BlockSpec, w: Workload) -> float:
    """Working memory on top of what is kept, while the block is recomputed and runs backward."""
    if not w.checkpointing:
        return 0.0
    # the cast weight copies are freed as backward goes, like the activations
    return RECOMPUTE_PEAK_SHARE * (spec.saved_units(block) * spec.boundary_bytes(w) + cast_copy_bytes(block, w))


def lora_bytes(block: BlockSpec, w: Workload) -> int:
    return block.lora_params(w.rank) * LORA_BYTES_PER_PARAM


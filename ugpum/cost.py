"""Seconds and bytes per block for one training micro-batch: the planner's cost model (DESIGN §5). Each
block's cost depends on whether it is recomputed in backward (`recomputed`: the planner's choice per block)."""
from __future__ import annotations

from .arch.base import ACT_BYTES, WEIGHT_BYTES, ArchSpec, BlockSpec, Workload

GIB = 1024 ** 3

# A DiT block reaches this fraction of the device's measured square-matmul rate (eager, bf16). Refitted
# (issue 24) with the two factors below to every s/step recorded through the CLI on the H200
# (bench/results/cards.json, modes.json; `python bench/cards_refit.py`): all within 8 %. The rows
# themselves spread that much: klein 9B compiled fp8 ran 0.366 s in one session, 0.428 s in another.
BLOCK_EFFICIENCY = 0.51
# Compiled blocks (ugpum.compile) fuse the elementwise and copy kernels around the matmuls: klein 9B at
# 1024² through the CLI, 0.6069 s eager against 0.4651 s compiled (modes.json), 1.30x; 1.28 with the
# other CLI rows.
COMPILED_EFFICIENCY = BLOCK_EFFICIENCY * 1.28
# The base's dense matmuls in 8-bit (ugpum.base_compute), as a multiple of their bf16 speed (attention and
# the LoRA unchanged): compiled, fitted to the CLI rows (klein fp8 0.366-0.428 s, int8 0.450-0.515 s,
# Wan 14B fp8 1.273-1.330 s; int8 1.00: in one session compiled int8 ran 0.4495 s against bf16's 0.4651,
# the cards session's slower int8 rows came with its slower fp8 ones); eager, the unfused quantisation
# costs more than the kernels save (fp8 0.71, int8 1.00 s against 0.61 s, bench/results/speed.md).
# fp8's GEMMs alone ran 1.88x bf16's.
BASE_DENSE_SPEED = {("bf16", False): 1.0, ("bf16", True): 1.0, ("fp8", True): 1.30, ("fp8", False): 0.83,
                    ("int8", True): 1.00, ("int8", False): 0.56}
# Frozen base weights: backward computes only input gradients for the dense part (1x forward);
# flash attention's backward costs about 2.5x its forward.
DENSE_BACKWARD = 1.0
ATTENTION_BACKWARD = 2.5
# LoRA parameter bytes: fp32 master weight + fp32 gradient + AdamW's two fp32 moments.
LORA_BYTES_PER_PARAM = 16
# Under checkpointing the peak comes while one block is recomputed and differentiated; backward frees
# its saved tensors as it goes, so the peak holds about this share of them (klein 9B 1024², H200).
RECOMPUTE_PEAK_SHARE = 0.75
EIGHT_BIT_MODES = ("fp8", "int8")
# Bytes per element of a Wan block's [tokens, ffn] FFN tensors that the 8-bit base holds at its peak on
# top of the bf16 model's (eight_bit_work_bytes), fitted so the forecast covers Wan 14B fp8's peak at 640²
# x 17 frames, compiled, on the H200: 23.56 GiB measured, 23.93 forecast (with the head kept bf16 and no
# cast copies counted); as a 16 GiB card: 13.86 GiB measured, 14.44 forecast.
EIGHT_BIT_FFN_WORK = 24


def block_flops_split(spec: ArchSpec, block: BlockSpec, w: Workload) -> tuple[float, float]:
    """(dense, attention) forward FLOPs of one block."""
    img, txt, h = spec.image_tokens(w), w.text_tokens, spec.hidden
    if spec.family == "wan":
        attention = 4 * img * img * h + 4 * img * txt * h
    else:
        attention = 4 * (img + txt) ** 2 * h
    attention *= w.batch
    return spec.block_flops(block, w) - attention, attention


def block_train_flops_split(spec: ArchSpec, block: BlockSpec, w: Workload,
                            recomputed: bool) -> tuple[float, float]:
    """(dense, attention) FLOPs of one block's forward + backward (+ its forward again when `recomputed`)."""
    dense, attention = block_flops_split(spec, block, w)
    passes = 1 if recomputed else 0
    return dense * (1 + DENSE_BACKWARD + passes), attention * (1 + ATTENTION_BACKWARD + passes)


def block_train_flops(spec: ArchSpec, block: BlockSpec, w: Workload, recomputed: bool) -> float:
    """Forward + backward (+ recompute) FLOPs of one block."""
    return sum(block_train_flops_split(spec, block, w, recomputed))


def block_seconds(spec: ArchSpec, block: BlockSpec, w: Workload, tflops: float, recomputed: bool) -> float:
    """One block's training time on a device of `tflops` (bf16 matmul rate), in the workload's mode."""
    dense, attention = block_train_flops_split(spec, block, w, recomputed)
    efficiency = COMPILED_EFFICIENCY if w.compiled else BLOCK_EFFICIENCY
    dense_speed = BASE_DENSE_SPEED[(w.base_compute, w.compiled)]
    return (dense / dense_speed + attention) / (tflops * 1e12 * efficiency)


def recompute_seconds(spec: ArchSpec, block: BlockSpec, w: Workload, tflops: float) -> float:
    """What recomputing one block's forward in backward costs: what keeping its activations saves."""
    return block_seconds(spec, block, w, tflops, True) - block_seconds(spec, block, w, tflops, False)


def forward_share(recomputed: bool) -> float:
    """Fraction of a block's training time spent in its first forward (what prefetch can hide behind)."""
    return 1 / (4.5 if recomputed else 3.5)


def block_weight_bytes(block: BlockSpec, w: Workload) -> int:
    return block.params * WEIGHT_BYTES[w.weight_dtype]


def cast_copy_bytes(block: BlockSpec, w: Workload) -> float:
    """Weights stored below the compute precision (fp8) are cast per matmul by ComfyUI's manual-cast
    ops, and autograd keeps each cast copy (2 bytes a weight) until that layer's input gradient is
    computed: a block's weights exist a second time from its (re)computed forward to its backward.
    Weights already in the compute dtype are kept by reference and cost nothing extra, and so are the
    8-bit base's: its GEMMs read the 1-byte weight itself (ugpum.base_compute saves Wq, not a copy)."""
    if w.base_compute in EIGHT_BIT_MODES:
        return 0.0
    return block.params * ACT_BYTES if WEIGHT_BYTES[w.weight_dtype] < ACT_BYTES else 0.0


def eight_bit_work_bytes(spec: ArchSpec, w: Workload) -> float:
    """Working memory a Wan block under the 8-bit base holds at its peak beyond the bf16 model's, counted on
    its FFN's [tokens, ffn] tensors: the Wan 14B fp8 runs ran out of memory allocating exactly such tensors
    (206 and 104 MiB at 7800 tokens: bf16 and 8-bit). A fit to the one CLI measurement (EIGHT_BIT_FFN_WORK),
    not a per-tensor account. FLUX.2 has no separate FFN width here (spec.ffn 0); its 8-bit peaks sit
    at the forecast without it."""
    if w.base_compute not in EIGHT_BIT_MODES:
        return 0.0
    return EIGHT_BIT_FFN_WORK * w.batch * spec.image_tokens(w) * spec.ffn


def full_activation_bytes(spec: ArchSpec, block: BlockSpec, w: Workload) -> float:
    """Bytes a block's forward saves for its backward (with the cast weight copies it makes)."""
    return spec.saved_units(block) * spec.boundary_bytes(w) + cast_copy_bytes(block, w)


def block_activation_bytes(spec: ArchSpec, block: BlockSpec, w: Workload, recomputed: bool) -> float:
    """Bytes a block keeps alive from its forward until its backward."""
    if recomputed:
        return spec.boundary_bytes(w)                     # only the block's input is kept
    return full_activation_bytes(spec, block, w)


def block_peak_extra_bytes(spec: ArchSpec, block: BlockSpec, w: Workload, recomputed: bool) -> float:
    """Working memory on top of what is kept, while the block is recomputed and runs backward."""
    work = eight_bit_work_bytes(spec, w)
    if not recomputed:
        return work
    # the cast weight copies are freed as backward goes, like the activations
    return work + RECOMPUTE_PEAK_SHARE * full_activation_bytes(spec, block, w)


def lora_bytes(block: BlockSpec, w: Workload) -> int:
    return block.lora_params(w.rank) * LORA_BYTES_PER_PARAM


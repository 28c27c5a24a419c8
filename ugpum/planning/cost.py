"""Seconds and bytes per block for one training micro-batch: the planner's cost model (DESIGN §5). Each
block's cost depends on whether it is recomputed in backward (`recomputed`: the planner's choice per block)."""
from __future__ import annotations

import json
from pathlib import Path

from ..arch import family_of
from ..arch.base import ACT_BYTES, WEIGHT_BYTES, ArchSpec, BlockSpec, Workload
from ..compute.modes import mode_named

GIB = 1024 ** 3

# The coefficients measured on a GPU (bench/calibration_fit.py fits them to runs of `python -m ugpum train`;
# each file says which runs): the shared ones here, each family's in its folder (`family_rows`), each compute
# mode's speed factors in its file. Memory is counted in units of the hidden state between two blocks
# (ArchSpec.boundary_bytes), so it scales with tokens, width and batch.
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
CALIBRATION: dict = json.loads(CALIBRATION_FILE.read_text())
# Frozen base weights: backward computes only input gradients for the dense part (1x forward);
# flash attention's backward costs about 2.5x its forward.
DENSE_BACKWARD = 1.0
ATTENTION_BACKWARD = 2.5
# A recompute inside the block's compiled backward graph (where the recomputed blocks keep their self-attention:
# Workload.attention_kept) costs this share of the forward's dense and memory-bound work: the partitioner leaves
# out what backward does not read (the block's output projections) and fuses the norms into the backward. Measured:
# klein 9B, bf16, recompute all, 0.4174 s/step against 0.4729 with the attention recomputed outside the graph, of
# which the attention's forward is 19 ms (bench/results/README.md, the sixth call set: 0.716).
IN_GRAPH_RECOMPUTE = 0.72
# LoRA parameter bytes: fp32 master weight + fp32 gradient + AdamW's two fp32 moments.
LORA_BYTES_PER_PARAM = 16


def _compiled(w: Workload) -> str:
    return "compiled" if w.compiled else "eager"


def family_rows(spec: ArchSpec) -> dict:
    """The measured coefficients of `spec`'s family (ugpum/arch/<family>/calibration.json)."""
    return family_of(spec).calibration


def memory_units(spec: ArchSpec, w: Workload) -> dict:
    """The measured memory coefficients of this family in this mode (compiled or eager)."""
    return family_rows(spec)["memory"][_compiled(w)]


def dense_speed(w: Workload) -> tuple[float, float]:
    """The base's dense matmuls in `w.base_compute` as multiples of their bf16 speed, (forward, backward)
    (attention and the LoRA unchanged): the mode's measured factors (ugpum/compute/modes/)."""
    return mode_named(w.base_compute).dense_speed[_compiled(w)]


def dense_speed_assumed(w: Workload, labels: list[str]) -> str:
    """The speed ratios a quantised base's forecast takes and where they were measured, in words, naming the
    devices (by `labels`) they were not measured on ("" for the exact base)."""
    mode, kind = mode_named(w.base_compute), _compiled(w)
    if not mode.quantises:
        return ""
    measured_on = mode.speed_measured_on.get(kind, "")
    elsewhere = [label for label in labels if not measured_on or measured_on.lower() not in label.lower()]
    taken = f"; taken as they are for {', '.join(elsewhere)} (not measured there)" if elsewhere else ""
    forward, backward = mode.dense_speed[kind]
    return (f"base compute {mode.name}: {kind} dense matmuls at {forward:g}x (forward) and {backward:g}x "
            f"(backward) their bf16 speed, as measured on {'an ' + measured_on if measured_on else 'no GPU yet'}"
            f"{taken}")


def block_flops_split(spec: ArchSpec, block: BlockSpec, w: Workload) -> tuple[float, float]:
    """(dense, attention) forward FLOPs of one block."""
    attention = spec.attention_flops(w) * w.batch
    return spec.block_flops(block, w) - attention, attention


def block_time_terms(spec: ArchSpec, block: BlockSpec, w: Workload, recomputed: bool) -> dict[str, float]:
    """The FLOPs of one block's forward + backward (+ its forward again when `recomputed`), by what bounds
    their speed: the dense matmuls' forward passes and backward (an 8-bit base runs them at different
    speeds), attention, and the memory-bound work around the matmuls (norms, modulation, activations, casts,
    residuals), which grows with tokens x width where the matmuls grow with width²: counted as the dense
    FLOPs over the block's width (`elementwise_width` of them make one FLOP's time). A recomputed block keeping
    its self-attention (`Workload.attention_kept`) recomputes only the rest of its attention, inside its compiled
    backward (`IN_GRAPH_RECOMPUTE`)."""
    dense, attention = block_flops_split(spec, block, w)
    forward = dense * (1 + recomputed * (IN_GRAPH_RECOMPUTE if w.attention_kept else 1.0))
    backward = dense * DENSE_BACKWARD
    again = (attention - spec.self_attention_flops(w) * w.batch * w.attention_kept) * recomputed
    return {"forward": forward, "backward": backward, "attention": attention * (1 + ATTENTION_BACKWARD) + again,
            "elementwise": (forward + backward) / spec.hidden}


def block_seconds(spec: ArchSpec, block: BlockSpec, w: Workload, tflops: float, recomputed: bool) -> float:
    """One block's training time on a device of `tflops` (its measured bf16 matmul rate), in the workload's
    mode: each term of `block_time_terms` at its measured share of that rate (CALIBRATION's time), scaled by
    the family's own factor."""
    terms, fitted = block_time_terms(spec, block, w, recomputed), CALIBRATION["time"]
    forward_speed, backward_speed = dense_speed(w)
    dense = (terms["forward"] / forward_speed + terms["backward"] / backward_speed
             + terms["elementwise"] * fitted["elementwise_width"])
    flops = dense / fitted[f"{_compiled(w)}_efficiency"] + terms["attention"] / fitted["attention_efficiency"]
    return flops / (tflops * 1e12 * family_rows(spec)["efficiency"])


def recompute_seconds(spec: ArchSpec, block: BlockSpec, w: Workload, tflops: float) -> float:
    """What recomputing one block's forward in backward costs: what keeping its activations saves."""
    return block_seconds(spec, block, w, tflops, True) - block_seconds(spec, block, w, tflops, False)


def forward_share(recomputed: bool) -> float:
    """Fraction of a block's training time spent in its first forward (what prefetch can hide behind)."""
    return 1 / (4.5 if recomputed else 3.5)


def block_weight_bytes(block: BlockSpec, w: Workload) -> int:
    return block.params * WEIGHT_BYTES[w.held_dtype]


def cast_copy_bytes(block: BlockSpec, w: Workload) -> float:
    """Weights stored below the compute precision (fp8) are cast per matmul by ComfyUI's manual-cast
    ops, and autograd keeps each cast copy (2 bytes a weight) until that layer's input gradient is
    computed: a block's weights exist a second time from its (re)computed forward to its backward.
    Weights already in the compute dtype are kept by reference and cost nothing extra, and so are those of a
    quantised base: its GEMMs read the quantised weight itself (ugpum.compute.base_compute saves Wq, not a copy)."""
    if mode_named(w.base_compute).quantises:
        return 0.0
    return block.params * ACT_BYTES if WEIGHT_BYTES[w.held_dtype] < ACT_BYTES else 0.0


def full_activation_bytes(spec: ArchSpec, block: BlockSpec, w: Workload) -> float:
    """Bytes a block's forward leaves alive for its backward (its saved tensors and its output), with the
    cast weight copies it makes: measured per block kind on the GPU (bench/cards.py's BlockMemory)."""
    return memory_units(spec, w)["kept"][block.kind] * spec.boundary_bytes(w) + cast_copy_bytes(block, w)


def block_activation_bytes(spec: ArchSpec, block: BlockSpec, w: Workload, recomputed: bool) -> float:
    """Bytes a block keeps alive from its forward until its backward."""
    if recomputed:                                        # its output, the next block's input (+ its attention)
        return spec.boundary_bytes(w) + (spec.kept_attention_bytes(w) if w.attention_kept else 0)
    return full_activation_bytes(spec, block, w)


def block_peak_extra_bytes(spec: ArchSpec, block: BlockSpec, w: Workload, recomputed: bool) -> float:
    """Working memory on top of what is kept at the step's peak, while the block runs its backward (a
    recomputed block first makes its saved tensors again): the measured peak less what the blocks keep."""
    units = memory_units(spec, w)
    work = units["recompute_work"] if recomputed else units["keep_work"]
    scale = units["kept"][block.kind] / (max(units["kept"].values()) or 1)   # (a smaller kind works in less)
    return work * scale * spec.boundary_bytes(w) + (cast_copy_bytes(block, w) if recomputed else 0.0)


def allocator_bytes(spec: ArchSpec, w: Workload) -> float:
    """What PyTorch's caching allocator reserves beyond the peak it hands out (blocks cut from larger free
    ones, rounding), with expandable segments: measured as peak reserved less peak allocated."""
    return family_rows(spec)["allocator"] * spec.boundary_bytes(w)


def host_bytes(spec: ArchSpec, base_compute: str, pinned: float) -> float:
    """The training process's peak resident host memory: what it holds for this family with every weight
    streamed from its file (Python, torch, ComfyUI's classes, the cached latents and captions, the loader's
    buffers; measured), what runs in this base-compute mode held beyond that (measured), plus the pinned host
    copies of the swapped blocks."""
    return (family_rows(spec)["host_gib"] + mode_named(base_compute).extra_host_gib) * GIB + pinned


def lora_bytes(block: BlockSpec, w: Workload) -> int:
    return block.lora_params(w.rank) * LORA_BYTES_PER_PARAM


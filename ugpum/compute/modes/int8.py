"""base_compute = int8: the base's weights and activations in int8 (symmetric absmax scales), its matmuls
on int8 tensor cores (Ampere and newer): on CUDA a Triton GEMM with the rescale in its epilogue, elsewhere
`torch._int_mm` (int32 out)."""
from __future__ import annotations

import torch

from .mode import ComputeMode

# On CUDA, the matmul and its rescale in one Triton kernel on Hopper's int8 instructions: this op
# (`ugpum.compute.kernels.matmul_8bit`, set by `kernels.turn_on`, which a CUDA run calls); None: _int_mm.
TRITON_KERNEL = None
# Whether that kernel also adds each layer's LoRA up-projection in its epilogue (`takes_lora`); off until a GPU
# run measures it (bench/cards.py --experiment int8-lora-epilogue).
LORA_IN_KERNEL = False


class Int8(ComputeMode):
    name = "int8"
    order = 2
    held_dtype = "fp8"                                   # 1 byte a weight, counted as fp8 weights are
    # compiled: fitted to the H100 runs ugpum/planning/calibration.json names; eager: the H200's steps in
    # bench/results/speed.md (1.00 s against bf16's 0.61 s)
    dense_speed = {"compiled": (1.7956, 0.9522), "eager": (0.56, 0.56)}
    speed_measured_on = {"compiled": "H100", "eager": "H200"}
    extra_host_gib = 0.44                               # (measured beside bf16: bench/calibration_fit.py)
    # the lowest of klein 9B's first, middle and last block on an H100
    # (bench/results/gradient_cosine_2026-12-07_h100.jsonl; 0.9997 on an H200 before, bench/results/speed.md)
    gradient_cosine = 0.99961
    min_capability = (8, 0)
    needs = "compute capability 8.0+ (Ampere or newer)"
    qmax = 127.0
    min_rows = 17                                        # torch._int_mm takes more than 16 rows

    def to_grid(self, t):
        return t.round().clamp(-self.qmax, self.qmax).to(torch.int8)

    def takes_lora(self):
        return LORA_IN_KERNEL and TRITON_KERNEL is not None

    def matmul(self, a, sa, b_t, sb, out_dtype, lora=None):
        if TRITON_KERNEL is not None and (a.is_cuda or lora is not None):   # (elsewhere the op's PyTorch form)
            sb = sb if sb is not None else torch.ones(b_t.shape[0], device=a.device)
            return TRITON_KERNEL(a, sa, b_t, sb, out_dtype, *(lora or ()))
        y = torch._int_mm(a, b_t.t()).float() * sa
        return (y if sb is None else y * sb).to(out_dtype)


MODE = Int8()

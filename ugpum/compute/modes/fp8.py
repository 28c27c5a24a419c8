"""base_compute = fp8: the base's weights and activations in fp8 e4m3, its matmuls on fp8 tensor cores
(`torch._scaled_mm` with row-wise scales; Ada, Hopper, Blackwell)."""
from __future__ import annotations

import torch

from .mode import ComputeMode

FP8 = torch.float8_e4m3fn
# On CUDA, where set (`kernels.turn_on("fp8-lora-epilogue")`): the forward's matmul on the Triton GEMM of
# `ugpum.compute.kernels.matmul_8bit`, which also adds each layer's LoRA up-projection in its epilogue (cuBLAS's
# cannot); the backward stays on cuBLAS. Off until a GPU run measures it (bench/cards.py --experiment
# fp8-lora-epilogue).
TRITON_KERNEL = None


class Fp8(ComputeMode):
    name = "fp8"
    order = 1
    held_dtype = "fp8"                                   # 1 byte a weight
    # compiled: fitted to the H100 runs ugpum/planning/calibration.json names; eager: the H200's steps in
    # bench/results/speed.md (0.71 s against bf16's 0.61 s)
    dense_speed = {"compiled": (1.9899, 1.0552), "eager": (0.83, 0.83)}
    speed_measured_on = {"compiled": "H100", "eager": "H200"}
    extra_host_gib = 0.06                               # (measured beside bf16: bench/calibration_fit.py)
    # the lowest of klein 9B's first, middle and last block on an H100
    # (bench/results/gradient_cosine_2026-12-07_h100.jsonl; 0.9985 on an H200 before, bench/results/speed.md)
    gradient_cosine = 0.99802
    min_capability = (8, 9)
    needs = "fp8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell)"
    qmax = 448.0

    def to_grid(self, t):
        return t.clamp(-self.qmax, self.qmax).to(FP8)

    def takes_lora(self):
        return TRITON_KERNEL is not None

    def matmul(self, a, sa, b_t, sb, out_dtype, lora=None):
        ones = sb if sb is not None else torch.ones(b_t.shape[0], device=a.device, dtype=torch.float32)
        if lora is not None:                                 # (only where takes_lora)
            return TRITON_KERNEL(a, sa, b_t, ones, out_dtype, *lora)
        return torch._scaled_mm(a, b_t.t(), scale_a=sa.float().contiguous(),
                                scale_b=ones.float().reshape(1, -1).contiguous(), out_dtype=out_dtype)


MODE = Fp8()

"""An 8-bit base's matmul with its rescale in one kernel: (a @ b^T) * sa * sb in bf16, a [M, K] and b [N, K] int8
(both K-major, as Hopper's int8 tensor cores read them; or fp8 e4m3 on Hopper's tensor memory accelerator, where
the epilogue can also add a LoRA's up-projection, which cuBLAS's fp8 GEMM cannot), sa [M, 1] and sb [N] fp32
scales. `torch._int_mm` on an
H100 takes CUTLASS's Ampere int8 GEMM and writes int32, which two more passes turn into bf16: 212.7 ms of
matmuls and 58 ms of casts a klein 9B step, slower than bf16's matmuls (bench/results/README.md, the judge rows
of 2026-12-07). A Triton GEMM runs Hopper's int8 instructions and rescales in its epilogue. On the CPU, and
without Triton, the op is the PyTorch form."""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.library import triton_op, wrap_triton

from . import cdiv, runs_kernel

# Whether the GEMM's tiles come in through Hopper's tensor memory accelerator (`triton_kernels.scaled_mm_8bit_tma`,
# K a multiple of 16) rather than each thread's loads; off until a GPU run measures it (bench/cards.py
# --experiment int8-tma).
DESCRIPTORS = False


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Whether the GPU has the tensor memory accelerator (Hopper and newer) and Triton reaches it."""
    import triton.language as tl
    return torch.cuda.get_device_capability(device) >= (9, 0) and hasattr(tl, "make_tensor_descriptor")


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # the descriptors' scratch memory, which Triton asks its allocator for at each launch
    return torch.empty(size, dtype=torch.int8, device="cuda")


@triton_op("ugpum::scaled_mm_8bit", mutates_args=())
def scaled_mm_8bit(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
                   h: Optional[torch.Tensor] = None, lb: Optional[torch.Tensor] = None,
                   scale: float = 0.0) -> torch.Tensor:
    """(a [M, K] @ b [N, K]^T) * sa [M, 1] * sb [N] as out_dtype; a and b int8 (or fp8 e4m3: the TMA kernel), the
    scales fp32. With h [M, r] and lb [N, r] (a LoRA's down-projected input and its B, one float dtype):
    + scale * h @ lb^T, in the same kernel's epilogue."""
    (m, width), n, int8, on_gpu = a.shape, b.shape[0], a.dtype == torch.int8, runs_kernel(a)
    descriptors = on_gpu and (DESCRIPTORS or not int8) and width % 16 == 0 and _has_tma(a.device)
    if not (descriptors or (on_gpu and int8)):                          # the PyTorch form
        y = (torch._int_mm(a, b.t()).float() if int8 else a.float() @ b.float().t()) * sa.reshape(-1, 1) * sb
        return (y if h is None else y + (h.float() @ lb.float().t()) * scale).to(out_dtype)
    from . import triton_kernels as k
    a, b = a.contiguous(), b.contiguous()
    sa, sb = sa.float().reshape(-1).contiguous(), sb.float().reshape(-1).contiguous()
    c = torch.empty(m, n, device=a.device, dtype=out_dtype)
    lora = h is not None
    h, lb = (h.contiguous(), lb.contiguous()) if lora else (a, b)          # (unread without a LoRA)

    def grid(meta):
        return (cdiv(m, meta["BM"]) * cdiv(n, meta["BN"]),)
    kernel = k.scaled_mm_8bit
    if descriptors:
        import triton
        triton.set_allocator(_scratch)          # (a context variable: set in the thread that launches)
        kernel = k.scaled_mm_8bit_tma
    wrap_triton(kernel)[grid](a, b, sa, sb, c, h, lb, m, n, width, h.shape[1] if lora else 0, scale,
                              LORA=lora, BR=k.TILE_R)
    return c

"""The int8 base's matmul with its rescale in one kernel: (a @ b^T) * sa * sb in bf16, a [M, K] and b [N, K] int8
(both K-major, as Hopper's int8 tensor cores read them), sa [M, 1] and sb [N] fp32 scales. `torch._int_mm` on an
H100 takes CUTLASS's Ampere int8 GEMM and writes int32, which two more passes turn into bf16: 212.7 ms of
matmuls and 58 ms of casts a klein 9B step, slower than bf16's matmuls (bench/results/README.md, the judge rows
of 2026-12-07). A Triton GEMM runs Hopper's int8 instructions and rescales in its epilogue. On the CPU, and
without Triton, the op is the PyTorch form."""
from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

try:
    import triton
    import triton.language as tl
except ImportError:                      # (a CPU-only install: the PyTorch form everywhere)
    triton = None

if triton is not None:
    @triton.autotune(configs=[triton.Config({"BM": 128, "BN": 256, "BK": 128}, num_warps=8, num_stages=3),
                              triton.Config({"BM": 256, "BN": 128, "BK": 128}, num_warps=8, num_stages=3),
                              triton.Config({"BM": 128, "BN": 128, "BK": 128}, num_warps=4, num_stages=4),
                              triton.Config({"BM": 64, "BN": 128, "BK": 128}, num_warps=4, num_stages=4)],
                     key=["M", "N", "K"])
    @triton.jit
    def _int8_scaled_mm(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, M, N, K,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # c = (a @ b^T) * sa[:, None] * sb[None, :]; a [M, K], b [N, K], c [M, N]: row-major and contiguous.
        # Programs go down a column of tiles first: the ones running together share b's tiles in L2.
        pid, rows = tl.program_id(0), tl.cdiv(M, BM)
        rm = (pid % rows) * BM + tl.arange(0, BM)
        rn = (pid // rows) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.int32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0)
            b = tl.load(b_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0)
            acc += tl.dot(a, tl.trans(b))
        sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
        c = acc.to(tl.float32) * sa[:, None] * sb[None, :]
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], c.to(c_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def runs_kernel(a: torch.Tensor) -> bool:
    """Whether `int8_scaled_mm` takes the Triton kernel for this operand (CUDA, Triton installed)."""
    return triton is not None and a.device.type == "cuda"


@triton_op("ugpum::int8_scaled_mm", mutates_args=())
def int8_scaled_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """(a [M, K] @ b [N, K]^T) * sa [M, 1] * sb [N] as out_dtype; a and b int8, the scales fp32."""
    if not runs_kernel(a):
        return (torch._int_mm(a, b.t()).float() * sa * sb).to(out_dtype)
    a, b = a.contiguous(), b.contiguous()
    sa, sb = sa.float().reshape(-1).contiguous(), sb.float().reshape(-1).contiguous()
    (m, k), n = a.shape, b.shape[0]
    c = torch.empty(m, n, device=a.device, dtype=out_dtype)

    def grid(meta):
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)
    wrap_triton(_int8_scaled_mm)[grid](a, b, sa, sb, c, m, n, k)
    return c

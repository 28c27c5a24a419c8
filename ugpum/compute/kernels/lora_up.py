"""The LoRA's up-projection added into its layer's output in one pass: `out + scale * (h @ B^T)`, with h = x @ A^T
[M, r] and B [N, r]. On CUDA one Triton kernel does it: each tile of the output is read once and written once,
and the rank-r product comes from the tensor cores. As two ops (a matmul, then the add) the product's [M, N]
result is written, read again and added in a pass of its own: 17.5 ms of a klein 9B step for single-block
linear1's [4608, 36864] output alone (bench/results/README.md, the fourth call set of 2026-12-07). Elsewhere (the
CPU, no Triton) the op is those two PyTorch ops. A custom op (`torch.library.triton_op`), so compiled blocks
trace it as it is and autograd takes its backward from here: the two small matmuls of the plain form."""
from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from . import cdiv, runs_kernel


@triton_op("ugpum::add_up_projection", mutates_args=())
def add_up_projection(out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """out [M, N] + scale * (h [M, r] @ b [N, r]^T), in out's dtype (h and b in one dtype)."""
    if not runs_kernel(out):
        return out + (h @ b.t()).to(out.dtype) * scale
    from . import triton_kernels as k
    out, h, b = out.contiguous(), h.contiguous(), b.contiguous()
    y = torch.empty_like(out)
    (m, n), r = out.shape, h.shape[1]
    def grid(meta):
        return (cdiv(m, meta["BM"]), cdiv(n, meta["BN"]))
    wrap_triton(k.add_up_projection)[grid](out, h, b, y, m, n, r, scale, BR=k.TILE_R)
    return y


def _keep(ctx, inputs, output):
    _, h, b, scale = inputs
    ctx.save_for_backward(h, b)
    ctx.scale = scale


def _backward(ctx, grad):
    h, b = ctx.saved_tensors
    grad_h = (grad.to(b.dtype) @ b) * ctx.scale
    grad_b = (grad.t().to(h.dtype) @ h) * ctx.scale
    return grad, grad_h, grad_b, None


add_up_projection.register_autograd(_backward, setup_context=_keep)

"""ugpum.compute.lora_kernel: the LoRA's up-projection added into the layer's output in one pass. The op's
values and gradients are the plain form's (eager and compiled, here on the CPU, where it is the plain form), and
its Triton kernel computes them: run by Triton's own interpreter on the CPU (fp32 and fp16; the interpreter has
no bf16, which the GPU runs check: `bench/cards.py --experiment lora-kernel`)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ugpum.compute.lora_kernel import add_up_projection

pytestmark = pytest.mark.quick


def _inputs(m=40, n=24, r=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    out, h, b = (torch.randn(*shape, generator=g, dtype=dtype) for shape in ((m, n), (m, r), (n, r)))
    return out.requires_grad_(), h.requires_grad_(), b.requires_grad_()


def _grads(fn, out, h, b):
    y = fn(out, h, b)
    (y * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum().backward()
    return y.detach(), [t.grad.clone() for t in (out, h, b)]


@pytest.mark.parametrize("compiled", [False, True])
def test_the_op_gives_the_plain_forms_values_and_gradients(compiled):
    op = (lambda o, h, b: add_up_projection(o, h, b, 0.75))
    if compiled:
        op = torch.compile(op, backend="aot_eager")
    y, grads = _grads(op, *_inputs())
    y_ref, grads_ref = _grads(lambda o, h, b: o + (h @ b.t()) * 0.75, *_inputs())
    torch.testing.assert_close(y, y_ref)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want)


def test_the_triton_kernel_computes_out_plus_the_scaled_product():
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch, triton
        from ugpum.compute import lora_kernel as lk
        g = torch.Generator().manual_seed(1)
        for dtype in (torch.float32, torch.float16):
            for m, n, r in ((300, 200, 16), (130, 129, 8), (64, 256, 40)):     # edges of tiles and of the rank
                out, h, b = (torch.randn(*s, generator=g).to(dtype) for s in ((m, n), (m, r), (n, r)))
                y = torch.empty_like(out)
                grid = (triton.cdiv(m, lk.TILE_M), triton.cdiv(n, lk.TILE_N))
                lk._add_up_projection[grid](out, h, b, y, m, n, r, 0.5, BM=lk.TILE_M, BN=lk.TILE_N, BR=lk.TILE_R)
                want = out.float() + (h.float() @ b.float().t()) * 0.5
                err = (y.float() - want).abs().max().item()
                assert err <= (1e-5 if dtype == torch.float32 else 1e-2), (dtype, m, n, r, err)
        print("kernel ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "kernel ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel itself runs on CUDA")
@pytest.mark.parametrize("m, n, r", [(4608, 36864, 16), (333, 515, 24)])
def test_on_cuda_the_kernel_gives_the_plain_forms_values_and_gradients_in_bf16(m, n, r):
    def on_cuda(t):
        return t.detach().to("cuda", torch.bfloat16).requires_grad_()
    inputs = [on_cuda(t) for t in _inputs(m, n, r)]
    y, grads = _grads(lambda o, h, b: add_up_projection(o, h, b, 0.5), *inputs)
    y_ref, grads_ref = _grads(lambda o, h, b: o + ((h.float() @ b.float().t()) * 0.5).to(o.dtype),
                              *[on_cuda(t) for t in inputs])
    for got, want in zip([y, *grads], [y_ref, *grads_ref]):              # within bf16's rounding, as a whole
        assert (got.float() - want.float()).norm() <= 1e-2 * want.float().norm()

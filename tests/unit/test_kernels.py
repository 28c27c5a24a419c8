"""ugpum.compute.kernels: the LoRA's up-projection added into the layer's output in one pass (`lora_up`), and the
int8 base's matmul with its rescale (`matmul_8bit`). Each op gives its plain form's values (and gradients) here on
the CPU, where it is that form, and its Triton kernel computes them: run by Triton's own interpreter on the CPU
(fp32 and fp16 outputs; the interpreter has no bf16, which the CUDA tests and the GPU runs check:
`bench/cards.py --experiment lora-kernel|int8-kernel`)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ugpum.compute.kernels import matmul_8bit
from ugpum.compute.kernels.matmul_8bit import scaled_mm_8bit
from ugpum.compute.kernels.lora_up import add_up_projection
from ugpum.compute.modes import mode_named

# (the interpreter's child process imports this file without conftest's path)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from support.lora_pair import output_and_gradients, two_linears_with_lora  # noqa: E402


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


def _in_the_interpreter(script: str) -> None:
    pytest.importorskip("triton")
    if torch.cuda.is_available():       # (Triton 3.6's interpreter beside a GPU failed these: there the CUDA tests run)
        pytest.skip("on a GPU the kernels themselves run (the CUDA tests below)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and "kernel ok" in done.stdout, done.stderr[-3000:]


def test_the_lora_kernel_computes_out_plus_the_scaled_product():
    _in_the_interpreter("""
        import torch, triton
        from ugpum.compute.kernels import triton_kernels as lk
        g = torch.Generator().manual_seed(1)
        for dtype in (torch.float32, torch.float16):
            for m, n, r in ((300, 200, 16), (130, 129, 8), (64, 256, 40)):     # edges of tiles and of the rank
                out, h, b = (torch.randn(*s, generator=g).to(dtype) for s in ((m, n), (m, r), (n, r)))
                want = out.float() + (h.float() @ b.float().t()) * 0.5
                for bm, bn in ((128, 128), (64, 256)):          # (the autotuner needs a GPU: tiles set here)
                    y = torch.empty_like(out)
                    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
                    lk.add_up_projection.fn[grid](out, h, b, y, m, n, r, 0.5, BM=bm, BN=bn, BR=lk.TILE_R)
                    err = (y.float() - want).abs().max().item()
                    assert err <= (1e-5 if dtype == torch.float32 else 1e-2), (dtype, m, n, r, bm, err)
        print("kernel ok")
    """)


def _int8_operands(m, n, k, device="cpu"):
    g = torch.Generator().manual_seed(2)
    int8 = mode_named("int8")
    a, sa = int8.quantise_rows(torch.randn(m, k, generator=g))
    b, sb = int8.quantise_rows(torch.randn(n, k, generator=g))
    return a.to(device), sa.to(device), b.to(device), sb.reshape(-1).to(device)


def test_the_int8_op_is_the_rescaled_integer_product_plus_the_lora_term():
    a, sa, b, sb = _int8_operands(40, 24, 64)
    h, lb = torch.randn(40, 4, dtype=torch.float64), torch.randn(24, 4, dtype=torch.float64)
    want = (a.double() @ b.double().t()) * sa.double() * sb.double()
    torch.testing.assert_close(scaled_mm_8bit(a, sa, b, sb, torch.float32).double(), want, rtol=1e-6, atol=1e-6)
    compiled = torch.compile(lambda *x: scaled_mm_8bit(*x[:4], torch.float32, *x[4:]), backend="aot_eager")
    torch.testing.assert_close(compiled(a, sa, b, sb).double(), want, rtol=1e-6, atol=1e-6)
    with_lora = compiled(a, sa, b, sb, h.float(), lb.float(), 0.25).double()
    torch.testing.assert_close(with_lora, want + (h @ lb.t()) * 0.25, rtol=1e-5, atol=1e-5)


def test_the_int8_kernel_computes_the_rescaled_integer_product_and_the_lora_term():
    _in_the_interpreter("""
        import itertools, torch, triton
        from ugpum.compute.kernels import triton_kernels as k
        from tests.unit.test_kernels import _int8_operands
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))   # (descriptors)
        g = torch.Generator().manual_seed(3)
        for dtype in (torch.float32, torch.float16):
            for (m, n, kk), r in (((300, 260, 160), 0), ((17, 129, 64), 8), ((130, 64, 300), 40), ((70, 48, 96), 8)):  # tile, K, rank edges
                a, sa, b, sb = _int8_operands(m, n, kk)
                h, lb = torch.randn(m, max(r, 1), generator=g).to(dtype), torch.randn(n, max(r, 1), generator=g).to(dtype)
                c = torch.empty(m, n, dtype=dtype)
                kernels = (k.scaled_mm_8bit, k.scaled_mm_8bit_tma) if kk % 16 == 0 else (k.scaled_mm_8bit,)
                for kernel, (bm, bn) in itertools.product(kernels, ((64, 128), (128, 64))):   # (tiles set here:
                    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)               # the autotuner needs a GPU)
                    kernel.fn[grid](a, b, sa.reshape(-1), sb, c, h, lb, m, n, kk, r, 0.5, BM=bm, BN=bn, BK=32,
                                    LORA=r > 0, BR=k.TILE_R, **({"GROUP": 2} if kernel is k.scaled_mm_8bit_tma else {}))
                    want = (a.double() @ b.double().t()) * sa.double() * sb.double()
                    if r:
                        want = want + (h.double() @ lb.double().t()) * 0.5
                    err = ((c.double() - want).abs() / want.abs().clamp_min(1)).max().item()
                    assert err <= (1e-5 if dtype == torch.float32 else 2e-3), (dtype, m, n, kk, r, bm, err)
        print("kernel ok")
    """)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel itself runs on CUDA")
@pytest.mark.parametrize("m, n, k", [(4608, 36864, 4096), (512, 4096, 12288), (333, 515, 272)])
@pytest.mark.parametrize("descriptors", [False, True])
def test_on_cuda_the_int8_kernel_matches_int_mm_in_bf16(m, n, k, descriptors, monkeypatch):
    monkeypatch.setattr(matmul_8bit, "DESCRIPTORS", descriptors)
    a, sa, b, sb = _int8_operands(m, n, k, "cuda")
    got = scaled_mm_8bit(a, sa, b, sb, torch.bfloat16).float()
    want = (a.double() @ b.double().t()).float() * sa * sb       # (_int_mm needs multiples of 8)
    assert (got - want).norm() <= 4e-3 * want.norm()
    h, lb = (torch.randn(rows, 16, device="cuda", dtype=torch.bfloat16) for rows in (m, n))
    got = scaled_mm_8bit(a, sa, b, sb, torch.bfloat16, h, lb, 0.5).float()
    want = want + (h.float() @ lb.float().t()) * 0.5
    assert (got - want).norm() <= 4e-3 * want.norm()


def test_triton_is_imported_only_once_a_kernel_is_turned_on():
    """Registering a Triton op imports Triton (a second or more): the CLI, the engine and the node pack's core start
    without it, and `turn_on` hands each op to the code that runs it."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import sys
        import ugpum.commands.plan, ugpum.commands.train, ugpum.compute.lora as lora, ugpum.compute.modes.int8 as int8
        from ugpum.compute import kernels
        assert "triton" not in sys.modules and lora.FUSED_UP_PROJECTION is None and int8.TRITON_KERNEL is None
        assert kernels.turn_on_measured(["cpu"]) == [] and "triton" not in sys.modules    # a CPU run: the plain ops
        assert kernels.turn_on_measured(["cpu", "cuda:0"]) == list(kernels.ON_BY_DEFAULT)
        from ugpum.compute.kernels import matmul_8bit, lora_up
        assert lora.FUSED_UP_PROJECTION is lora_up.add_up_projection and int8.TRITON_KERNEL is matmul_8bit.scaled_mm_8bit
        print("ok", "triton" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "ok True" in done.stdout, done.stderr[-3000:]


def test_the_fp8_mode_hands_its_matmul_and_lora_to_the_op_where_the_kernel_is_set(monkeypatch):
    """`Fp8.matmul` with a LoRA (only where `takes_lora`): the op's product of the fp8 grids, rescaled, plus the LoRA
    term (here the op's PyTorch form; on Hopper its TMA kernel)."""
    from ugpum.compute.modes import fp8
    g = torch.Generator().manual_seed(4)
    a, sa = fp8.MODE.quantise_rows(torch.randn(33, 64, generator=g))
    b, sb = fp8.MODE.quantise_rows(torch.randn(24, 64, generator=g))
    h, lb = torch.randn(33, 8, generator=g), torch.randn(24, 8, generator=g)
    assert not fp8.MODE.takes_lora()
    monkeypatch.setattr(fp8, "TRITON_KERNEL", scaled_mm_8bit)
    assert fp8.MODE.takes_lora()
    got = fp8.MODE.matmul(a, sa, b, sb.reshape(-1), torch.float32, (h, lb, 0.25))
    want = (a.double() * sa.double()) @ (b.double() * sb.double()).t() + (h.double() @ lb.double().t()) * 0.25
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_kernel_that_needs_hopper_is_turned_on_only_where_every_gpu_has_it(monkeypatch):
    """fp8's GEMM with the LoRA in its epilogue runs on Hopper's tensor memory accelerator only: where it is on by
    default, a run on an Ada card (8.9), or on GPUs of unknown capability, leaves it off; Hopper takes it."""
    from ugpum.compute import kernels
    monkeypatch.setattr(kernels, "ON_BY_DEFAULT", ("lora-kernel", "fp8-lora-epilogue"))
    assert kernels.measured_for((9, 0)) == ["lora-kernel", "fp8-lora-epilogue"]
    assert kernels.measured_for((10, 0)) == ["lora-kernel", "fp8-lora-epilogue"]
    assert kernels.measured_for((8, 9)) == kernels.measured_for(None) == ["lora-kernel"]



@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_the_up_projection_summed_over_the_rank_gives_the_matmuls_values_and_gradients(monkeypatch, autocast):
    """`lora.UP_PROJECTION_AS_SUM`: inside a compiled graph the LoRA's up-projection is the sum over the rank (which
    inductor can fuse into the kernel that reads the output), to the matmul form's output and x's, A's and B's
    gradients; eager runs keep the matmul."""
    from ugpum.compute import lora as lora_module
    model, adapters, x = two_linears_with_lora()
    summed = []
    monkeypatch.setattr(lora_module._UpProjectionAsSum, "forward",
                        staticmethod(lambda ctx, h, b, real=lora_module._UpProjectionAsSum.forward:
                                     summed.append(h.shape) or real(ctx, h, b)))

    def run():
        return output_and_gradients(model, adapters, x, compiled=True, autocast=autocast)

    want = run()
    assert not summed
    monkeypatch.setattr(lora_module, "UP_PROJECTION_AS_SUM", True)
    got = run()
    assert len(summed) >= 2                                                # both layers' up-projections (traced)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=2e-2 if autocast else 1e-5, atol=2e-2 if autocast else 1e-5)
    summed.clear()
    model(x)
    assert not summed                                                       # eager: the matmul


def test_the_8bit_kernels_compile_for_hopper_with_the_installed_triton():
    """Triton's own compiler (its front end, then ptxas, both in its wheel: no GPU needed) takes the int8 and the TMA
    kernels for an H100, int8 and fp8 operands, with and without the LoRA epilogue: the interpreter above runs the
    kernels' Python and skips the compiler's checks, which the GPU runs hit (bench/results/README.md, the ninth and
    tenth sessions)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from ugpum.compute.kernels import triton_kernels as k
    scalars = {"M": "i32", "N": "i32", "K": "i32", "R": "i32", "scale": "fp32"}
    for kernel, tile in ((k.scaled_mm_8bit_tma, {"BM": 128, "BN": 256, "BK": 128, "GROUP": 8}),
                         (k.scaled_mm_8bit, {"BM": 128, "BN": 128, "BK": 128})):
        for operand in ("i8", "fp8e4nv") if kernel is k.scaled_mm_8bit_tma else ("i8",):
            for lora in (False, True):
                pointers = {name: f"*{t}" for name, t in (("a_ptr", operand), ("b_ptr", operand), ("sa_ptr", "fp32"),
                            ("sb_ptr", "fp32"), ("c_ptr", "bf16"), ("h_ptr", "bf16"), ("lb_ptr", "bf16"))}
                constants = {**tile, "LORA": lora, "BR": k.TILE_R}
                signature = {**pointers, **scalars, **{name: "constexpr" for name in constants}}
                compiled = triton.compile(ASTSource(kernel.fn, signature, constants), target=GPUTarget("cuda", 90, 32))
                assert compiled.asm["cubin"], (kernel.fn.__name__, operand, lora)

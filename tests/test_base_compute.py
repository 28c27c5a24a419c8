"""8-bit compute for the frozen base Linears (ugpum.base_compute): numerics through the fp32 reference
emulation on the CPU (the same quantisation the fp8/int8 kernels get on a GPU), LoRA gradients on a tiny
ComfyUI FLUX.2 against the full-precision base, exact undo, refusals in one sentence."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support import comfy_models as cm  # noqa: E402
from ugpum.base_compute import (BaseComputeError, base_compute_factors, linear_8bit, quantise_rows,  # noqa: E402
                                quantise_weight, supports, use_8bit_base)
from ugpum.train.lora import attach_lora  # noqa: E402


@pytest.mark.parametrize("mode, bound", [("fp8", 0.0625), ("int8", 1 / 127)])
def test_row_quantisation_error_is_bounded(mode, bound):
    t = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, 64)[:, None]
    q, s = quantise_rows(t, mode)
    back = q.float() * s
    # per element: half a step of the row's grid (int8), or 2^-4 relative + the subnormal floor (fp8 e4m3)
    amax = t.abs().amax(dim=1, keepdim=True)
    if mode == "int8":
        assert ((back - t).abs() <= 0.5 * amax / 127 * (1 + 1e-4)).all()
    else:
        assert ((back - t).abs() <= bound * t.abs() + amax * 2.0 ** -9 / 448 * 8 + 1e-6).all()
    assert float((back - t).norm() / t.norm()) < (0.03 if mode == "fp8" else 0.01)


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_linear_forward_and_input_gradient_close_to_fp32(mode):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g) / 128 ** 0.5
    b = torch.randn(96, generator=g)
    x = torch.randn(3, 40, 128, generator=g, requires_grad=True)
    ref = torch.nn.functional.linear(x, w, b)
    gy = torch.randn(ref.shape, generator=g)
    gx_ref, = torch.autograd.grad(ref, x, gy)
    wq, sw = quantise_weight(w, mode)
    y = linear_8bit(x, wq, sw, b, mode, emulate=True)
    gx, = torch.autograd.grad(y, x, gy)
    tol = 0.06 if mode == "fp8" else 0.012
    assert float((y - ref).detach().norm() / ref.detach().norm()) < tol
    assert float((gx - gx_ref).norm() / gx_ref.norm()) < tol


def _lora_grads(model, inputs, lora):
    for _, a in lora.items():
        a.A.grad = a.B.grad = None
    out = model(**inputs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    (out * weights).sum().backward()
    return torch.cat([torch.cat([a.A.grad.flatten(), a.B.grad.flatten()]) for _, a in lora.items()])


@pytest.mark.parametrize("mode, min_cos", [("fp8", 0.99), ("int8", 0.999)])
def test_lora_gradients_agree_with_full_precision_base_and_undo_is_exact(comfy, mode, min_cos):
    from ugpum.inplace_guard import guard_inplace_residuals
    model = cm.build_tiny_flux2(torch.float32, hidden=128, heads=2, exact_rope=False)
    inputs = {k: (v.float() if v.is_floating_point() else v) for k, v in cm.flux2_inputs(model).items()}
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "blocks." in n]
    lora = attach_lora(model, targets, rank=4, alpha=4.0, seed=0)
    g = torch.Generator().manual_seed(5)
    for _, a in lora.items():
        with torch.no_grad():
            a.B.copy_(0.05 * torch.randn(a.B.shape, generator=g))
    guard_inplace_residuals(model, include_rms=False)
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    ref = _lora_grads(model, inputs, lora)
    undo = use_8bit_base(model, targets, mode, log=lambda *_: None, emulate=True, keep="cpu")
    got = _lora_grads(model, inputs, lora)
    undo()
    cos = float(torch.nn.functional.cosine_similarity(ref, got, dim=0))
    assert cos >= min_cos, f"{mode}: cosine {cos:.5f}"
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)      # exact weights back
    assert torch.equal(_lora_grads(model, inputs, lora), ref)       # and the exact eager path


def test_refusals_are_one_sentence():
    lin = torch.nn.Sequential(torch.nn.Linear(16, 16)).requires_grad_(False)
    with pytest.raises(BaseComputeError) as err:
        use_8bit_base(lin, ["0"], "fp8", log=lambda *_: None)
    msg = str(err.value)
    assert "fp8" in msg and "cpu" in msg and msg.count(". ") == 0 and "\n" not in msg
    assert supports("bf16", "cpu") is None
    with pytest.raises(ValueError):
        use_8bit_base(lin, ["0"], "fp4", log=lambda *_: None)
    trainable = torch.nn.Sequential(torch.nn.Linear(16, 16))
    with pytest.raises(ValueError, match="trainable"):
        use_8bit_base(trainable, ["0"], "int8", log=lambda *_: None, emulate=True)


def test_planner_factors():
    assert base_compute_factors("bf16") == (2.0, 1.0)
    for mode in ("fp8", "int8"):
        weight_bytes, speed = base_compute_factors(mode)
        assert 1.0 <= weight_bytes < 1.01 and speed >= 1.0

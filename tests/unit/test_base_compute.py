"""8-bit compute for the frozen base Linears (ugpum.compute.base_compute): numerics through the fp32 reference
emulation on the CPU (the same quantisation the fp8/int8 kernels get on a GPU), LoRA gradients on a tiny
ComfyUI FLUX.2 against the full-precision base, exact undo, refusals in one sentence."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import comfy_models as cm  # noqa: E402
from support.lora_pair import output_and_gradients, two_linears_with_lora  # noqa: E402
from ugpum.compute.base_compute import (BaseComputeError, quantise_weight, quantised_linear,  # noqa: E402
                                        supports, use_base_compute)
from ugpum.compute.modes import mode_named  # noqa: E402
from ugpum.compute.lora import attach_lora  # noqa: E402


@pytest.mark.parametrize("mode, bound", [("fp8", 0.0625), ("int8", 1 / 127)])
def test_row_quantisation_error_is_bounded(mode, bound):
    t = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, 64)[:, None]
    q, s = mode_named(mode).quantise_rows(t)
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
    y = quantised_linear(x, wq, sw, b, mode, emulate=True)
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
    from ugpum.compute.inplace_guard import guard_inplace_residuals
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
    undo = use_base_compute(model, targets, mode, log=lambda *_: None, emulate=True, keep="cpu")
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
        use_base_compute(lin, ["0"], "fp8", log=lambda *_: None)
    msg = str(err.value)
    assert "fp8" in msg and "cpu" in msg and msg.count(". ") == 0 and "\n" not in msg
    assert supports("bf16", "cpu") is None
    with pytest.raises(ValueError):
        use_base_compute(lin, ["0"], "fp4", log=lambda *_: None)
    trainable = torch.nn.Sequential(torch.nn.Linear(16, 16))
    with pytest.raises(ValueError, match="trainable"):
        use_base_compute(trainable, ["0"], "int8", log=lambda *_: None, emulate=True)


def test_the_planner_forecasts_each_mode_from_the_h200_measurements():
    """Forecast s/step on the H200 preset for klein 9B at 1024², per mode, within 15 % of the steps
    bench/speed.py measured (bench/results/speed.md), and 8-bit holds the base at 1 byte a weight. (Its int8
    step ran torch._int_mm, which no run takes any more: int8's forecast is held to the Triton GEMM's H100 rows in
    tests/unit/test_calibration.py.)"""
    from ugpum.arch import get_spec
    from ugpum.planning.devices import resolve_devices
    from ugpum.planning.plan import plan_training
    from ugpum.train.config import TrainConfig
    spec = get_spec("flux2-klein-9b")
    devices = resolve_devices(["h200"], spec)
    measured = {("off", "bf16"): 0.6085, ("on", "bf16"): 0.4677, ("on", "fp8"): 0.3667}
    eager = plan_training(spec, devices, TrainConfig(model=spec.id, compile="off").workload())
    for (compiled, mode), seconds in measured.items():
        plan = plan_training(spec, devices, TrainConfig(model=spec.id, compile=compiled, base_compute=mode).workload())
        # the preset's matmul rate (680 TFLOP/s) is a little below what the bench's H200 measured, so the
        # ratio to the eager bf16 step is what must hold
        ratio = plan.predicted_step_s / eager.predicted_step_s
        assert abs(ratio / (seconds / measured[("off", "bf16")]) - 1) < 0.15, (compiled, mode, ratio)
    for mode in ("fp8", "int8"):
        plan = plan_training(spec, devices, TrainConfig(model=spec.id, base_compute=mode).workload())
        assert plan.stages[0].detail_gib["weights"] < 0.6 * eager.stages[0].detail_gib["weights"]


def _tiny_file(tmp_path, comfy):
    """tiny-flux2 with random fp32 weights, written as a safetensors file the way a checkpoint is."""
    from safetensors.torch import save_file

    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    spec = get_spec("tiny-flux2")
    model = build_random(spec, torch.float32, 0)
    path = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    targets = [f"{b.path}.{lin.path}" for b in spec.blocks for lin in b.linears]
    return spec, path, targets


def _loaded(spec, path, dtype=torch.float32, on_weight=None):
    from comfy_bridge import build_meta
    from ugpum.placement.place import Layout, place
    model = build_meta(spec, dtype).requires_grad_(False)
    place(model, Layout({}, "cpu", "cpu", spec.tail_modules), checkpoint=path, dtype=dtype, on_weight=on_weight)
    return model


def _forward(model, spec):
    g = torch.Generator().manual_seed(7)
    x, ctx = torch.randn(1, 128, 4, 4, generator=g), torch.randn(1, 16, spec.context_dim, generator=g)
    with torch.no_grad():
        return model(x, torch.tensor([0.6]), ctx, transformer_options={})


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_quantising_each_layer_as_it_loads_equals_quantising_after_and_drops_every_original(tmp_path, comfy, mode):
    from ugpum.compute.base_compute import QuantiseAsLoaded
    spec, path, targets = _tiny_file(tmp_path, comfy)
    after = _loaded(spec, path)
    use_base_compute(after, targets, mode, log=lambda *_: None, emulate=True, keep="none")
    hook = QuantiseAsLoaded(targets, mode, emulate=True)
    streamed = _loaded(spec, path, on_weight=hook)
    assert hook.layers == len(targets) and f"{len(targets)} frozen Linears" in hook.summary()
    assert all(streamed.get_submodule(t).weight.numel() == 0 for t in targets)   # no bf16/fp32 copy stays
    assert torch.equal(_forward(streamed, spec), _forward(after, spec))


def test_a_scaled_fp8_weight_is_quantised_with_its_scale(tmp_path, comfy):
    """A weight stored as fp8 with a scale (ComfyUI applies it through the op's weight_function) must be
    quantised as the weight it stands for, not as the raw fp8 numbers."""
    spec, path, targets = _tiny_file(tmp_path, comfy)
    model = _loaded(spec, path, dtype=torch.float8_e4m3fn)     # the loader scales each matrix into fp8's range
    assert any(getattr(model.get_submodule(t), "weight_function", None) for t in targets)
    reference = _forward(model, spec)
    use_base_compute(model, targets, "int8", log=lambda *_: None, emulate=True, keep="none")
    got = _forward(model, spec)
    assert float((got - reference).norm() / reference.norm()) < 0.05


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_an_8bit_kernel_adds_the_lora_as_the_hook_did(monkeypatch, compiled, mode):
    """Handed to an 8-bit base whose kernel takes it (`takes_lora`), the LoRA's up-projection is added by the
    matmul itself, to the hook's values and gradients (x's, A's, B's); the hook stands aside only there, and
    undoing the base or removing the LoRA gives the hook back."""
    from ugpum.compute import base_compute
    from ugpum.compute.kernels.matmul_8bit import scaled_mm_8bit
    from ugpum.compute.modes import fp8, int8
    model, lora, x = two_linears_with_lora()

    def run():
        return output_and_gradients(model, lora, x, compiled)

    undo = use_base_compute(model, ["0", "2"], mode, log=lambda *_: None, emulate=True, keep="device")
    assert lora.hand_to_kernels(model, base_compute.takes_lora) == 0          # the kernel off: the hook adds it
    want = run()
    monkeypatch.setattr(int8 if mode == "int8" else fp8, "TRITON_KERNEL", scaled_mm_8bit)
    monkeypatch.setattr(int8, "LORA_IN_KERNEL", True)
    assert lora.hand_to_kernels(model, base_compute.takes_lora) == 2
    calls, real = [], base_compute._matmul
    monkeypatch.setattr(base_compute, "_matmul", lambda *a: calls.append(a[7:]) or real(*a))
    got = run()
    assert sum(isinstance(c[0], tuple) for c in calls if c) == 2        # both matmuls took the LoRA (run or traced)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    undo()                                                                    # the exact base: the hook adds it
    exact = model(x)
    lora.remove()
    assert "ugpum_lora_in_kernel" not in vars(model[0])
    assert not torch.allclose(model(x), exact)                                # (the LoRA was there before)


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_a_kept_transpose_feeds_the_backward_and_changes_no_gradient(monkeypatch, mode):
    """`KEEP_TRANSPOSED`: each quantised layer keeps Wq^T, the backward reads it instead of transposing Wq, the input
    gradient is the same to the bit, and undo drops it."""
    from ugpum.compute import base_compute
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 16)).requires_grad_(False)
    x, weights = torch.randn(2, 20, 32), torch.linspace(-1, 1, 2 * 20 * 16).view(2, 20, 16)

    def input_grad():
        xi = x.clone().requires_grad_()
        (model(xi) * weights).sum().backward()
        return xi.grad

    def quantised():
        return use_base_compute(model, ["0", "2"], mode, log=lambda *_: None, emulate=True, keep="device")
    undo = quantised()
    assert "ugpum_wq_t" not in model[0]._buffers
    want = input_grad()
    undo()
    monkeypatch.setattr(base_compute, "KEEP_TRANSPOSED", True)
    undo = quantised()
    kept = model[0].ugpum_wq_t
    assert kept.is_contiguous() and torch.equal(kept.float(), model[0].ugpum_wq.t().float())
    assert torch.equal(input_grad(), want)
    kept.copy_(torch.zeros_like(kept.float()))                 # x's gradient comes through layer 0's kept copy only
    assert input_grad().abs().max() == 0
    undo()
    assert "ugpum_wq_t" not in model[0]._buffers and model[0].weight.numel() == 32 * 48

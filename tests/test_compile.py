"""Regional compilation (ugpum.compile) on ComfyUI's own tiny FLUX.2 and Wan 2.1, on the CPU (inductor's
C++ backend): LoRA gradients with and without compilation agree with per-block checkpointing and the
in-place guard on; the LoRA hooks and guard hooks are traced into each block's graph (no graph breaks);
one compiled graph serves every block of a class; a second shape recompiles within the bound; auto on
the CPU says once why it runs eagerly.

ComfyUI picks its attention by device; on the CPU it picks split attention, which asks psutil for free
memory (a graph break). The tests use `attention_pytorch`, what ComfyUI runs on NVIDIA GPUs."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support import comfy_models as cm  # noqa: E402
from ugpum.checkpointing import checkpoint_blocks  # noqa: E402
from ugpum.compile import compile_blocks, compile_stats  # noqa: E402
from ugpum.inplace_guard import guard_inplace_residuals  # noqa: E402
from ugpum.lora import attach_lora  # noqa: E402


@pytest.fixture
def pytorch_attention(comfy, monkeypatch):
    import comfy.ldm.flux.math as flux_math
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan_model
    monkeypatch.setattr(flux_math, "optimized_attention", attention.attention_pytorch)
    monkeypatch.setattr(wan_model, "optimized_attention", attention.attention_pytorch)
    torch._dynamo.reset()


def _setup(family: str, compiled: bool):
    if family == "flux2":
        model = cm.build_tiny_flux2(torch.float32, depth=2, depth_single=2, exact_rope=False)
        paths = ["double_blocks.0", "double_blocks.1", "single_blocks.0", "single_blocks.1"]
    else:
        model = cm.build_tiny_wan(torch.float32, num_layers=2, exact_rope=False)
        paths = ["blocks.0", "blocks.1"]
    targets = [f"{p}.{n}" for p in paths for n, m in model.get_submodule(p).named_modules()
               if isinstance(m, torch.nn.Linear)]
    lora = attach_lora(model, targets, rank=4, alpha=4.0, seed=0)
    g = torch.Generator().manual_seed(5)
    for _, a in lora.items():                      # B != 0 so that A gets a gradient too
        with torch.no_grad():
            a.B.copy_(0.1 * torch.randn(a.B.shape, generator=g))
    guard_inplace_residuals(model, include_rms=False)
    logged = []
    undo_compile = compile_blocks(model, paths, "on" if compiled else "off", logged.append)
    undo_ckpt = checkpoint_blocks(model, paths)
    return model, lora, logged, lambda: (undo_ckpt(), undo_compile())


def _inputs(family, model, h=4, w=4):
    make = cm.flux2_inputs if family == "flux2" else cm.wan_inputs
    return {k: (v.float() if v.is_floating_point() else v)
            for k, v in make(model, height_latent=h, width_latent=w).items()}


def _grads(model, lora, inputs):
    for _, a in lora.items():
        a.A.grad = a.B.grad = None
    out = model(**inputs, transformer_options={})
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * weights).sum().backward()
    return [p.grad.clone() for _, a in lora.items() for p in (a.A, a.B)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux2", "wan"])
def test_compiled_lora_gradients_match_eager_and_shapes_recompile_within_bound(family, pytorch_attention):
    eager_model, eager_lora, _, _ = _setup(family, compiled=False)
    model, lora, logged, undo = _setup(family, compiled=True)
    assert len(logged) == 1 and "compiled" in logged[0]
    before = compile_stats()
    for shape in ((4, 4), (4, 6), (4, 8)):
        ref = _grads(eager_model, eager_lora, _inputs(family, eager_model, *shape))
        got = _grads(model, lora, _inputs(family, model, *shape))
        worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))
        assert worst < 1e-4, f"{family} {shape}: compiled LoRA gradients off by {worst:.2e}"
        if shape == (4, 4):
            first = compile_stats()
        if shape == (4, 6):
            second = compile_stats()
    after = compile_stats()
    classes = 2 if family == "flux2" else 1
    assert after.graph_breaks == before.graph_breaks, "LoRA/guard hooks must be traced into the block graph"
    # one graph per block class shared by its blocks, plus one for a first block whose input needs no grad
    # (FLUX.2 double_blocks.0 is fed by frozen img_in/txt_in: requires_grad is part of the guard)
    assert first.graphs - before.graphs <= 2 * classes
    # a second shape: at most one (automatic-dynamic) recompile of each graph; a third: none at all
    assert second.graphs - first.graphs <= first.graphs - before.graphs
    assert after.graphs == second.graphs, "a third shape must reuse the dynamic graphs"
    undo()
    assert all("forward" not in model.get_submodule(p).__dict__ for p in
               (["double_blocks.0", "single_blocks.0"] if family == "flux2" else ["blocks.0"]))


def test_auto_on_cpu_runs_eagerly_and_says_why_once(comfy):
    model = cm.build_tiny_wan(torch.float32, num_layers=1, exact_rope=False)
    logged = []
    undo = compile_blocks(model, ["blocks.0"], "auto", logged.append)
    assert len(logged) == 1 and "eager" in logged[0]
    assert "forward" not in model.blocks[0].__dict__
    undo()
    assert compile_blocks(model, ["blocks.0"], "off", logged.append)() is None and len(logged) == 1
    with pytest.raises(ValueError):
        compile_blocks(model, ["blocks.0"], "sometimes", logged.append)


def test_compile_must_come_before_checkpointing(comfy):
    model = cm.build_tiny_wan(torch.float32, num_layers=1, exact_rope=False)
    undo = checkpoint_blocks(model, ["blocks.0"])
    with pytest.raises(ValueError, match="before checkpoint_blocks"):
        compile_blocks(model, ["blocks.0"], "on", lambda *_: None)
    undo()

"""Regional compilation (ugpum.compute.compile) on ComfyUI's own tiny FLUX.2 and Wan 2.1, on the CPU (inductor's
C++ backend): LoRA gradients with and without compilation agree with per-block checkpointing and the
in-place guard on; the LoRA hooks and guard hooks are traced into each block's graph (no graph breaks);
one compiled graph serves every block of a class; a second shape recompiles within the bound; auto on
the CPU says once why it runs eagerly. Compiled blocks train without per-block checkpointing too (issue 23:
FLUX.2 crashed in backward), in fp32 against eager fp32 and fp64, and in bf16 under autocast as on the GPU.

ComfyUI picks its attention by device; on the CPU it picks split attention, which asks psutil for free
memory (a graph break). The tests use `attention_pytorch`, what ComfyUI runs on NVIDIA GPUs; one test keeps a
graph break on purpose: such a block class runs eagerly (compiled in pieces it crashed like issue 23)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import comfy_models as cm  # noqa: E402
from ugpum.compute.recompute import recompute_blocks  # noqa: E402
from ugpum.compute.compile import compile_blocks, compile_stats  # noqa: E402
from ugpum.compute.inplace_guard import guard_inplace_residuals  # noqa: E402
from ugpum.compute.lora import attach_lora  # noqa: E402


@pytest.fixture
def pytorch_attention(comfy, monkeypatch):
    import comfy.ldm.flux.math as flux_math
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan_model
    monkeypatch.setattr(flux_math, "optimized_attention", attention.attention_pytorch)
    monkeypatch.setattr(wan_model, "optimized_attention", attention.attention_pytorch)
    torch._dynamo.reset()


def _setup(family: str, compiled: bool, checkpointing: bool = True, dtype=torch.float32, keep_attention=False):
    if family == "flux2":
        model = cm.build_tiny_flux2(dtype, depth=2, depth_single=2, exact_rope=dtype == torch.float64)
        paths = ["double_blocks.0", "double_blocks.1", "single_blocks.0", "single_blocks.1"]
    else:
        model = cm.build_tiny_wan(dtype, num_layers=2, exact_rope=dtype == torch.float64)
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
    undo_ckpt = recompute_blocks(model, paths, keep_attention=keep_attention) if checkpointing else (lambda: None)
    return model, lora, logged, lambda: (undo_ckpt(), undo_compile())


def _inputs(family, model, h=4, w=4, dtype=torch.float32):
    make = cm.flux2_inputs if family == "flux2" else cm.wan_inputs
    return {k: (v.to(dtype) if v.is_floating_point() else v)
            for k, v in make(model, height_latent=h, width_latent=w).items()}


def _grads(model, lora, inputs, autocast=False):
    for _, a in lora.items():
        a.A.grad = a.B.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**inputs, transformer_options={})
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (out.double() * weights).sum().backward()
    return [p.grad.double() for _, a in lora.items() for p in (a.A, a.B)]


def _worst(got, ref):
    """Worst relative difference over the adapters' tensors (each against its reference's largest entry)."""
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))


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
        worst = _worst(got, ref)
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
    undo = recompute_blocks(model, ["blocks.0"])
    with pytest.raises(ValueError, match="before recompute_blocks"):
        compile_blocks(model, ["blocks.0"], "on", lambda *_: None)
    undo()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux2", "wan"])
def test_compiled_blocks_train_with_and_without_checkpointing(family, pytorch_attention):
    """Issue 23: compiled FLUX.2 blocks without checkpointing crashed in backward ("modified by an inplace
    operation ... CopyBackwards"). LoRA gradients of compiled blocks, with and without per-block
    checkpointing, against eager fp32 and eager fp64 (the guarded fp64 path is checked against finite
    differences in test_inplace_guard.py)."""
    ref64_model, ref64_lora, _, _ = _setup(family, compiled=False, checkpointing=False, dtype=torch.float64)
    ref64 = _grads(ref64_model, ref64_lora, _inputs(family, ref64_model, dtype=torch.float64))
    eager_model, eager_lora, _, _ = _setup(family, compiled=False, checkpointing=False)
    eager = _grads(eager_model, eager_lora, _inputs(family, eager_model))
    assert _worst(eager, ref64) < 1e-4
    for checkpointing in (False, True):
        model, lora, logged, undo = _setup(family, compiled=True, checkpointing=checkpointing)
        assert "compiled" in logged[0]
        got = _grads(model, lora, _inputs(family, model))
        off_eager, off_fp64 = _worst(got, eager), _worst(got, ref64)
        assert off_eager < 1e-4 and off_fp64 < 1e-4, (f"{family}, checkpointing {checkpointing}: compiled LoRA "
                                                      f"gradients off eager by {off_eager:.2e}, fp64 by {off_fp64:.2e}")
        undo()


def _self_attention_forwards(profile) -> int:
    """Self-attention forward kernels (queries and keys of one length) in a profile of the CPU."""
    return sum(1 for e in profile.events() if e.name == "aten::_scaled_dot_product_flash_attention_for_cpu"
               and e.input_shapes and e.input_shapes[0][-2] == e.input_shapes[1][-2])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux2", "wan"])
def test_recompute_keeping_attention_skips_its_forward_and_trains_the_same(family, pytorch_attention):
    """`keep_attention` (the plan's `attention_kept`): each recomputed block keeps its self-attention output, so
    backward runs no self-attention forward again (compiled: selective checkpointing inside the block's graph,
    counted in a profile); the LoRA gradients are eager's, compiled and eager alike."""
    eager_model, eager_lora, _, _ = _setup(family, compiled=False, checkpointing=False)
    ref = _grads(eager_model, eager_lora, _inputs(family, eager_model))
    blocks = 4 if family == "flux2" else 2
    for compiled in (True, False):
        for keep in (False, True):
            model, lora, logged, undo = _setup(family, compiled=compiled, keep_attention=keep)
            _grads(model, lora, _inputs(family, model))                 # (compiles)
            with torch.profiler.profile(record_shapes=True) as profile:
                got = _grads(model, lora, _inputs(family, model))
            assert _worst(got, ref) < 1e-4, f"compiled {compiled}, attention kept {keep}"
            if compiled:
                assert not any("does not compile" in line for line in logged)
                assert _self_attention_forwards(profile) == blocks * (1 if keep else 2), f"attention kept {keep}"
            undo()


def _min_cosine(got, ref):
    return min(float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)) for a, b in zip(got, ref))


@pytest.mark.slow
def test_compiled_flux2_in_bf16_under_autocast_without_checkpointing(pytorch_attention):
    """The GPU's dtype path on the CPU: bf16 weights under bf16 autocast (issue 23's crash was in bf16 on the
    H200). Compiled blocks, with and without checkpointing, are as close to fp64 as eager bf16 is."""
    ref_model, ref_lora, _, _ = _setup("flux2", compiled=False, checkpointing=False, dtype=torch.float64)
    ref = _grads(ref_model, ref_lora, _inputs("flux2", ref_model, dtype=torch.float64))
    eager_model, eager_lora, _, _ = _setup("flux2", compiled=False, checkpointing=False, dtype=torch.bfloat16)
    eager = _grads(eager_model, eager_lora, _inputs("flux2", eager_model, dtype=torch.bfloat16), autocast=True)
    for checkpointing in (False, True):
        model, lora, _, undo = _setup("flux2", compiled=True, checkpointing=checkpointing, dtype=torch.bfloat16)
        got = _grads(model, lora, _inputs("flux2", model, dtype=torch.bfloat16), autocast=True)
        # bf16 rounding alone moves single entries of a 64-wide model by ~15 % (eager: 0.155, cosine 0.992)
        assert _worst(got, ref) < 1.5 * _worst(eager, ref), f"checkpointing {checkpointing}"
        assert _min_cosine(got, ref) > 0.98, f"checkpointing {checkpointing}"
        undo()


@pytest.mark.slow
def test_a_block_that_is_not_one_graph_runs_eagerly_and_trains(comfy, monkeypatch):
    """A FLUX.2 block that Dynamo would split (an op it cannot trace inside attention, as ComfyUI's split
    attention on the CPU asks psutil for free memory) must not be compiled in pieces: a later piece adds in
    place into a tensor an earlier piece saved for backward. The class runs eagerly, said once, and trains
    like eager with and without checkpointing, and with the recompute keeping the attention."""
    import comfy.ldm.flux.math as flux_math
    import comfy.ldm.modules.attention as attention

    def attention_dynamo_cannot_trace(*args, **kwargs):
        torch._dynamo.graph_break()
        return attention.attention_pytorch(*args, **kwargs)

    monkeypatch.setattr(flux_math, "optimized_attention", attention_dynamo_cannot_trace)
    torch._dynamo.reset()
    eager_model, eager_lora, _, _ = _setup("flux2", compiled=False, checkpointing=False)
    eager = _grads(eager_model, eager_lora, _inputs("flux2", eager_model))
    for checkpointing, keep in ((False, False), (True, False), (True, True)):
        model, lora, logged, undo = _setup("flux2", compiled=True, checkpointing=checkpointing, keep_attention=keep)
        got = _grads(model, lora, _inputs("flux2", model))
        assert _worst(got, eager) < 1e-6, f"checkpointing {checkpointing}, attention kept {keep}"
        assert sorted(line.split()[1] for line in logged[1:]) == ["DoubleStreamBlock", "SingleStreamBlock"]
        assert all("does not compile as one graph" in line for line in logged[1:])
        undo()


@pytest.mark.slow
def test_cli_trains_compiled_flux2_without_checkpointing(tmp_path, capsys, pytorch_attention):
    """Issue 23 as the user met it: `train --compile on` with `checkpointing = false` in a --config TOML, the
    blocks really compiled (no eager fallback), LoRA written and finite."""
    from safetensors.torch import load_file
    from ugpum.commands import main
    config = tmp_path / "no_checkpointing.toml"
    config.write_text("checkpointing = false\n")
    out = tmp_path / "run"
    before = compile_stats()
    dataset = Path(__file__).resolve().parents[2] / "demo_datasets" / "loranne"
    assert main(["train", "--profile", "tiny-flux2", "--config", str(config), "--dataset", str(dataset),
                 "--devices", "cpu", "--steps", "2", "--sample-every", "0", "--compile", "on", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert json.loads((out / "plan.json").read_text())["workload"]["checkpointing"] is False
    assert "blocks compiled as 2 shared graph(s)" in said and "does not compile as one graph" not in said
    assert compile_stats().graphs > before.graphs
    lora = load_file(str(out / "ugpum_lora.safetensors"))
    assert lora and all(torch.isfinite(t).all() for t in lora.values())

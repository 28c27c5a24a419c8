"""Planned recompute trains the same LoRA whichever blocks are recomputed (issue 23, item 3): tiny FLUX.2
trainings on the CPU, split over two CPU devices with a pipelined schedule and compiled blocks, with
recompute all, none, and auto under a host memory cap that leaves the planner room for some blocks'
activations but not all (the planner's own choice, through the real `train`). Recomputation repeats the
same fp32 forward, so the LoRAs agree to rounding. The engine refuses the 8-bit base on the CPU, so that
combination is checked one level down: the int8 reference emulation with none, every other and every block
recomputed gives the same LoRA gradients (eager: compiling the emulation takes minutes on the CPU)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from comfy_bridge import find_comfyui
from support import comfy_models as cm
from ugpum.planning import devices as ugpum_devices
from ugpum.compute.base_compute import use_base_compute
from ugpum.compute.recompute import recompute_blocks
from ugpum.compute.inplace_guard import guard_inplace_residuals
from ugpum.compute.lora import attach_lora
from ugpum.commands.train import run_training
from ugpum.train.config import load_config
from ugpum.train.prepare import plan_for

pytestmark = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")
DATASET = Path(__file__).resolve().parents[2] / "demo_datasets" / "loranne"


@pytest.fixture
def pytorch_attention(comfy, monkeypatch):
    """ComfyUI's attention on NVIDIA GPUs: its CPU choice asks psutil for memory, which splits a compiled graph."""
    import comfy.ldm.flux.math as flux_math
    import comfy.ldm.modules.attention as attention
    monkeypatch.setattr(flux_math, "optimized_attention", attention.attention_pytorch)
    torch._dynamo.reset()


def cfg(recompute: str):
    return load_config("tiny-flux2", overrides=dict(
        dataset=str(DATASET), trigger="loranne", sample_every=0, steps=2, grad_accum=2, devices=["cpu", "cpu"],
        schedule="gpipe", compile="on", recompute=recompute))


def cap_host_memory(monkeypatch, free_bytes: int) -> None:
    """The host reports `free_bytes` available: the CPU devices' budget the planner sees."""
    total, _ = ugpum_devices.host_memory()
    monkeypatch.setattr(ugpum_devices, "host_memory", lambda: (total, free_bytes))


def mixed_cap(monkeypatch) -> int:
    """A host memory size under which recompute = auto keeps some blocks' activations but not all, found
    by bisection through the planner itself (no block swapped)."""
    config = cfg("auto")
    n = len(plan_for(config).block_paths)
    low, high = 0, 2**30
    for _ in range(60):
        mid = (low + high) // 2
        cap_host_memory(monkeypatch, mid)
        try:
            plan = plan_for(config)
        except ValueError:                      # (too little to plan at all)
            low = mid
            continue
        kept = len(plan.kept_activations)
        if plan.offloaded_blocks or kept == 0:
            low = mid
        elif kept == n:
            high = mid
        else:
            return mid
    raise AssertionError("no host memory size leaves auto some blocks but not all")


@pytest.mark.slow
def test_all_none_and_a_planned_mix_train_the_same_lora(tmp_path, monkeypatch, pytorch_attention):
    loras, kept, said = {}, {}, {}
    for recompute in ("all", "none", "auto"):
        if recompute == "auto":
            mixed_cap(monkeypatch)
        lines = said[recompute] = []
        result = run_training(cfg(recompute), tmp_path / recompute,
                              log=lambda *a, out=lines: out.append(" ".join(map(str, a))))
        loras[recompute], kept[recompute] = load_file(str(result.lora_path)), result.plan.kept_activations
    n = len(result.plan.block_paths)
    assert kept["all"] == [] and kept["none"] == list(range(n)) and 0 < len(kept["auto"]) < n, kept
    assert f"recompute auto: {len(kept['auto'])} of {n} blocks keep their activations" in "\n".join(said["auto"])
    # the engine wrapped for recompute as many blocks as each plan recomputes
    for recompute, line in (("all", "recompute: every block recomputed in backward"),
                            ("none", f"recompute: 0 of {n} blocks recomputed in backward"),
                            ("auto", f"recompute: {n - len(kept['auto'])} of {n} blocks recomputed in backward")):
        assert [x for x in said[recompute] if x.startswith("recompute: ")][0].startswith(line), said[recompute]
    assert result.plan.schedule == "gpipe" and len([s for s in result.plan.stages if s.blocks[1] > s.blocks[0]]) == 2
    reference = loras["all"]
    assert reference and all(torch.isfinite(t).all() for t in reference.values())
    for recompute in ("none", "auto"):
        assert loras[recompute].keys() == reference.keys()
        for key, t in reference.items():
            torch.testing.assert_close(loras[recompute][key], t, rtol=1e-6, atol=1e-9, msg=f"{recompute}: {key}")


def test_emulated_int8_base_with_mixed_checkpointing_gives_the_same_gradients(comfy, monkeypatch):
    """ComfyUI's FLUX.2 blocks (double ones called by keyword) with none, some or all recomputed, and all with
    their inputs held in host memory (`inputs_on_host`: on the CPU a copy, the path the GPU's pinned one takes)."""
    from ugpum.compute import recompute
    monkeypatch.setattr(recompute, "HOST_MIN_BYTES", 0)
    model = cm.build_tiny_flux2(torch.float32, depth=2, depth_single=2, exact_rope=False)
    paths = ["double_blocks.0", "double_blocks.1", "single_blocks.0", "single_blocks.1"]
    targets = [f"{p}.{n}" for p in paths for n, m in model.get_submodule(p).named_modules()
               if isinstance(m, torch.nn.Linear)]
    lora = attach_lora(model, targets, rank=4, alpha=4.0, seed=0)
    with torch.no_grad():                                   # B != 0 so that A gets a gradient too
        for _, a in lora.items():
            a.B.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(5))
    said = []
    use_base_compute(model, targets, "int8", said.append, emulate=True)
    guard_inplace_residuals(model, include_rms=False)
    inputs = cm.flux2_inputs(model, height_latent=4, width_latent=4)
    weights = None
    grads = {}
    for name, recomputed, on_host in (("none", [], False), ("every other", paths[::2], False), ("all", paths, False),
                                      ("all, inputs on host", paths, True)):
        undo = recompute_blocks(model, recomputed, inputs_on_host=on_host, device_types=("cpu",))
        for _, a in lora.items():
            a.A.grad = a.B.grad = None
        out = model(**inputs, transformer_options={})
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)) if weights is None else weights
        (out * weights).sum().backward()
        grads[name] = [p.grad.clone() for _, a in lora.items() for p in (a.A, a.B)]
        undo()
    assert any("int8 (emulated" in line for line in said), said
    assert all(g.abs().max() > 0 for g in grads["all"])
    for name in ("none", "every other", "all, inputs on host"):
        for got, ref in zip(grads[name], grads["all"]):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-9, msg=name)

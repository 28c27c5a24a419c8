"""8-bit base compute with block swap (issue 24): a swapped block's 8-bit weights and scales live in host
memory and stream into the GPU slots, and training computes exactly what it does with every block resident.

The tiny FLUX.2 is streamed from a real safetensors file onto the meta-built ComfyUI module, quantised as
each weight arrives, placed by a plan that swaps some of its blocks, and trained one LoRA step. On the CPU
the 8-bit path runs its fp32 reference emulation (the same quantisation, the same bookkeeping); on CUDA the
real 8-bit kernels (fp8 where the GPU has fp8 tensor cores, int8 on Ampere and newer).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from support import comfy_models as cm

CUDA = torch.cuda.is_available()


pytestmark = pytest.mark.usefixtures("one_thread")     # (tests/conftest.py)


def _tiny_file(tmp_path):
    from safetensors.torch import save_file

    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    spec = get_spec("tiny-flux2")
    model = build_random(spec, torch.float32, 0)
    path = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return spec, path


def _plan(spec, device: str, swapped: list[int], stages: int = 1, schedule: str = "gpipe",
          keep_resident: bool = False):
    """A plan over `stages` devices (blocks split evenly, micro-batches in `schedule`) whose swap tier is
    `swapped` (block indices, each on the stage that holds it), the resident blocks keeping their
    activations where `keep_resident` (as recompute = auto plans with room): the planner's own Plan object."""
    from ugpum.arch import Workload
    from ugpum.planning.devices import Device
    from ugpum.planning.plan import make_plan
    w = Workload(width=64, height=64, text_tokens=6, recompute="all", rank=2)
    n = len(spec.blocks)
    split = [n // stages + (k < n % stages) for k in range(stages)]
    plan = make_plan(spec, [Device(f"big{k}", device, 2 ** 40, 2 ** 40, 1.0, 20.0, "unknown") for k in range(stages)],
                     w, grad_accum=2, split=split)
    for stage in plan.stages:
        stage.offloaded = [i for i in swapped if stage.blocks[0] <= i < stage.blocks[1]]
        stage.kept_activations = [i for i in range(*stage.blocks) if i not in swapped] if keep_resident else []
    plan.offloaded_blocks, plan.schedule = list(swapped), schedule
    return plan


def _trained_step(spec, path, device: str, mode: str, swapped: list[int], emulate: bool, stages: int = 1,
                  schedule: str = "gpipe", keep_resident: bool = False):
    """Place the tiny model by a plan over `stages` devices swapping `swapped`, 8-bit as it loads; the
    forward/backward of two micro-batches in `schedule`'s order (ugpum.placement.pipeline.accumulate, as training runs
    them). Returns (LoRA gradients by name, the placement, the quantiser)."""
    from comfy_bridge import build_meta
    from ugpum.compute.base_compute import QuantiseAsLoaded
    from ugpum.compute.recompute import recompute_blocks
    from ugpum.compute.inplace_guard import guard_inplace_residuals
    from ugpum.compute.lora import attach_lora, lora_targets
    from ugpum.placement.pipeline import accumulate
    from ugpum.placement.place import place_by_plan
    from ugpum.train.prepare import recomputed_paths
    block_paths = [b.path for b in spec.blocks]
    targets = lora_targets(block_paths, [b.linears for b in spec.blocks])
    model = build_meta(spec, torch.bfloat16 if device != "cpu" else torch.float32).requires_grad_(False)
    quantise = QuantiseAsLoaded(targets, mode, emulate=emulate)
    plan = _plan(spec, device, swapped, stages, schedule, keep_resident)
    placement = place_by_plan(model, plan, spec.tail_modules, str(path),
                              dtype=torch.bfloat16 if device != "cpu" else torch.float32, on_weight=quantise)
    lora = attach_lora(model, targets, rank=2, alpha=2.0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():                  # B starts at zero: random, so A gets gradients too
        for _, a in lora.items():
            a.B.copy_(0.3 * torch.randn(a.B.shape, generator=g).to(a.B))
    guard_inplace_residuals(model, include_rms=False)
    recomputed = recomputed_paths(plan, spec, block_paths)                  # what training checkpoints
    assert recomputed == ([spec.blocks[i].path for i in sorted(swapped)] if keep_resident else block_paths)
    recompute_blocks(model, recomputed)

    def micro_batch(seed: int) -> dict:
        inputs = cm.flux2_inputs(model, height_latent=4, width_latent=4, txt_tokens=6, seed=seed)
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}

    def loss(inputs: dict) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device != "cpu"):
            return model(**inputs).float().square().mean() / 2
    accumulate(loss, [micro_batch(0), micro_batch(1)], schedule, placement.layout, model)
    grads = {p: torch.cat([a.A.grad.flatten(), a.B.grad.flatten()]) for p, a in lora.items()}
    return grads, placement, quantise


def _swapped_bytes(placement) -> dict[str, torch.dtype]:
    """dtype -> bytes the swap keeps in host memory."""
    out: dict = {}
    for handle in placement.swaps:
        for block in handle.blocks:
            for e in block.entries:
                out[e.dtype] = out.get(e.dtype, 0) + e.nbytes
    return out


def _check_equal_and_8bit(spec, path, device, mode, emulate, stages: int = 1, schedule: str = "gpipe",
                          keep_resident: bool = False):
    """Swapped vs resident 8-bit blocks: the same LoRA gradients; with `keep_resident` the swapped run
    recomputes only its swapped blocks (recompute auto's choice), the resident one every block."""
    n = len(spec.blocks)
    swapped = [0, n // 2, n - 1]
    resident, _, _ = _trained_step(spec, path, device, mode, [], emulate, stages, schedule)
    streamed, placement, quantise = _trained_step(spec, path, device, mode, swapped, emulate, stages, schedule,
                                                  keep_resident)
    assert len(placement.layout.stage_blocks()) == stages
    assert quantise.layers == sum(len(b.linears) for b in spec.blocks)
    assert resident.keys() == streamed.keys()
    for name, g in resident.items():
        assert torch.equal(g, streamed[name]), name          # the same bytes in, the same arithmetic
    assert any(float(g.abs().sum()) > 0 for g in resident.values())
    held = _swapped_bytes(placement)
    q_dtype = torch.float8_e4m3fn if mode == "fp8" else torch.int8
    linear_bytes = sum(lin.in_features * lin.out_features for i in swapped for lin in spec.blocks[i].linears)
    assert held.get(q_dtype, 0) == linear_bytes                 # 1 byte a weight streams, not 2 or 4
    wide = [e for h in placement.swaps for b in h.blocks for e in b.entries if len(e.shape) == 2]
    assert wide and all(e.dtype == q_dtype for e in wide)       # no matrix streams in its wide dtype too
    for unit in (spec.blocks[i].path for i in swapped):
        for _, a in ((p, a) for p, a in placement.model.named_modules() if p.startswith(unit + ".")):
            w = getattr(a, "weight", None)
            if w is not None and hasattr(type(a), "_ugpum_base_class"):
                assert w.device.type == torch.device(device).type and w.numel() == 0
    placement.undo("meta")


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_swapped_8bit_blocks_give_the_resident_8bit_gradients_on_cpu(tmp_path, comfy, mode):
    spec, path = _tiny_file(tmp_path)
    _check_equal_and_8bit(spec, path, "cpu", mode, emulate=True)


@pytest.mark.parametrize("mode,schedule", [("fp8", "gpipe"), ("int8", "1f1b")])
def test_swapped_8bit_blocks_split_over_two_devices_and_pipelined_give_the_resident_gradients(tmp_path, comfy, mode,
                                                                                              schedule):
    """The split and pipelined paths: two stages (two CPU devices), each swapping some of its blocks, two
    micro-batches running through both stages at once in the schedule's order; once with every block
    recomputed in backward, once with only the swapped ones (the resident blocks keep their activations)."""
    spec, path = _tiny_file(tmp_path)
    _check_equal_and_8bit(spec, path, "cpu", mode, emulate=True, stages=2, schedule=schedule)
    _check_equal_and_8bit(spec, path, "cpu", mode, emulate=True, stages=2, schedule=schedule, keep_resident=True)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with 8-bit tensor cores")
@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_swapped_8bit_blocks_give_the_resident_8bit_gradients_on_cuda(tmp_path, comfy, mode):
    from ugpum.compute.base_compute import supports
    if supports(mode, "cuda:0"):
        pytest.skip(supports(mode, "cuda:0"))
    spec, path = _tiny_file(tmp_path)
    _check_equal_and_8bit(spec, path, "cuda:0", mode, emulate=False)
    _check_equal_and_8bit(spec, path, "cuda:0", mode, emulate=False, stages=2, schedule="1f1b")   # two stages, one GPU


def test_a_model_not_streamed_from_its_file_is_refused_by_name(comfy):
    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    from ugpum.compute.base_compute import QuantiseAsLoaded
    from ugpum.placement.place import place_by_plan
    spec = get_spec("tiny-flux2")
    model = build_random(spec, torch.float32, 0).requires_grad_(False)
    hook = QuantiseAsLoaded([f"{spec.blocks[0].path}.{spec.blocks[0].linears[0].path}"], "int8", emulate=True)
    with pytest.raises(ValueError, match="meta device"):
        place_by_plan(model, _plan(spec, "cpu", [0]), spec.tail_modules, on_weight=hook)
    assert dataclasses.is_dataclass(_plan(spec, "cpu", [0]))

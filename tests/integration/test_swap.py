"""Block swap (ugpum.placement.swap): the same gradients as without swap, never more than `slots` offloaded
blocks materialised at once, and remove() gives the model back as it was.

Runs with device 'cpu' for both the host copies and the compute (plain copies, no streams), which
exercises the whole bookkeeping; with CUDA present the toy tests also run on cuda:0.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from support import comfy_models as cm
from support.toy_dit import ToyDiT
from ugpum.compute.recompute import recompute_blocks
from ugpum.compute.inplace_guard import guard_inplace_residuals
from ugpum.placement.place import Layout
from ugpum.placement.place import place_with_swap, swap_plan
from ugpum.placement.swap import install_swap
from ugpum.compute.lora import attach_lora

DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
REL = 1e-6


pytestmark = pytest.mark.usefixtures("one_thread")     # (tests/conftest.py)


# ------------------------------------------------------------------------------------------------
# helpers

def _lora(model, targets, seed=0):
    lora = attach_lora(model, targets, rank=2, alpha=2.0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():                  # B starts at zero: make it random so A gets gradients too
        for _, a in lora.items():
            a.A.copy_(torch.randn(a.A.shape, generator=g, dtype=torch.float64).to(a.A))
            a.B.copy_(0.3 * torch.randn(a.B.shape, generator=g, dtype=torch.float64).to(a.B))
    return lora


def _toy_targets(model):
    return [f"{b}.{lin}" for b in model.block_paths() for lin in ("qkv", "proj")]


def _step(model, lora, inputs, weights):
    """Loss and gradients of every LoRA parameter and of the first input."""
    for _, a in lora.items():
        a.zero_grad(set_to_none=True)
    first = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs[0]
    first.grad = None
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    loss = (out.double() * weights.to(out.device)).sum()
    loss.backward()
    grads = {f"{p}.{n}": t.grad.detach().cpu().clone() for p, a in lora.items() for n, t in a.named_parameters()}
    grads["<input>"] = first.grad.detach().cpu().clone()
    return loss.item(), grads


def _assert_same(got, ref):
    loss, grads = got
    ref_loss, ref_grads = ref
    assert loss == pytest.approx(ref_loss, rel=REL)
    assert grads.keys() == ref_grads.keys()
    for k, g in grads.items():
        err = ((g - ref_grads[k]).norm() / ref_grads[k].norm().clamp_min(1e-30)).item()
        assert err < REL, f"{k}: relative error {err:.2e}"


def _swapped_tensors(model, paths):
    return {p: [t for t in list(model.get_submodule(p).parameters()) + list(model.get_submodule(p).buffers())
                if not t.requires_grad] for p in paths}


class MaterialisedProbe:
    """Counts, at every leaf-module call inside the offloaded blocks (forward and its
    recomputation) and after every load, how many offloaded blocks hold any weight."""

    def __init__(self, model, paths, handle=None):
        self.tensors = _swapped_tensors(model, paths)
        self.max = 0
        self.calls = 0
        self.unacquired_uses = 0         # a weight used while its slot may already be refilled
        self._handles = []
        for pos, p in enumerate(paths):
            for m in model.get_submodule(p).modules():
                if not list(m.children()):
                    self._handles.append(m.register_forward_pre_hook(
                        lambda *_, pos=pos: self._check(handle, pos)))
        if handle is not None:               # also right after each copy into a slot
            load = handle._load

            def checked_load(block, slot):
                load(block, slot)
                self._check(None, None)
            handle._load = checked_load

    def count(self) -> int:
        return sum(any(t.numel() > 0 for t in ts) for ts in self.tensors.values())

    def _check(self, handle=None, pos=None):
        self.calls += 1
        self.max = max(self.max, self.count())
        if handle is not None and pos is not None:
            slot = handle.blocks[pos].slot
            self.unacquired_uses += slot is None or not slot.in_use

    def remove(self):
        for h in self._handles:
            h.remove()


def _toy_inputs(device, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 8, generator=g).to(device, dtype).requires_grad_(True)
    t = torch.randn(2, 4, generator=g).to(device, dtype)
    w = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    return (x, t), w


# ------------------------------------------------------------------------------------------------
# toy DiT (no ComfyUI)

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ckpt", [True, False], ids=["checkpointing", "no-checkpointing"])
@pytest.mark.parametrize("slots,which", [(2, "all"), (1, "all"), (3, "all"), (2, "some")])
def test_toy_swap_gives_the_same_gradients(device, ckpt, slots, which):
    torch.manual_seed(0)
    ref = ToyDiT(n_double=3, n_single=3).to(device)
    model = copy.deepcopy(ref)
    paths = model.block_paths()
    offloaded = paths if which == "all" else [paths[1], paths[2], paths[4]]   # resident ones between
    ref_lora = _lora(ref, _toy_targets(ref))
    if ckpt:
        recompute_blocks(ref, paths)
        recompute_blocks(model, paths)
    handle = install_swap(model, offloaded, device, slots=slots)
    lora = _lora(model, _toy_targets(model))            # after install: adapters on the device
    assert all(a.A.device.type == torch.device(device).type for _, a in lora.items())
    probe = MaterialisedProbe(model, offloaded, handle)
    inputs, w = _toy_inputs(device)

    for step in range(3):                                # later steps start with blocks in the slots
        loads = handle.stats["loads"]
        _assert_same(_step(model, lora, inputs, w), _step(ref, ref_lora, inputs, w))
        if step and which == "all":
            # the blocks left in the slots at either end are not copied again
            assert handle.stats["loads"] - loads == 2 * (len(offloaded) - slots)
    assert probe.calls > 0
    assert probe.max <= slots
    assert probe.count() <= slots
    assert probe.unacquired_uses == 0
    assert handle.stats["forced"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_toy_swap_in_inference_and_remove_restores_the_model(device):
    torch.manual_seed(2)
    model = ToyDiT().to(device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    devices = {k: v.device for k, v in model.state_dict().items()}
    (x, t), _ = _toy_inputs(device)
    with torch.no_grad():
        expected = model(x, t)
    handle = install_swap(model, model.block_paths()[1:], device, slots=2)
    probe = MaterialisedProbe(model, model.block_paths()[1:])
    assert probe.count() <= 2 and handle.host_bytes > 0
    with torch.no_grad():
        torch.testing.assert_close(model(x, t), expected, rtol=0, atol=0)
        torch.testing.assert_close(model(x, t), expected, rtol=0, atol=0)
    assert probe.max <= 2
    probe.remove()
    handle.remove()
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in after.items():
        assert v.device == devices[k] and torch.equal(v, before[k]), k
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    torch.testing.assert_close(model(x, t).detach(), expected, rtol=0, atol=0)


def test_an_unloaded_block_fails_loudly_and_trainable_params_stay():
    model = ToyDiT()
    model.single_blocks[2].proj.bias.requires_grad_(True)      # a trained tensor inside a block
    for n, p in model.named_parameters():
        if "single_blocks.2.proj.bias" not in n:
            p.requires_grad_(False)
    paths = model.block_paths()
    handle = install_swap(model, paths, "cpu", slots=1, freeze=False)
    assert model.single_blocks[2].proj.bias.numel() == 16                # resident, not swapped
    assert model.double_blocks[0].qkv.weight.numel() == 0                # not loaded: empty placeholder
    with pytest.raises(RuntimeError):
        model.double_blocks[0].qkv(torch.randn(1, 16))                   # bypasses the block's hooks
    handle.remove()
    assert model.double_blocks[0].qkv.weight.shape == (48, 16)


def test_swap_refuses_tensors_shared_outside_the_offloaded_blocks():
    model = ToyDiT()
    model.double_blocks[1].proj.weight = model.double_blocks[0].proj.weight
    with pytest.raises(ValueError, match="shared"):
        install_swap(model, ["double_blocks.0"], "cpu")


def test_place_with_swap_streams_offloaded_blocks_to_host(tmp_path):
    torch.manual_seed(3)
    ref = ToyDiT()
    path = tmp_path / "toy.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    with torch.device("meta"):
        model = ToyDiT()
    blocks = {p: "cpu" for p in model.block_paths()}
    layout = Layout(blocks, first="cpu", last="cpu", tail_modules=("final_layer",))
    offloaded = model.block_paths()[2:5]
    sp = place_with_swap(model, layout, offloaded, checkpoint=path)
    assert not any(p.is_meta for p in model.parameters())
    assert sp.swaps[0].materialised() == []                      # nothing loaded until a forward
    (x, t), _ = _toy_inputs("cpu")
    torch.testing.assert_close(model(x, t), ref(x, t))
    assert len(sp.swaps[0].materialised()) <= 2
    sp.undo()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    torch.testing.assert_close(model(x, t), ref(x, t))


# ------------------------------------------------------------------------------------------------
# ComfyUI's FLUX.2 (tiny, fp32, CPU): LoRA + per-block checkpointing + in-place guard



def _tiny_spec():
    from ugpum.arch import get_spec
    return get_spec("tiny-flux2")


def _tiny_flux2(spec):
    n_double = sum(b.kind == "double" for b in spec.blocks)
    return cm.build_tiny_flux2(dtype=torch.float32, depth=n_double, depth_single=len(spec.blocks) - n_double,
                               hidden=spec.hidden, heads=spec.heads, context_dim=spec.context_dim, seed=5)


def _plan_with_some_swap(spec):
    """A plan for a device just too small for the tiny model: the planner picks what to swap."""
    from ugpum.arch import Workload
    from ugpum.planning.devices import Device
    from ugpum.planning.plan import HEADROOM, StageCosts, make_plan
    w = Workload(width=64, height=64, text_tokens=6, checkpointing=True, rank=2)
    dev = Device("tiny", "cpu", 2 ** 40, 2 ** 40, 1.0, 20.0, "unknown")
    n = len(spec.blocks)
    ev = StageCosts(spec, [dev], w, 1)
    full = sum(ev._memory(0, 0, n, ()).values())
    floor = sum(ev._memory(0, 0, n, tuple(range(n))).values())
    free = int((full + floor) / 2 / (1 - HEADROOM))          # a budget halfway between the two
    small = dataclasses.replace(dev, total_bytes=free, free_bytes=free)
    plan = make_plan(spec, [small], w)
    assert 0 < len(plan.offloaded_blocks) < len(spec.blocks)
    return plan


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["plan+checkpointing", "all+checkpointing", "all+no-checkpointing"])
def test_flux2_swap_gives_the_same_gradients(comfy, mode, device):
    from ugpum.compute.lora import lora_targets
    spec = _tiny_spec()
    block_paths = [b.path for b in spec.blocks]
    targets = lora_targets(block_paths, [b.linears for b in spec.blocks])
    ref, model = _tiny_flux2(spec).to(device), _tiny_flux2(spec).to(device)
    if mode.startswith("plan"):
        layout, offloaded = swap_plan(_plan_with_some_swap(spec), ["cpu"], spec.tail_modules)
    else:
        offloaded = block_paths
    for m in (ref, model):
        guard_inplace_residuals(m, include_rms=False)
        if mode.endswith("+checkpointing"):
            recompute_blocks(m, block_paths)
    ref_lora = _lora(ref, targets)
    handle = install_swap(model, offloaded, device, slots=2)
    lora = _lora(model, targets)
    probe = MaterialisedProbe(model, offloaded, handle)
    inputs = cm.flux2_inputs(model, height_latent=4, width_latent=4, txt_tokens=6)
    inputs["x"].requires_grad_(True)
    with torch.no_grad():
        w = torch.randn(ref(**inputs).shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for _ in range(2):
        _assert_same(_step(model, lora, inputs, w), _step(ref, ref_lora, inputs, w))
    assert probe.max <= 2 and probe.unacquired_uses == 0 and handle.stats["forced"] == 0
    lora.remove()
    handle.remove()
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert a.device == b.device and torch.equal(a, b), n


def test_flux2_swap_keeps_the_inplace_error_without_guard(comfy):
    """Swap must not hide autograd's in-place check (it goes through saved-tensor hooks)."""
    from ugpum.compute.lora import lora_targets
    spec = _tiny_spec()
    block_paths = [b.path for b in spec.blocks]
    model = _tiny_flux2(spec)
    handle = install_swap(model, block_paths, "cpu", slots=2)
    _lora(model, lora_targets(block_paths, [b.linears for b in spec.blocks]))
    inputs = cm.flux2_inputs(model, height_latent=4, width_latent=4, txt_tokens=6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(**inputs).sum().backward()
    handle.remove()

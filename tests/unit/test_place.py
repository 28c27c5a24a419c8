"""Placement and routing: the split model computes the same gradients as the unsplit one."""
import copy

import pytest
import torch
from safetensors.torch import save_file

from support.toy_dit import ToyDiT
from ugpum.placement.place import Layout, place
from ugpum.placement.stream_load import CheckpointMismatch

DEVICE_PAIRS = [("cpu", "cpu")]
if torch.cuda.is_available():
    DEVICE_PAIRS += [("cuda:0", "cpu"), ("cpu", "cuda:0")]


def _layout(model: ToyDiT, devices, cut: int) -> Layout:
    paths = model.block_paths()
    blocks = {p: devices[0] if i < cut else devices[1] for i, p in enumerate(paths)}
    return Layout(blocks, first=devices[0], last=devices[1], tail_modules=("final_layer",))


def _loss_and_grads(model, x, t):
    model.zero_grad(set_to_none=True)
    out = model(x, t)
    loss = (out.double() ** 2).mean() if out.device.type == "cpu" else (out.cpu().double() ** 2).mean()
    loss.backward()
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


@pytest.mark.parametrize("devices", DEVICE_PAIRS)
@pytest.mark.parametrize("cut", [1, 3, 5])
def test_split_gradients_equal_unsplit(devices, cut):
    dtype = torch.float32 if devices == ("cpu", "cpu") else torch.float64
    torch.manual_seed(0)
    ref = ToyDiT().to(dtype)
    split = copy.deepcopy(ref)
    x, t = torch.randn(2, 5, 8, dtype=dtype), torch.randn(2, 4, dtype=dtype)
    ref_loss, ref_grads = _loss_and_grads(ref, x, t)

    placement = place(split, _layout(split, devices, cut))
    assert split.double_blocks[0].qkv.weight.device.type == torch.device(devices[0]).type
    assert split.final_layer.weight.device.type == torch.device(devices[1]).type
    loss, grads = _loss_and_grads(split, x, t)

    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name, g in grads.items():
        err = (g - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-30)
        assert err < 1e-6, f"{name}: relative error {err:.2e}"
    placement.undo()
    assert all(not m._forward_pre_hooks for m in split.modules())


def test_undo_restores_devices_and_output():
    torch.manual_seed(1)
    model = ToyDiT()
    x, t = torch.randn(1, 5, 8), torch.randn(1, 4)
    before = model(x, t)
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    placement = place(model, _layout(model, ("cpu", dev), 2))
    placement.undo()
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    torch.testing.assert_close(model(x, t), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type to copy to")
def test_shared_inputs_cross_once_per_device():
    torch.manual_seed(2)
    model = ToyDiT()
    placement = place(model, _layout(model, ("cpu", "cuda:0"), 3))
    x, t = torch.randn(1, 5, 8, requires_grad=True), torch.randn(1, 4)
    model(x, t)
    hidden = 1 * 5 * 16 * 4
    mod = 2 * 1 * 1 * 16 * 4
    pe = 16 * 4
    # one hidden-state crossing into block 3 and one into final_layer's device (same device: none),
    # the modulation and RoPE once for cuda:0, however many blocks read them there
    assert placement.router.cache.copied_bytes == hidden + mod + pe


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_stream_from_safetensors_into_meta_model(tmp_path, prefix):
    torch.manual_seed(3)
    ref = ToyDiT()
    path = tmp_path / "toy.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    with torch.device("meta"):
        model = ToyDiT()
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    place(model, _layout(model, ("cpu", dev), 4), checkpoint=path, key_prefix=prefix)
    assert not any(p.is_meta for p in model.parameters())
    assert model.single_blocks[2].qkv.weight.device.type == torch.device(dev).type
    x, t = torch.randn(1, 5, 8), torch.randn(1, 4)
    torch.testing.assert_close(model(x, t).cpu(), ref(x, t))


def test_stream_rejects_a_checkpoint_of_another_size(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({k: v.contiguous() for k, v in ToyDiT(dim=32).state_dict().items()}, str(path))
    with torch.device("meta"):
        model = ToyDiT(dim=16)
    with pytest.raises(CheckpointMismatch, match="other.safetensors.*another model size"):
        place(model, _layout(model, ("cpu", "cpu"), 2), checkpoint=path)


@pytest.mark.parametrize("model_id", ["tiny-flux2", "tiny-wan"])
@pytest.mark.parametrize("devices", DEVICE_PAIRS)
def test_comfyui_models_split_gradients_equal_unsplit(model_id, devices):
    """ComfyUI's own FLUX.2 / Wan classes with LoRA, in-place guard and block checkpointing. The
    unsplit reference runs on the first device: ComfyUI computes RoPE tables in fp32 even in an fp64
    model, and CUDA's and the CPU's fp32 sin/cos differ in the last bit."""
    from comfy_bridge import build_random, find_comfyui
    if find_comfyui() is None:
        pytest.skip("needs ComfyUI's model classes")
    from ugpum.arch import get_spec
    from ugpum.compute.recompute import recompute_blocks
    from ugpum.compute.inplace_guard import guard_inplace_residuals
    from ugpum.compute.lora import attach_lora, lora_targets
    spec = get_spec(model_id)
    paths = [b.path for b in spec.blocks]
    dtype = torch.float32 if devices == ("cpu", "cpu") else torch.float64

    def grads(split: bool):
        model = build_random(spec, dtype, seed=5)
        if not split:
            model.to(devices[0])
        else:
            layout = Layout({p: devices[0] if i < len(paths) // 2 else devices[1] for i, p in enumerate(paths)},
                            first=devices[0], last=devices[1], tail_modules=spec.tail_modules)
            place(model, layout)
        guard_inplace_residuals(model, include_rms=False)
        recompute_blocks(model, paths)
        lora = attach_lora(model, lora_targets(paths, [b.linears for b in spec.blocks]), 4, 4, dtype=dtype, seed=1)
        with torch.no_grad():
            for _, a in lora.items():
                seed = torch.Generator().manual_seed(hash(a.A.shape) % 1000)    # drawn on the CPU, wherever B lives
                a.B.copy_(0.05 * torch.randn(a.B.shape, generator=seed, dtype=dtype))
        g = torch.Generator().manual_seed(0)
        if spec.family == "wan":
            x = torch.randn(1, 16, 1, 4, 4, generator=g, dtype=dtype)
        else:
            x = torch.randn(1, 128, 4, 4, generator=g, dtype=dtype)
        ctx = torch.randn(1, 6, spec.context_dim, generator=g, dtype=dtype)
        t = torch.tensor([0.4 * spec.timestep_scale], dtype=dtype)
        out = model(x.to(devices[0]), t.to(devices[0]), ctx.to(devices[0]), transformer_options={})
        (out.cpu().double() ** 2).mean().backward()
        return {p: (a.A.grad.cpu().clone(), a.B.grad.cpu().clone()) for p, a in lora.items()}

    ref, got = grads(False), grads(True)
    assert ref.keys() == got.keys() and len(ref) == sum(len(b.linears) for b in spec.blocks)
    for path in ref:
        for r, g_ in zip(ref[path], got[path]):
            err = (g_ - r).norm() / r.norm().clamp_min(1e-30)
            assert err < 1e-6, f"{path}: relative error {err:.2e}"


def test_comfyui_dynamic_vram_still_builds_every_weight(comfy, monkeypatch):
    """Newest ComfyUI turns DynamicVRAM (comfy-aimdo) on for NVIDIA GPUs; its layers then get weights
    only from load_state_dict (None before), so the DiT ugpum streams into had no weights to fill
    (found on the H200 with ComfyUI 0.33 in GPU mode). The flag is set here as ComfyUI sets it."""
    import sys
    from comfy_bridge import build_meta, build_random
    from ugpum.arch import get_spec
    from ugpum.compute.inplace_guard import guard_inplace_residuals
    dynamic = sys.modules.get("comfy.memory_management")
    if not hasattr(dynamic, "aimdo_enabled"):
        pytest.skip("this ComfyUI has no DynamicVRAM (COMFYUI_PATH=<newest ComfyUI> runs this)")
    monkeypatch.setattr(dynamic, "aimdo_enabled", True)
    spec = get_spec("tiny-flux2")
    model = build_meta(spec, torch.float32)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight is not None and m.weight.is_meta for m in linears)
    assert dynamic.aimdo_enabled is True                       # ComfyUI's setting is left as it was
    model = build_random(spec, torch.float32, seed=5)
    guard_inplace_residuals(model, include_rms=False)         # as training does
    out = model(torch.randn(1, 128, 4, 4), torch.tensor([400.0]), torch.randn(1, 6, spec.context_dim),
                transformer_options={})
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

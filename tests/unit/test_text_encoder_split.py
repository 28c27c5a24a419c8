"""A text encoder split over devices for caption caching encodes exactly as it does whole, and is
left as it was afterwards; the plan and its text cover the step (ugpum/planning/text_encoder_split.py).

The encoders are ComfyUI's own classes at tiny width with random weights: FLUX.2 [dev]'s Mistral
(40 layers, hidden states of layers 10/20/30), Wan's umT5 and FLUX.1/SD3's T5 (relative position bias
computed by the first layer and handed down the others), klein's Qwen3 where this ComfyUI has it.
"""
import pytest
import torch

from ugpum.arch import get_spec
from ugpum.arch.base import Workload
from ugpum.arch.text_encoders import ARCHS
from ugpum.planning.forecast import format_plan
from ugpum.planning.devices import Device, parse_device_specs
from ugpum.planning.plan import HEADROOM, make_plan
from ugpum.planning.text_encoder_split import (EncoderSizes, find_layers, plan_text_encoder, slots_for_devices,
                                      split_text_encoder)

DEVICE_PAIRS = [("cpu", "cpu")]
if torch.cuda.is_available():
    DEVICE_PAIRS += [("cuda:0", "cpu"), ("cpu", "cuda:0")]
TINY_LLAMA = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1)
TINY_T5 = dict(d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=6)


def device(label: str, torch_device: str, budget: float) -> Device:
    """A device whose planning budget (`plan.budget_bytes`) is `budget` bytes."""
    free = int(budget / (1 - HEADROOM)) + 1
    return Device(label, torch_device, free, free, tflops_bf16=1.0, host_gbps=1.0, link="host")


def two_stage_devices(module, devices, cut: int) -> list[Device]:
    """The first device holds the embeddings and exactly `cut` layers, the second the rest."""
    sizes = EncoderSizes.from_module(module)
    first = sizes.rest_bytes + sum(sizes.layer_bytes[:cut]) + sizes.working_bytes(cut)
    return [device("A", devices[0], first), device("B", devices[1], 100 * sizes.total_bytes)]


def comfy_clip(te_model, tokenizer=None):
    """ComfyUI's CLIP object around `te_model`, as CLIPLoader makes it (no_init only skips building a
    tokenizer from the real files; tests that tokenize pass one)."""
    import comfy.model_patcher
    import comfy.sd
    clip = comfy.sd.CLIP(no_init=True)
    cpu = torch.device("cpu")
    clip.cond_stage_model, clip.tokenizer = te_model, tokenizer
    clip.patcher = comfy.model_patcher.ModelPatcher(te_model, load_device=cpu, offload_device=cpu)
    clip.layer_idx, clip.tokenizer_options, clip.use_clip_schedule, clip.apply_hooks_to_conds = None, {}, False, None
    return clip


def tiny_mistral():
    """FLUX.2 [dev]'s text encoder class (Mistral Small 3.x, all 40 layers) at width 64."""
    import comfy.text_encoders.flux as flux
    from comfy_bridge import init_random
    te = flux.Flux2TEModel(device="cpu", dtype=torch.float32,
                           model_options={"mistral3_24b_model_config": dict(TINY_LLAMA, num_hidden_layers=40)})
    init_random(te, 0)
    return te, {"mistral3_24b": [[(1, 1.0)] + [(t, 1.0) for t in (17, 250, 3, 99, 42, 7, 123)] + [(0, 1.0)] * 3]}


def tiny_umt5():
    import comfy.text_encoders.wan as wan
    from comfy_bridge import init_random
    te = wan.WanT5Model(device="cpu", dtype=torch.float32,
                        model_options={"umt5xxl_model_config": dict(TINY_T5, vocab_size=300)})
    init_random(te, 1)
    return te, {"umt5xxl": [[(t, 1.0) for t in (55, 3, 211, 9, 77, 140, 1)] + [(0, 1.0)] * 4]}


def state(module):
    return {n: t.detach().clone() for n, t in module.state_dict().items()}


def assert_restored(clip, before):
    te = clip.cond_stage_model
    after = state(te)
    assert after.keys() == before.keys()
    for name, t in before.items():
        assert after[name].device == t.device and torch.equal(after[name], t), name
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in te.modules())
    assert all("forward" not in vars(m) for m in te.modules())
    assert "load_model" not in vars(clip) and clip.patcher.load_device == torch.device("cpu")


def loaded_by_comfyui(clip) -> bool:
    """Whether ComfyUI's memory manager has loaded the encoder (onto its one device)."""
    import comfy.model_management as mm
    return any(lm.model is clip.patcher for lm in mm.current_loaded_models)


def unload_from_comfyui():
    """Unload every model ComfyUI holds. The reference encodes load the encoder onto the CPU (its
    patcher's device), which ComfyUI 0.3.75's unload_all_models leaves when a GPU is its device."""
    import comfy.model_management as mm
    mm.unload_all_models()
    mm.free_memory(1e30, torch.device("cpu"))


def assert_same(out, ref, devices):
    if devices == ("cpu", "cpu"):
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# ComfyUI's encoders split over two devices


@pytest.mark.parametrize("devices", DEVICE_PAIRS)
@pytest.mark.parametrize("cut", [15])           # between the taps 10 | 20 | 30: they lie on both devices
def test_mistral_split_encodes_as_whole(comfy, devices, cut):
    te, tokens = tiny_mistral()
    clip = comfy_clip(te)
    ref = clip.encode_from_tokens(tokens, return_dict=True)
    unload_from_comfyui()                                 # as the trainer does before caching
    before = state(te)
    layers_path, layers = find_layers(te)
    assert layers_path.endswith("transformer.model.layers") and len(layers) == 40

    with split_text_encoder(clip, two_stage_devices(te, devices, cut)) as te_plan:
        assert te_plan.mode == "split"
        assert [(s.label, s.layers) for s in te_plan.stages] == [("A", (0, cut)), ("B", (cut, 40))]
        assert layers[cut - 1].self_attn.q_proj.weight.device.type == torch.device(devices[0]).type
        assert layers[cut].self_attn.q_proj.weight.device.type == torch.device(devices[1]).type
        assert all(len(layer._forward_pre_hooks) == 1 for layer in layers)        # the router's
        out = clip.encode_from_tokens(tokens, return_dict=True)
        again = clip.encode_from_tokens(tokens, return_dict=True)
        assert not loaded_by_comfyui(clip)                  # ComfyUI's loader left the layers where they are
        assert layers[cut].self_attn.q_proj.weight.device.type == torch.device(devices[1]).type

    assert out["cond"].shape == ref["cond"].shape == (1, 11, 3 * 64)    # layers 10, 20, 30 side by side
    assert out["cond"].device == ref["cond"].device
    assert_same(out["cond"], ref["cond"], devices)
    assert_same(again["cond"], ref["cond"], devices)
    assert torch.equal(out["attention_mask"].cpu(), ref["attention_mask"].cpu())
    assert_restored(clip, before)
    assert torch.equal(clip.encode_from_tokens(tokens), ref["cond"]) and loaded_by_comfyui(clip)   # as before


@pytest.mark.parametrize("devices", DEVICE_PAIRS)
@pytest.mark.parametrize("layer_idx", [None, -3])    # the last layer, and an intermediate one
def test_umt5_split_encodes_as_whole(comfy, devices, layer_idx):
    te, tokens = tiny_umt5()
    clip = comfy_clip(te)
    clip.clip_layer(layer_idx)
    ref = clip.encode_from_tokens(tokens)
    before = state(te)
    assert find_layers(te)[0].endswith("transformer.encoder.block")
    with split_text_encoder(clip, two_stage_devices(te, devices, 2)) as te_plan:
        assert [s.layers for s in te_plan.stages] == [(0, 2), (2, 6)]
        out = clip.encode_from_tokens(tokens)
    assert_same(out, ref, devices)
    assert out[0, -4:].abs().max() == 0                  # padding zeroed through the attention mask
    assert_restored(clip, before)


def test_klein_qwen3_split_encodes_as_whole(comfy):
    import comfy.text_encoders.flux as flux
    if not hasattr(flux, "klein_te"):
        pytest.skip("this ComfyUI has no FLUX.2 [klein] text encoder (the newest one has: COMFYUI_PATH)")
    from comfy_bridge import init_random
    te = flux.klein_te(model_type="qwen3_8b")(device="cpu", dtype=torch.float32, model_options={
        "qwen3_8b_model_config": dict(TINY_LLAMA, num_hidden_layers=36)})
    init_random(te, 2)
    tokens = {"qwen3_8b": [[(t, 1.0) for t in (12, 250, 31, 4, 77, 150)]]}
    clip = comfy_clip(te)
    ref = clip.encode_from_tokens(tokens)
    before = state(te)
    with split_text_encoder(clip, two_stage_devices(te, ("cpu", "cpu"), 20)) as te_plan:
        assert te_plan.mode == "split"
        out = clip.encode_from_tokens(tokens)
    assert out.shape == (1, 6, 3 * 64) and torch.equal(out, ref)
    assert_restored(clip, before)


def test_an_encoder_that_fits_or_cannot_fit_is_left_alone(comfy, caplog):
    te, tokens = tiny_mistral()
    clip = comfy_clip(te)
    ref = clip.encode_from_tokens(tokens)
    total = EncoderSizes.from_module(te).total_bytes
    for devices, mode in (([device("big", "cpu", 10 * total)], "one"),
                          ([device("small", "cpu", total / 5)] * 2, "stream")):
        with split_text_encoder(clip, devices) as te_plan:
            assert te_plan.mode == mode
            assert all(not m._forward_pre_hooks for m in te.modules())         # ComfyUI's usual path
            assert torch.equal(clip.encode_from_tokens(tokens), ref)
    assert "streaming its layers from host memory" in caplog.text


def test_an_encoder_with_patches_stays_with_comfyui(comfy):
    """A CLIP carrying a LoRA: only ComfyUI's loader applies its patches, so it is not split."""
    te, tokens = tiny_mistral()
    clip = comfy_clip(te)
    key = next(k for k in te.state_dict() if k.endswith("layers.3.mlp.down_proj.weight"))
    clip.add_patches({key: (torch.full_like(te.state_dict()[key], 0.01),)}, 1.0)
    with split_text_encoder(clip, two_stage_devices(te, ("cpu", "cpu"), 15)) as te_plan:
        assert te_plan.mode == "stream" and "patches" in te_plan.reason
        assert all(not m._forward_pre_hooks for m in te.modules())


def test_an_encoder_under_comfyuis_dynamic_vram_stays_with_comfyui(comfy):
    """Newest ComfyUI's DynamicVRAM (on by default for NVIDIA GPUs) maps the encoder's weights and
    streams them itself: it already handles an encoder larger than the GPU, so it is not split."""
    te, _ = tiny_mistral()
    clip = comfy_clip(te)
    clip.patcher.is_dynamic = lambda: True                 # as ComfyUI's ModelPatcherDynamic answers
    with split_text_encoder(clip, two_stage_devices(te, ("cpu", "cpu"), 15)) as te_plan:
        assert te_plan.mode == "stream" and "DynamicVRAM" in te_plan.reason
        assert all(not m._forward_pre_hooks for m in te.modules())


def test_no_layer_list_is_a_clear_error():
    with pytest.raises(ValueError, match="Linear: no transformer layer list found"):
        find_layers(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------
# Caption caching through ComfyEncoders: split at the first caption, whole again at release


def tiny_wan_vae():
    import comfy.ldm.wan.vae
    import comfy.sd
    module = comfy.ldm.wan.vae.WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                      temperal_downsample=[False, True, True])
    g = torch.Generator().manual_seed(0)
    return comfy.sd.VAE(sd={k: torch.randn(v.shape, generator=g) * 0.1 for k, v in module.state_dict().items()})


def test_caption_caching_splits_once_and_releases(comfy):
    """A T5 (its first layer computes the position bias the others reuse) with ComfyUI's own T5
    tokenizer, through the encoders the trainer caches captions with."""
    import comfy.sd1_clip as sd1
    import comfy.text_encoders.sd3_clip as sd3
    from comfy_bridge import ComfyEncoders, init_random
    te = sd1.SD1ClipModel(device="cpu", dtype=torch.float32, name="t5xxl", clip_model=sd3.T5XXLModel,
                          model_options={"t5xxl_model_config": dict(TINY_T5, vocab_size=32128)})
    init_random(te, 3)
    clip = comfy_clip(te, sd1.SD1Tokenizer(clip_name="t5xxl", tokenizer=sd3.T5XXLTokenizer))
    vae = tiny_wan_vae()
    captions = ["loranne, a red bar grows", "two words"]
    before = state(te)
    wan = get_spec("tiny-wan")
    big = device("big", "cpu", 100 * EncoderSizes.from_module(te).total_bytes)
    whole = ComfyEncoders(clip, vae, wan, devices=[big])
    ref = whole.encode_text(captions)
    layers = find_layers(te)[1]

    enc = ComfyEncoders(clip, vae, wan, devices=two_stage_devices(te, ("cpu", "cpu"), 3))
    first = enc.encode_text(captions[:1])
    assert all(layer._forward_hooks for layer in layers)                  # still split for the next caption
    second = enc.encode_text(captions[1:])
    assert torch.equal(first[0], ref[0, : first.shape[1]]) and torch.equal(second[0], ref[1, : second.shape[1]])
    with torch.no_grad():
        enc.encode_images(torch.zeros(1, 3, 32, 32))                     # the VAE gets the devices back
    assert not any(layer._forward_hooks for layer in layers)
    enc.encode_text(captions[:1])
    assert all(layer._forward_hooks for layer in layers)
    enc.release()
    assert_restored(clip, before)


# ---------------------------------------------------------------------------------------------
# Plan and forecast


def test_sizes_match_comfyui_classes(comfy):
    """The catalog's text encoders have the parameter counts of ComfyUI's classes at full size
    (built on the meta device: no memory)."""
    import json
    import os

    import comfy.ops
    import comfy.text_encoders.llama as llama
    import comfy.text_encoders.t5 as t5
    checked = 0
    for cls, arch_id in (("Qwen3_4B", "qwen3-4b"), ("Qwen3_8B", "qwen3-8b"), ("Mistral3Small24B", "mistral-small-3-24b")):
        if hasattr(llama, cls):
            with torch.device("meta"):
                model = getattr(llama, cls)({}, torch.bfloat16, "meta", comfy.ops.manual_cast)
            assert sum(p.numel() for p in model.parameters()) == ARCHS[arch_id].params, arch_id
            assert sum(p.numel() for p in model.model.layers[0].parameters()) == ARCHS[arch_id].layer_params()
            checked += 1
    with open(os.path.join(os.path.dirname(t5.__file__), "umt5_config_xxl.json")) as f:
        config = json.load(f)
    with torch.device("meta"):
        model = t5.T5(config, torch.bfloat16, "meta", comfy.ops.manual_cast)
    assert sum(p.numel() for p in model.parameters()) == ARCHS["umt5-xxl"].params
    assert checked >= 2


def test_known_sizes():
    gb = {a: ARCHS[a].total_bytes("bf16") / 1e9 for a in ARCHS}
    assert gb["qwen3-4b"] == pytest.approx(8.0, abs=0.1) and gb["qwen3-8b"] == pytest.approx(16.4, abs=0.1)
    assert gb["mistral-small-3-24b"] == pytest.approx(45.8, abs=0.1) and gb["umt5-xxl"] == pytest.approx(11.4, abs=0.1)
    assert ARCHS["umt5-xxl"].total_bytes("fp8") / 1e9 == pytest.approx(6.7, abs=0.1)   # the fp8 file's size


def mistral_sizes() -> EncoderSizes:
    return EncoderSizes.from_arch(ARCHS["mistral-small-3-24b"], "bf16")


@pytest.mark.parametrize("gpus, used", [(["32GiB", "24GiB", "16GiB"], 2), (["16GiB", "16GiB", "24GiB"], 3)])
def test_plan_spreads_a_48gb_encoder_over_contiguous_ranges(gpus, used):
    sizes = mistral_sizes()
    slots = slots_for_devices(parse_device_specs(gpus))
    te_plan = plan_text_encoder(sizes, slots)
    assert te_plan.mode == "split" and len(te_plan.stages) == used          # as few GPUs as hold it
    assert te_plan.stages[0].layers[0] == 0 and te_plan.stages[-1].layers[1] == 40
    for a, b in zip(te_plan.stages, te_plan.stages[1:]):
        assert a.layers[1] == b.layers[0]
    for k, s in enumerate(te_plan.stages):
        count = s.layers[1] - s.layers[0]
        held = sum(sizes.layer_bytes[slice(*s.layers)]) + (sizes.rest_bytes if k == 0 else 0)
        assert s.forecast_bytes == held + sizes.working_bytes(count) <= slots[k].budget_bytes
    assert "split over" in te_plan.summary() and "layers 0-" in te_plan.summary()


def test_plan_on_one_gpu():
    sizes = mistral_sizes()
    fits = plan_text_encoder(sizes, slots_for_devices(parse_device_specs(["h200"])))
    assert fits.mode == "one" and fits.stages[0].layers == (0, 40)
    small = plan_text_encoder(sizes, slots_for_devices(parse_device_specs(["24GiB"])))
    assert small.mode == "stream" and small.stages == []
    assert "does not fit" in small.summary() and "host memory" in small.summary()


def test_plan_text_covers_the_text_encoder_step():
    w = Workload(width=512, height=512, held_dtype="fp8")
    dev = format_plan(make_plan(get_spec("flux2-dev"), parse_device_specs(["32GiB", "24GiB", "16GiB"]), w))
    assert "mistral_3_small_flux2_bf16.safetensors), 42.7 GiB" in dev
    assert "split over 2 GPUs for caption caching: layers 0-" in dev and "released before the DiT is placed" in dev
    klein = format_plan(make_plan(get_spec("flux2-klein-9b"), parse_device_specs(["h200"]), Workload()))
    assert "Qwen3-8B (qwen_3_8b_fp8mixed.safetensors)" in klein and "fits on h200" in klein
    tiny = format_plan(make_plan(get_spec("tiny-flux2"), parse_device_specs(["16GiB"]), Workload(width=64, height=64)))
    assert "text encoder" not in tiny                                     # stand-in encoders: no such step

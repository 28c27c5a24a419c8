"""FLUX.2 [dev] end to end, at tiny size on the CPU with ComfyUI's own classes, and at full size in
the planner: the guidance embedder reaches the model in training and previews; fp8 checkpoints (plain,
scaled, or bf16 cast while streaming) train an fp32 LoRA with finite gradients; the dev profile and
the `plan` command fit two 24 GB cards in fp8 and not in bf16; the bundled dev workflow and the
bench script hold together."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from comfy_bridge import build_meta, build_random, find_comfyui
from ugpum.arch import Workload, get_spec, recognise
from ugpum.planning.devices import host_device, parse_device_specs
from ugpum.placement.place import Layout
from ugpum.planning.plan import make_plan
from ugpum.placement.stream_load import CheckpointMismatch, ScaledWeight, fill_from_file
from ugpum.train.config import ConfigError, load_config

pytestmark = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")
REPO = Path(__file__).resolve().parents[2]
DATASET = REPO / "demo_datasets" / "loranne"
WORKFLOW = REPO / "example_workflows" / "ugpum_flux2dev_lora.json"
DEV = "tiny-flux2-dev"
FP8 = torch.float8_e4m3fn
QUIET = dict(log=lambda *a: None)


# ------------------------------------------------------------------------------------ files

def file_key(key: str) -> str:
    """Files name FLUX.2's q/k norm scales '.scale'; ComfyUI 0.33's modules call them '.weight'."""
    return key[: -len("weight")] + "scale" if key.endswith(("query_norm.weight", "key_norm.weight")) else key


def dev_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny dev's state dict in fp32, named as in a file."""
    model = build_random(get_spec(DEV), torch.float32, seed)
    return {file_key(k): v.detach().clone() for k, v in model.state_dict().items()}


def save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def as_fp8_file(tensors: dict) -> dict:
    """How fp8 DiT files store a model: matrices in float8_e4m3fn, vectors (norm scales) in bf16."""
    return {k: v.to(FP8) if v.dim() >= 2 else v.to(torch.bfloat16) for k, v in tensors.items()}


def load(path: Path, dtype: torch.dtype, spec_id: str = DEV) -> torch.nn.Module:
    """ComfyUI's module for `spec_id`, filled from `path` on the CPU in `dtype`."""
    model = build_meta(get_spec(spec_id), dtype)
    fill_from_file(model, Layout({}, "cpu", "cpu"), path, "", dtype)
    return model


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 128, 4, 4, generator=g), torch.tensor([0.6]),
            torch.randn(1, 16, get_spec(DEV).context_dim, generator=g))


def forward(model, guidance: float | None = 4.0):
    x, t, ctx = inputs()
    extra = {} if guidance is None else {"guidance": torch.tensor([guidance])}
    with torch.no_grad():
        return model(x, t, ctx, transformer_options={}, **extra)


def one_image(folder: Path) -> Path:
    """A one-item dataset: train() then validates on one image (a quick run on a busy CPU)."""
    import shutil
    folder.mkdir()
    for name in ("loranne_01.jpg", "loranne_01.txt"):
        shutil.copy(DATASET / name, folder / name)
    return folder


def cfg(**kw):
    base = dict(dataset=str(DATASET), devices=["cpu"], trigger="loranne", sample_every=0, model=DEV)
    base.update(kw)
    return load_config("tiny-flux2", overrides=base)


# ------------------------------------------------------------------------------------ guidance

def test_dev_has_comfyuis_guidance_embedder_and_it_changes_the_output(comfy):
    dev, klein = build_random(get_spec(DEV), torch.float32), build_random(get_spec("tiny-flux2"), torch.float32)
    assert type(dev.guidance_in).__name__ == "MLPEmbedder" and isinstance(klein.guidance_in, torch.nn.Identity)
    assert get_spec(DEV).params == sum(p.numel() for p in dev.parameters())   # the planner counts guidance_in
    four, one, none = forward(dev, 4.0), forward(dev, 1.0), forward(dev, None)
    assert (four - one).abs().max() > 1e-3 and (four - none).abs().max() > 1e-3
    torch.testing.assert_close(forward(klein, 4.0), forward(klein, None), rtol=0, atol=0)


@pytest.mark.parametrize("norm_names", ["file", "comfyui-0.33"])
def test_header_tells_dev_like_from_klein_like_by_guidance_in(tmp_path, norm_names):
    tensors = dev_tensors()
    if norm_names == "comfyui-0.33":
        tensors = {k[: -len("scale")] + "weight" if k.endswith("_norm.scale") else k: v for k, v in tensors.items()}
    dev, _, dtype = recognise(save(tmp_path / "dev.safetensors", tensors))
    klein_like = {k: v for k, v in tensors.items() if not k.startswith("guidance_in.")}
    klein, _, _ = recognise(save(tmp_path / "klein.safetensors", klein_like))
    assert (dev.id, dev.guidance, dev.heads, dtype) == (DEV, True, 4, "fp32")
    assert (klein.id, klein.guidance, klein.heads) == ("tiny-flux2", False, 4)
    assert dev.params - klein.params == sum(v.numel() for k, v in tensors.items() if k.startswith("guidance_in."))


def test_training_forward_feeds_guidance_and_klein_ignores_it():
    from ugpum.train.objective import loss_at, model_context
    torch.manual_seed(0)
    x0, noise, t = torch.randn(1, 128, 4, 4), torch.randn(1, 128, 4, 4), torch.tensor([0.5])
    ctx = torch.randn(16, get_spec(DEV).context_dim)

    def loss(model_id, guidance):
        spec = get_spec(model_id)
        model = build_random(spec, torch.float32)
        return loss_at(model, spec, cfg(model=model_id, guidance=guidance), x0, noise, t, model_context(spec, ctx),
                       "cpu", "none").item()
    assert loss(DEV, None) == loss(DEV, 1.0)                # unset: trains at 1.0, as musubi-tuner does
    assert abs(loss(DEV, 1.0) - loss(DEV, 4.0)) > 1e-4
    assert loss("tiny-flux2", 3.0) == loss("tiny-flux2", None)


def test_guidance_setting_is_checked_and_noted_when_ignored(tmp_path):
    with pytest.raises(ConfigError, match="'guidance'"):
        cfg(guidance=-1.0)
    lines = []
    from ugpum.commands.train import run_training as train
    train(cfg(model="tiny-flux2", guidance=2.5, steps=1, dataset=str(one_image(tmp_path / "data"))), tmp_path / "run",
          log=lines.append)
    assert any("'guidance' = 2.5 is ignored: tiny-flux2 has no guidance embedding" in l for l in lines), lines


def test_preview_renders_with_the_configured_guidance(comfy):
    from ugpum.train.encoders import StandInEncoders
    from ugpum.render.prompt import render
    spec = get_spec(DEV)
    model, enc = build_random(spec, torch.float32), StandInEncoders(spec)
    ctx = enc.encode_text(["loranne, waving"])[0]

    def image(guidance):
        return render(model, spec, enc.decode, ctx, None, 64, 64, seed=1, steps=2, guidance=guidance)
    assert torch.equal(image(None), image(4.0))
    assert (image(1.0) - image(4.0)).abs().max() > 1e-4


# ------------------------------------------------------------------------------------ fp8 weights

def test_fp8_file_trains_an_fp32_lora_with_finite_gradients(tmp_path):
    from ugpum.commands.train import build_model, run_training as train
    from ugpum.train.objective import micro_loss
    from ugpum.train.prepare import prepare_model
    path = save(tmp_path / "dev_fp8.safetensors", as_fp8_file(dev_tensors()))
    assert recognise(path)[2] == "fp8"
    c = cfg(model_file=str(path), weight_dtype="fp8", steps=3, dataset=str(one_image(tmp_path / "data")))
    result = train(c, tmp_path / "run", **QUIET)
    assert result.steps_done == 3 and all(math.isfinite(l) for l in result.losses)
    from safetensors.torch import load_file
    lora = load_file(str(result.lora_path))
    assert {t.dtype for t in lora.values()} == {torch.float32}
    assert any(k.startswith("diffusion_model.double_blocks.0.img_attn.qkv.lora_B") and t.abs().max() > 0
               for k, t in lora.items())                                   # it learned
    # one backward by hand: frozen fp8 base, LoRA gradients finite and non-zero
    spec = get_spec(DEV)
    plan = make_plan(spec, [host_device()], Workload(width=64, height=64, held_dtype="fp8", rank=c.rank))
    model, lora_set, layout, release = prepare_model(c, spec, plan, *build_model(c))
    try:
        base = {p.dtype for n, p in model.named_parameters() if "blocks." in n and p.dim() == 2}
        assert base == {FP8} and not any(p.requires_grad for p in model.parameters())
        with torch.no_grad():
            for _, a in lora_set.items():
                a.B.normal_(0, 0.01)                                       # so A gets a gradient too
        latent, context = torch.randn(128, 4, 4), torch.randn(16, spec.context_dim)
        micro_loss(model, spec, c, [latent], [context], 0, layout.first).backward()
        grads = [p.grad for _, a in lora_set.items() for p in (a.A, a.B)]
        assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
        assert all(g.abs().max() > 0 for g in grads)
    finally:
        release()


def test_bf16_file_is_cast_to_scaled_fp8_while_streaming(tmp_path):
    tensors = {k: v.to(torch.bfloat16) for k, v in dev_tensors().items()}
    model = load(save(tmp_path / "dev_bf16.safetensors", tensors), FP8)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or file_key(name + ".weight") not in tensors:
            continue
        original = tensors[file_key(name + ".weight")].float()
        if original.dim() < 2:
            assert weight.dtype == torch.bfloat16                     # norm scales stay bf16 next to fp8
            continue
        assert weight.dtype == FP8, name
        (scale,) = module.weight_function
        assert isinstance(scale, ScaledWeight)
        assert scale.scale == pytest.approx(original.abs().max().item() / 448)
        effective = weight.float() * scale.scale                      # what the op computes with
        assert (effective - original).norm() / original.norm() < 0.04, name
        assert (weight.float().abs().max() - 448).abs() < 1e-6       # the full fp8 range is used
    # computes like the bf16 model, within fp8's precision
    reference = load(tmp_path / "dev_bf16.safetensors", torch.float32)
    a, b = forward(model), forward(reference)
    assert (a - b).norm() / b.norm() < 0.1


def scaled_fp8(tensors: dict, old_style: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(file tensors, the weights they stand for): matrices as fp8 codes with one fp32 factor each,
    named '.weight_scale' (ComfyUI's fp8mixed) or, under `old_style` prefixes, '.scale_weight'."""
    stored, meant = {}, {}
    for k, v in tensors.items():
        if v.dim() < 2:
            stored[k] = meant[k] = v.to(torch.bfloat16)
            continue
        scale = (v.abs().max() / 448).reshape(())
        codes = (v / scale).to(FP8)
        suffix = ".scale_weight" if k.startswith(old_style) else ".weight_scale"
        stored[k], stored[k[: -len(".weight")] + suffix] = codes, scale.float()
        stored[k[: -len(".weight")] + ".input_scale"] = torch.ones(())     # an activation hint: ignored
        meant[k] = codes.float() * scale.float()
    return stored, meant


def test_scaled_fp8_file_computes_with_its_scales(tmp_path):
    stored, meant = scaled_fp8(dev_tensors(), old_style=("single_blocks.", "guidance_in."))
    scaled = save(tmp_path / "dev_fp8_scaled.safetensors", stored)
    reference = save(tmp_path / "dev_meant.safetensors", meant)
    assert max(float(v) for k, v in stored.items() if k.endswith("_scale") and "input" not in k) < 0.01
    truth = forward(load(reference, torch.float32))
    as_fp8 = load(scaled, FP8)
    assert as_fp8.double_blocks[0].img_attn.qkv.weight.dtype == FP8
    assert isinstance(as_fp8.single_blocks[0].linear1.weight_function[0], ScaledWeight)
    torch.testing.assert_close(forward(as_fp8), truth, rtol=1e-5, atol=1e-5)
    multiplied_out = load(scaled, torch.float32)                    # trained in another dtype
    assert multiplied_out.double_blocks[0].img_attn.qkv.weight.dtype == torch.float32
    torch.testing.assert_close(forward(multiplied_out), truth, rtol=1e-5, atol=1e-5)


def test_unsupported_quantised_files_are_named(tmp_path):
    stored, _ = scaled_fp8(dev_tensors())
    per_row = dict(stored)
    per_row["double_blocks.0.img_attn.qkv.weight_scale"] = torch.ones(stored["double_blocks.0.img_attn.qkv.weight"].shape[0])
    with pytest.raises(CheckpointMismatch, match="qkv.weight_scale holds 192 scale factors"):
        load(save(tmp_path / "per_row.safetensors", per_row), FP8)
    as_int = dict(stored)
    as_int["double_blocks.0.img_attn.proj.weight"] = torch.zeros(64, 64, dtype=torch.int8)
    with pytest.raises(CheckpointMismatch, match="proj.weight is stored as I8"):
        load(save(tmp_path / "int8.safetensors", as_int), FP8)


# ------------------------------------------------------------------------------------ plan and profile

def plan_json(*extra: str) -> dict:
    args = ["plan", "--model", "flux2-dev", "--gpu", "24GiB", "--gpu", "24GiB", "--resolution", "1024", "--json", *extra]
    done = subprocess.run([sys.executable, "-m", "ugpum", *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_plan_dev_fp8_fits_two_24gib_cards_with_a_few_blocks_swapped():
    plan = plan_json("--dtype", "fp8")
    assert plan["model"] == "flux2-dev" and plan["workload"]["held_dtype"] == "fp8"
    # (the calibrated planner counts the allocator's slack and 0.5 GiB for a desktop on each card: a few
    # of the 56 blocks stream from host memory; bf16 streams far more, below)
    assert 0 < len(plan["offloaded_blocks"]) <= 10
    bf16 = plan_json("--dtype", "bf16")
    assert len(bf16["offloaded_blocks"]) > 2 * len(plan["offloaded_blocks"])
    assert all(s["blocks"][1] > s["blocks"][0] for s in plan["stages"])           # both cards hold blocks
    assert plan["stages"][-1]["blocks"][1] == 56 and all(s["forecast_gib"] <= s["budget_gib"] for s in plan["stages"])
    # fp8 weights at one byte each: the resident blocks' weights add up to their parameter count
    spec = get_spec("flux2-dev")
    for s in plan["stages"]:
        a, b = s["blocks"]
        block_bytes = sum(spec.blocks[i].params for i in range(a, b) if i not in s["offloaded"])
        assert block_bytes / 2**30 <= s["detail_gib"]["weights"] <= (block_bytes + spec.head_params + 2 * spec.tail_params) / 2**30 + 1e-3


def test_plan_dev_bf16_on_the_same_cards_needs_swap(capsys):
    from ugpum.commands import main
    assert main(["plan", "--model", "flux2-dev", "--gpu", "24GiB", "--gpu", "24GiB", "--dtype", "bf16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["offloaded_blocks"] and plan["swap_bytes_per_step"] > 0
    # with no host tier to swap to (one 24 GiB card, no CPU tier) it would not fit: the error says why
    assert main(["plan", "--model", "flux2-dev", "--gpu", "8GiB", "--dtype", "bf16"]) == 2
    assert "flux2-dev does not fit" in capsys.readouterr().err


def test_dev_profile_is_fp8_with_guidance_and_trains_on_two_24gib_cards():
    c = load_config("flux2-dev-1024")
    assert (c.model, c.weight_dtype, c.guidance, c.sample_guidance, c.resolution, c.lr) == (
        "flux2-dev", "fp8", 1.0, 4.0, 1024, 1e-4)
    assert 16 <= c.rank <= 32 and c.checkpointing
    w = Workload(width=c.resolution, height=c.resolution, rank=c.rank, held_dtype=c.weight_dtype,
                 checkpointing=c.checkpointing)
    plan = make_plan(get_spec(c.model), parse_device_specs(["24GiB", "24GiB"]), w, grad_accum=c.grad_accum)
    assert len(plan.offloaded_blocks) <= 10 and all(s.blocks[1] > s.blocks[0] for s in plan.stages)


# ------------------------------------------------------------------------------------ workflow, bench

def test_dev_workflow_trains_on_dev_fp8_and_renders_with_guidance():
    from ugpum.catalog.models import MODELS
    entry = MODELS["flux2-dev"]
    workflow = json.loads(WORKFLOW.read_text())
    nodes = {n["id"]: n for n in workflow["nodes"]}
    by_type = {}
    for n in nodes.values():
        by_type.setdefault(n["type"], []).append(n)
    (loader,) = by_type["UGPUMLoader"]
    (clip,) = by_type["CLIPLoader"]
    (trainer,) = by_type["UGPUMLoRATrainer"]
    (planner,) = by_type["UGPUMPartitionPlanner"]
    assert loader["widgets_values"][:2] == [entry.dit["fp8"].filename, "fp8_e4m3fn"]
    assert clip["widgets_values"][:2] == [entry.text_encoder.filename, "flux2"]
    assert by_type["VAELoader"][0]["widgets_values"] == [entry.vae.filename]
    assert by_type["UNETLoader"][0]["widgets_values"][0] == entry.dit["fp8"].filename
    profile = load_config("flux2-dev-1024")
    assert trainer["widgets_values"][3] == profile.lr and planner["widgets_values"][:4] == [1024, 1, 1, profile.rank]
    assert by_type["FluxGuidance"][0]["widgets_values"] == [profile.sample_guidance]    # sampled as previewed
    assert "CFGGuider" not in by_type and "BasicGuider" in by_type                 # dev: no CFG
    # the trained LoRA flows into the stock LoRA loader, whose model renders through FluxGuidance
    links = {l[0]: l for l in workflow["links"]}
    into = {(nodes[l[3]]["type"], nodes[l[1]]["type"]) for l in links.values()}
    assert {("LoraModelLoader", "UGPUMLoRATrainer"), ("BasicGuider", "LoraModelLoader"),
            ("BasicGuider", "FluxGuidance"), ("SamplerCustomAdvanced", "BasicGuider")} <= into
    for link_id, src, src_slot, dst, dst_slot, kind in links.values():
        assert nodes[src]["outputs"][src_slot]["type"] == kind and link_id in nodes[src]["outputs"][src_slot]["links"]
        assert nodes[dst]["inputs"][dst_slot]["link"] == link_id
    with Image.open(WORKFLOW.with_suffix(".jpg")) as thumb:
        assert thumb.format == "JPEG" and thumb.width >= 512

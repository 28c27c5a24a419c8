"""Each 8-bit base-compute mode's LoRA gradients against the exact (bf16) base's, per block (issues 38, 41): the
cosine and relative norm error of the block's concatenated LoRA gradients, first, middle and last block.

  python bench/model_files.py dit --model flux2-klein-9b --path /tmp/k9.safetensors   # random weights
  python bench/gradient_cosine.py --model-file /tmp/k9.safetensors --device cuda:0 --rows R.jsonl  # session.sh cosine
  python bench/gradient_cosine.py --profile tiny-flux2 --device cpu --rows R.jsonl   # CPU smoke (emulated)

The model is loaded, placed and given its LoRA as `python -m ugpum train` does (exact base, recompute all, compile
off); a no-grad forward of a stand-in micro-batch captures the blocks' inputs. Per block, its LoRA's B gets a small
random init (so gradients reach A), then the gradients of a fixed random projection of the block's outputs: on the
exact base, then in each quantising mode (`use_base_compute`); a device without the mode's tensor cores runs its fp32
reference emulation ("emulated": true). ugpum/compute/modes/<mode>.py's `gradient_cosine` is updated by hand from
these rows (the lowest block's, on the speed rows' GPU); base_compute = auto takes only a mode whose cosine reaches
ugpum.compute.modes.QUALITY_BOUND (0.998).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import comfy_bridge  # noqa: E402
from ugpum.arch import get_spec, recognise  # noqa: E402
from ugpum.compute.base_compute import supports, use_base_compute  # noqa: E402
from ugpum.compute.dtypes import TORCH_DTYPES, bf16_autocast  # noqa: E402
from ugpum.compute.modes import EXACT, MODES  # noqa: E402
from ugpum.formats.atomic import append_line  # noqa: E402
from ugpum.train.config import load_config  # noqa: E402
from ugpum.train.encoders import StandInEncoders  # noqa: E402
from ugpum.train.objective import micro_loss  # noqa: E402
from ugpum.train.prepare import base_linear_paths, plan_for, prepare_model  # noqa: E402


def copied(args, kwargs) -> tuple[list, dict]:
    """Private copies of a block's inputs (FLUX.2's blocks add into theirs in place)."""
    fresh = lambda v: v.detach().clone() if torch.is_tensor(v) else v      # noqa: E731
    return [fresh(v) for v in args], {k: fresh(v) for k, v in kwargs.items()}


def block_gradients(block, inputs, params, cfg, device) -> torch.Tensor:
    """The concatenated gradients of `params` for a fixed random projection of the block's outputs."""
    args, kwargs = copied(*inputs)
    with bf16_autocast(cfg.autocast, cfg.weight_dtype, device):
        out = block(*args, **kwargs)
    g = torch.Generator(device=device).manual_seed(2)
    loss = sum((t.float() * torch.randn(t.shape, generator=g, device=device)).sum()
               for t in (out if isinstance(out, (tuple, list)) else (out,)) if torch.is_tensor(t))
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if gr is None else gr).flatten().float() for gr, p in zip(grads, params)])


def block_inputs(model, spec, cfg, first: str, picks: list[str]) -> dict:
    """Each picked block's (args, kwargs) in a no-grad forward of the whole model on a stand-in micro-batch."""
    captured, encoders = {}, StandInEncoders(spec)
    hooks = [model.get_submodule(p).register_forward_pre_hook(
        lambda m, args, kw, p=p: captured.setdefault(p, copied(args, kw)), with_kwargs=True) for p in picks]
    latent = encoders.encode_images(torch.rand(1, 3, cfg.resolution, cfg.resolution) * 2 - 1)[0]
    with torch.no_grad():
        micro_loss(model, spec, cfg, [latent], [encoders.encode_text(["a photo"])[0]], 0, first)
    for h in hooks:
        h.remove()
    return captured


def measure(a) -> list[dict]:
    cfg = load_config(a.profile, overrides=dict(model=recognise(a.model_file)[0].id if a.model_file else None,
                      model_file=a.model_file or "", devices=[a.device], base_compute=EXACT.name, recompute="all",
                      compile="off"))
    spec, device, g, rows = get_spec(cfg.model), torch.device(a.device), torch.Generator().manual_seed(1), []
    model, prefix = comfy_bridge.build_dit(spec, TORCH_DTYPES[cfg.weight_dtype], cfg.model_file, seed=cfg.seed)
    model, lora, layout, release = prepare_model(cfg, spec, plan_for(cfg, spec), model, prefix, log=lambda *_: None)
    picks = list(dict.fromkeys(spec.blocks[i].path for i in (0, len(spec.blocks) // 2, -1)))
    inputs = block_inputs(model, spec, cfg, layout.first, picks)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    for path in picks:
        adapters = [ad for p, ad in lora.items() if p.startswith(path + ".")]
        with torch.no_grad():
            for ad in adapters:
                ad.B.copy_(torch.randn(ad.B.shape, generator=g) * 0.01)
        params, block = [p for ad in adapters for p in (ad.A, ad.B)], model.get_submodule(path)
        ref = block_gradients(block, inputs[path], params, cfg, device)
        for mode in (m for m in MODES if m.quantises):
            emulated = supports(mode.name, device) is not None
            undo = use_base_compute(model, base_linear_paths(spec, [path]), mode.name, lambda *_: None,
                                    emulate=emulated, keep="device")
            try:
                got = block_gradients(block, inputs[path], params, cfg, device)
            finally:
                undo()
            cosine = float(torch.nn.functional.cosine_similarity(ref, got, dim=0))
            rows.append({"model": spec.id, "block": path, "mode": mode.name, "cosine_vs_bf16": round(cosine, 6),
                         "rel_norm_error": round(float((got - ref).norm() / ref.norm()), 5), "emulated": emulated,
                         "device": gpu, "torch": torch.__version__})
    release()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="klein-9b-1024", help="the training profile (its model, resolution, rank)")
    p.add_argument("--model-file", help="the DiT file (random weights: bench/model_files.py dit); tiny: none")
    p.add_argument("--device", default="cuda:0", help="the device the model and every mode run on")
    p.add_argument("--rows", required=True, help="the JSON lines file the rows are appended to")
    a = p.parse_args(argv)
    comfy_bridge.import_comfy(comfy_bridge.find_comfyui_or_raise(), cpu=not a.device.startswith("cuda"))
    with comfy_bridge.comfy_training_mode():
        rows = measure(a)
    Path(a.rows).parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        append_line(a.rows, json.dumps(row))
        print(f"{row['block']} {row['mode']}{' (emulated)' if row['emulated'] else ''}: cosine vs bf16 "
              f"{row['cosine_vs_bf16']:.6f}, relative norm error {row['rel_norm_error']:.5f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

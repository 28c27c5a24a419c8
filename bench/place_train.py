"""GPU check for the core (issue 2) and FLUX.2 [dev] in fp8 (issue 8): a full-size DiT with random
weights is streamed block by block from a safetensors file onto the devices a plan chose, then trains
LoRA steps; the plan's memory forecast is compared with the allocator's peak, with and without
checkpointing.

  python bench/place_train.py write --model flux2-klein-9b --path /tmp/k9.safetensors
  python bench/place_train.py run --path /tmp/k9.safetensors --resolution 1024 --out bench/results/klein9b_place.json

  python bench/place_train.py write --model flux2-dev --dtype fp8 --path /tmp/dev_fp8.safetensors   # 32 GB
  python bench/place_train.py run --path /tmp/dev_fp8.safetensors --checkpointing block \
      --out bench/results/flux2dev_fp8_place.json

`write` and `run` are separate processes so `run`'s peak host RAM is the loader's alone. `--dtype fp8`
writes what an fp8 DiT file holds: matrices as float8_e4m3fn, norm scales in bf16; `run` trains on the
stored dtype (or `--dtype`, cast while streaming) through ComfyUI's manual-cast ops. Models with a
guidance embedding (FLUX.2 dev) get `guidance=` in every forward. A case whose plan needs block swap
on this device is recorded as skipped (swap has its own bench: `python -m ugpum bench swap`).
`--device cpu` runs the same code on a tiny model (tiny-flux2-dev) without a GPU: no peak is measured.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from comfy_bridge import build_meta  # noqa: E402
from ugpum.arch import get_spec, recognise, Workload  # noqa: E402
from ugpum.compute.recompute import recompute_blocks  # noqa: E402
from ugpum.planning.devices import detect_devices, host_device  # noqa: E402
from ugpum.compute.inplace_guard import guard_inplace_residuals  # noqa: E402
from ugpum.placement.place import Layout, place  # noqa: E402
from ugpum.planning.plan import make_plan  # noqa: E402
from ugpum.commands.plan import resolution as _resolution  # noqa: E402
from ugpum.formats.safetensors_writer import write_streaming  # noqa: E402
from ugpum.compute.lora import attach_lora, lora_targets  # noqa: E402
from ugpum.render.prompt import guidance_for  # noqa: E402

GIB = 1024 ** 3
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------- write

def file_dtype(shape: tuple[int, ...], dtype: torch.dtype) -> torch.dtype:
    """How a file in `dtype` stores a tensor: fp8 files keep vectors (norm scales) in bf16."""
    if dtype == torch.float8_e4m3fn and len(shape) < 2:
        return torch.bfloat16
    return dtype


def file_key(key: str) -> str:
    """FLUX.2 files name the q/k norm scales '.scale' (ComfyUI 0.33's modules call them '.weight')."""
    if key.endswith(("query_norm.weight", "key_norm.weight")):
        return key[: -len("weight")] + "scale"
    return key


def write(args) -> dict:
    """A ComfyUI-layout random checkpoint ('model.diffusion_model.' keys), tensor by tensor."""
    spec = get_spec(args.model)
    dtype = TORCH_DTYPES[args.dtype]
    model = build_meta(spec, torch.bfloat16)
    shapes = {"model.diffusion_model." + file_key(k): (tuple(v.shape), file_dtype(tuple(v.shape), dtype))
              for k, v in model.state_dict().items()}
    device = args.device or default_device()
    gen = torch.Generator(device).manual_seed(0)

    def make(name, shape, dt):
        r = torch.randn(shape, generator=gen, device=device)
        if len(shape) >= 2:
            r = r / math.sqrt(math.prod(shape[1:]))       # fan-in scaled: activations stay finite
        elif "norm" in name:
            r = 1 + 0.1 * r
        else:
            r = 0.02 * r
        return r.to(dt)

    t0 = time.time()
    write_streaming(args.path, shapes, make)
    seconds = time.time() - t0
    size = Path(args.path).stat().st_size
    print(f"wrote {args.path} ({size / GIB:.2f} GiB, {spec.id}, {args.dtype}) in {seconds:.1f} s on {device}")
    return {"path": str(args.path), "bytes": size, "seconds": round(seconds, 1)}


# ------------------------------------------------------------------------------------- run

def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def example_inputs(spec, w, dev: str):
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32   # CPU: no autocast, fp32 compute
    if spec.family == "wan":
        x = torch.randn(1, 16, 1 + (w.frames - 1) // 4, w.height // 8, w.width // 8, device=dev, dtype=dtype)
    else:
        x = torch.randn(1, 128, w.height // 16, w.width // 16, device=dev, dtype=dtype)
    ctx = torch.randn(1, w.text_tokens, spec.context_dim, device=dev, dtype=dtype)
    return x, ctx


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def train_steps(model, spec, lora, w, steps: int, dev: str, guidance: float | None):
    """`steps` LoRA steps on fixed random inputs; (seconds per step, final loss, LoRA grads finite)."""
    params = [p for _, a in lora.items() for p in a.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    x, ctx = example_inputs(spec, w, dev)
    t = torch.rand(1, device=dev)
    extra = {} if guidance is None else {"guidance": torch.full((1,), guidance, device=dev)}
    times, finite = [], True
    for _ in range(steps):
        sync(dev)
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.startswith("cuda")):
            out = model(x, t, ctx, transformer_options={}, **extra)
        loss = (out.float() - x.float()).pow(2).mean()
        loss.backward()
        finite = finite and all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        times.append(time.perf_counter() - t0)
    return times, loss.item(), finite


def run_devices(device: str):
    if device == "cpu":
        return [host_device()]
    found = detect_devices()
    if not found:
        raise SystemExit("no CUDA GPU here: use --device cpu with a tiny model")
    return found


def run(args) -> dict:
    rss_start = rss_gib()
    spec, prefix, stored = recognise(args.path)
    weight_dtype = args.dtype or {"fp16": "bf16"}.get(stored, stored)
    torch_dtype = TORCH_DTYPES[weight_dtype]
    guidance = guidance_for(spec, args.guidance)
    devices = run_devices(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = devices[0].torch_device.startswith("cuda")
    cases = {"both": (True, False), "block": (True,), "none": (False,)}[args.checkpointing]
    results = []
    for checkpointing in cases:
        width, height = args.resolution
        w = Workload(width=width, height=height, frames=args.frames,
                     recompute="all" if checkpointing else "none", rank=args.rank,
                     held_dtype="bf16" if weight_dtype == "fp32" else weight_dtype)
        name = (f"{spec.id} {width}x{height} x{args.frames} frames, {weight_dtype} weights, rank {args.rank}, "
                f"checkpointing {'block' if checkpointing else 'none'}"
                + (f", guidance {guidance}" if guidance is not None else ""))
        plan = make_plan(spec, devices, w)
        if plan.offloaded_blocks:
            results.append({"case": name, "skipped": f"the plan swaps {len(plan.offloaded_blocks)} blocks on "
                            "this device; see `python -m ugpum bench swap`", "verdict": plan.verdict})
            print(json.dumps(results[-1]), flush=True)
            continue
        torch_devs = [s.torch_device for s in plan.stages]
        model = build_meta(spec, torch_dtype)
        layout = Layout.from_plan(plan, torch_devs, spec.tail_modules)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        placement = place(model, layout, checkpoint=args.path, key_prefix=prefix, dtype=torch_dtype)
        load_s = time.time() - t0
        rss_load = rss_gib()
        stored_blocks = sorted({str(p.dtype).replace("torch.", "") for n, p in model.named_parameters()
                                if "blocks." in n and p.dim() == 2})
        targets = lora_targets([b.path for b in spec.blocks], [b.linears for b in spec.blocks])
        lora = attach_lora(model, targets, rank=w.rank, alpha=w.rank)
        guards = guard_inplace_residuals(model, include_rms=False)
        undo_ckpt = recompute_blocks(model, [b.path for b in spec.blocks]) if checkpointing else None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times, loss, finite = train_steps(model, spec, lora, w, args.steps, torch_devs[0], guidance)
        forecast = sum(s.forecast_gib for s in plan.stages)
        peak, peaks = None, {}
        if cuda:                                  # per device, to set against each stage's forecast
            peaks = {d: round(torch.cuda.max_memory_allocated(d) / GIB, 3)
                     for d in sorted({d for d in torch_devs if d.startswith("cuda")})}
            peak = round(sum(peaks.values()), 3)
        timed = times[2:] if len(times) > 2 else times
        results.append({
            "case": name, "model": spec.id, "recognised_prefix": prefix, "stored_dtype": stored,
            "weight_dtype": weight_dtype, "block_weights_held_as": stored_blocks, "guidance": guidance,
            "stages": [{"device": s.device, "blocks": s.blocks, "forecast_gib": s.forecast_gib,
                        "detail_gib": s.detail_gib} for s in plan.stages],
            "forecast_gib": forecast, "peak_gib": peak, "peak_gib_per_device": peaks,
            "forecast_error": round(forecast / peak - 1, 4) if peak else None,
            "s_per_step_median": round(statistics.median(timed), 4), "step_times": [round(x, 4) for x in times],
            "predicted_step_s": round(plan.predicted_step_s, 4), "load_s": round(load_s, 1),
            "host_rss_peak_gib_after_load": round(rss_load, 3), "host_rss_at_start_gib": round(rss_start, 3),
            "final_loss": loss, "lora_grads_finite": finite,
        })
        print(json.dumps(results[-1]), flush=True)
        if undo_ckpt:
            undo_ckpt()
        for g in guards:
            g.remove()
        lora.remove()
        placement.undo("meta")
        del model, placement, lora
        if cuda:
            torch.cuda.empty_cache()
    record = {"command": args.command,
              "gpu": torch.cuda.get_device_name(0) if cuda else f"none (cpu: {platform.processor() or 'unknown'})",
              "torch": torch.__version__, "python": platform.python_version(),
              "device_probe": [d.to_json() for d in devices], "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    return record


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["write", "run"])
    p.add_argument("--path", required=True, help="the random-weight checkpoint to write or train on")
    p.add_argument("--out", default="bench/results/place_train.json")
    p.add_argument("--model", default="flux2-klein-9b", help="write: model id (tiny-flux2-dev for a CPU try)")
    p.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default=None,
                   help="write: stored dtype (default bf16); run: training dtype (default: as stored)")
    p.add_argument("--device", default=None, help="write: where weights are drawn; run: cpu for tiny models "
                                                   "(default: cuda when present)")
    p.add_argument("--resolution", type=_resolution, default=(1024, 1024), help="side in pixels, or WxH (832x480)")
    p.add_argument("--frames", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--checkpointing", choices=["both", "block", "none"], default="both")
    p.add_argument("--guidance", type=float, default=None,
                   help="guidance input for models that have one (default: the model's, 4.0 for FLUX.2 dev)")
    return p


def main(argv: list[str] | None = None) -> dict:
    a = parser().parse_args(argv)
    a.command = " ".join(["python bench/place_train.py"] + (sys.argv[1:] if argv is None else list(argv)))
    if a.mode == "write":
        a.dtype = a.dtype or "bf16"
        return write(a)
    return run(a)


if __name__ == "__main__":
    main()

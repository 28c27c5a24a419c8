"""GPU check for the core (issue 2): a full-size DiT with random weights is streamed block by
block from a safetensors file onto the devices a plan chose, then trains LoRA steps; the plan's
memory forecast is compared with the allocator's peak, with and without checkpointing.

  python bench/place_train.py write --model flux2-klein-9b --path /tmp/k9.safetensors
  python bench/place_train.py run --path /tmp/k9.safetensors --resolution 1024 --out bench/results/klein9b_place.json

`write` and `run` are separate processes so `run`'s peak host RAM is the loader's alone.
"""
from __future__ import annotations

import argparse
import json
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
from ugpum.checkpointing import checkpoint_blocks  # noqa: E402
from ugpum.devices import detect_devices  # noqa: E402
from ugpum.inplace_guard import guard_inplace_residuals  # noqa: E402
from ugpum.place import Layout, place  # noqa: E402
from ugpum.plan import make_plan  # noqa: E402
from ugpum.safetensors_writer import write_streaming  # noqa: E402
from ugpum.train.lora import attach_lora, lora_targets  # noqa: E402

GIB = 1024 ** 3


def meta_model(spec):
    return build_meta(spec, torch.bfloat16)


def write(args):
    spec = get_spec(args.model)
    model = meta_model(spec)
    shapes = {"model.diffusion_model." + k: (tuple(v.shape), torch.bfloat16) for k, v in model.state_dict().items()}
    gen = torch.Generator("cuda").manual_seed(0)
    t0 = time.time()
    write_streaming(args.path, shapes, lambda n, s, d: (torch.randn(s, generator=gen, device="cuda") * 0.02).to(d))
    print(f"wrote {args.path} ({Path(args.path).stat().st_size / GIB:.1f} GiB) in {time.time() - t0:.0f} s")


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def example_inputs(spec, w, dev):
    if spec.family == "wan":
        x = torch.randn(1, 16, 1 + (w.frames - 1) // 4, w.height // 8, w.width // 8, device=dev, dtype=torch.bfloat16)
    else:
        x = torch.randn(1, 128, w.height // 16, w.width // 16, device=dev, dtype=torch.bfloat16)
    ctx = torch.randn(1, w.text_tokens, spec.context_dim, device=dev, dtype=torch.bfloat16)
    return x, ctx


def train_steps(model, spec, lora, w, steps: int, dev: str):
    params = [p for _, a in lora.items() for p in a.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    x, ctx = example_inputs(spec, w, dev)
    t = torch.rand(1, device=dev)
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, t, ctx, transformer_options={})
        loss = (out.float() - x.float()).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, loss.item()


def run(args):
    rss_start = rss_gib()
    spec, prefix, dtype = recognise(args.path)
    devices = detect_devices()
    results = []
    for checkpointing in (True, False):
        w = Workload(width=args.resolution, height=args.resolution, frames=args.frames,
                     checkpointing=checkpointing, rank=16)
        plan = make_plan(spec, devices, w)
        torch_devs = [s.torch_device for s in plan.stages]
        model = meta_model(spec)
        layout = Layout.from_plan(plan, torch_devs, spec.tail_modules)
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        placement = place(model, layout, checkpoint=args.path, key_prefix=prefix)
        load_s = time.time() - t0
        rss_load = rss_gib()
        targets = lora_targets([b.path for b in spec.blocks], [b.linears for b in spec.blocks])
        lora = attach_lora(model, targets, rank=w.rank, alpha=w.rank)
        guards = guard_inplace_residuals(model, include_rms=False)
        undo_ckpt = checkpoint_blocks(model, [b.path for b in spec.blocks]) if checkpointing else None
        torch.cuda.reset_peak_memory_stats()
        times, loss = train_steps(model, spec, lora, w, args.steps, torch_devs[0])
        peak = torch.cuda.max_memory_allocated() / GIB
        results.append({
            "case": f"{spec.id} {args.resolution}² x{args.frames} frames, rank 16, "
                    f"checkpointing {'block' if checkpointing else 'none'}",
            "model": spec.id, "recognised_prefix": prefix, "stored_dtype": dtype,
            "stages": [{"device": s.device, "blocks": s.blocks, "forecast_gib": s.forecast_gib,
                        "detail_gib": s.detail_gib} for s in plan.stages],
            "forecast_gib": sum(s.forecast_gib for s in plan.stages), "peak_gib": round(peak, 3),
            "forecast_error": round(sum(s.forecast_gib for s in plan.stages) / peak - 1, 4),
            "s_per_step_median": round(statistics.median(times[2:]), 4), "step_times": [round(x, 4) for x in times],
            "predicted_step_s": round(plan.predicted_step_s, 4), "load_s": round(load_s, 1),
            "host_rss_peak_gib_after_load": round(rss_load, 3), "host_rss_at_start_gib": round(rss_start, 3),
            "final_loss": loss,
        })
        print(json.dumps(results[-1]), flush=True)
        if undo_ckpt:
            undo_ckpt()
        for g in guards:
            g.remove()
        lora.remove()
        placement.undo("meta")
        del model, placement, lora
        torch.cuda.empty_cache()
    record = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "python": platform.python_version(), "device_probe": [d.to_json() for d in devices],
              "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["write", "run"])
    p.add_argument("--path", required=True)
    p.add_argument("--out", default="bench/results/place_train.json")
    p.add_argument("--model", default="flux2-klein-9b")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--frames", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    write(a) if a.mode == "write" else run(a)

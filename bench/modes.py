"""Each speed mode through the product's own path, against the plan's forecast (issue 16).

  python bench/place_train.py write --model flux2-klein-9b --path /tmp/k9.safetensors
  python bench/modes.py --path /tmp/k9.safetensors --out bench/results --mode off/bf16 on/bf16 on/fp8 on/int8

Each mode (compile/base_compute) runs in its own process, as `python -m ugpum train` would set it up:
a TrainConfig, the plan `train()` uses (`loop.plan_for`), the DiT built on meta and streamed from the file
by `loop.prepare_model` (8-bit layers quantised as they arrive, blocks compiled, then wrapped for recompute), then
LoRA steps (random latents and text at the plan's shapes, AdamW, bf16 autocast). Appends one JSON object
per mode to OUT/modes.json: allocator peaks while loading and while training against the forecast,
median s/step against the plan's predicted s/step, first-step seconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import GIB, example_inputs  # noqa: E402


def one_mode(path: str, compile: str, base_compute: str, steps: int) -> dict:
    from comfy_bridge import build_meta, comfy_training_mode, find_comfyui_or_raise, import_comfy
    from ugpum.arch import recognise
    from ugpum.train.config import TrainConfig
    from ugpum.train.prepare import plan_for, prepare_model

    cuda = torch.cuda.is_available()          # (cpu: a smoke run of the bench itself on a tiny model)
    dev = "cuda:0" if cuda else "cpu"
    import_comfy(find_comfyui_or_raise(), cpu=not cuda)
    spec, prefix, stored = recognise(path)
    cfg = TrainConfig(model=spec.id, model_file=path, resolution=1024, rank=16, alpha=16.0, compile=compile,
                      base_compute=base_compute, weight_dtype="bf16", devices=[dev])
    plan = plan_for(cfg)
    w = cfg.workload()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    peak = (lambda: torch.cuda.max_memory_allocated() / GIB) if cuda else (lambda: 0.0)
    reset = torch.cuda.reset_peak_memory_stats if cuda else (lambda: None)
    reset()
    t0 = time.perf_counter()
    model = build_meta(spec, torch.bfloat16)
    model, lora, layout, release = prepare_model(cfg, spec, plan, model, prefix, log=print)
    load_s = time.perf_counter() - t0
    load_peak = peak()
    params = [p for _, a in lora.items() for p in a.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    x, t, ctx = example_inputs(spec, w, dev)
    reset()
    times = []
    with comfy_training_mode():
        for _ in range(steps):
            sync()
            t1 = time.perf_counter()
            with torch.autocast(dev.split(":")[0], dtype=torch.bfloat16):
                o = model(x, t, ctx, transformer_options={})
            (o.float() - x.float()).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t1)
    train_peak = peak()
    release()
    stage = plan.stages[0]
    median = statistics.median(times[1:])
    return {"model": spec.id, "compile": compile, "base_compute": base_compute, "stored": stored,
            "s_per_step": round(median, 4), "forecast_s": round(plan.predicted_step_s, 4),
            "forecast_s_error": round(plan.predicted_step_s / median - 1, 4),
            "first_step_s": round(times[0], 2), "step_times": [round(s, 4) for s in times],
            "load_s": round(load_s, 1), "load_peak_gib": round(load_peak, 2), "train_peak_gib": round(train_peak, 2),
            "forecast_gib": stage.forecast_gib, "forecast_detail_gib": stage.detail_gib,
            "forecast_gib_error": round(stage.forecast_gib / max(load_peak, train_peak, 1e-9) - 1, 4),
            "device": stage.device, "torch": torch.__version__}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--mode", nargs="+", default=["off/bf16", "on/bf16", "on/fp8", "on/int8"],
                   help="compile/base_compute pairs, each run in its own process")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)      # the child process
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.one:
        compile, base_compute = a.mode[0].split("/")
        try:
            row = one_mode(a.path, compile, base_compute, a.steps)
        except Exception as err:                                     # recorded; the next mode still runs
            row = {"compile": compile, "base_compute": base_compute, "error": f"{type(err).__name__}: {str(err)[:400]}"}
        print(json.dumps(row), flush=True)
        with open(out / "modes.json", "a") as f:
            f.write(json.dumps(row) + "\n")
        return
    for mode in a.mode:
        subprocess.run([sys.executable, __file__, "--one", "--path", a.path, "--out", str(out), "--mode", mode,
                        "--steps", str(a.steps)], check=False)


if __name__ == "__main__":
    main()

"""What one process costs driving two replicas (issue 40): two worker threads driving two replicas of a model's
blocks on one GPU, against one worker driving one, through the engine's own replicas (`ugpum.train.replicas`).

  python bench/model_files.py dit --model flux2-klein-base-9b --path /tmp/k9-base.safetensors   # random weights
  python bench/replicas_one_process.py --model-file /tmp/k9-base.safetensors --device cuda:0 \
      --rows bench/results/replicas_one_process.jsonl
  python bench/replicas_one_process.py --profile tiny-flux2 --device cpu --steps 3 --rows R.jsonl   # CPU smoke

Both cases train 2 micro-batches a step of the same random latents: one worker (the plan of one copy on the
device) or two (`--replicas 2` on the device twice: each replica one micro-batch, in its own thread). A row per
case: the median wall seconds a step, the process's CPU seconds a step (every thread; a thread waiting for its
GPU spin-waits, so this is no measure of host work: 0.86 s a 0.745 s step on an H100) and on a GPU the kernels
launched a step (torch.profiler over one step). The last row is what one process adds when two workers drive
the same micro-batches: two workers' step / one worker's step - 1 (2026-12-07, one H100: -0.2 %, so 0). On two
cards each replica has a GPU of its own and the host must keep both fed: bench/two_gpu.py measures that
directly; until it runs, ugpum/planning/replicas.py's ONE_PROCESS_LOSS assumes 2 %.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import comfy_bridge  # noqa: E402
from ugpum.arch import get_spec, recognise  # noqa: E402
from ugpum.compute.dtypes import TORCH_DTYPES  # noqa: E402
from ugpum.formats.atomic import append_line  # noqa: E402
from ugpum.planning.devices import parse_device_specs  # noqa: E402
from ugpum.planning.space import best_plan  # noqa: E402
from ugpum.train.config import load_config  # noqa: E402
from ugpum.train.encoders import StandInEncoders  # noqa: E402
from ugpum.train.objective import micro_loss  # noqa: E402
from ugpum.train.replicas import Replicas, place_replicas  # noqa: E402


def case(a, copies: int) -> dict:
    """Train `a.steps` steps of 2 micro-batches with `copies` replicas on `a.device`; the case's row."""
    model_id = recognise(a.model_file)[0].id if a.model_file else None        # (base or distilled: the file's)
    cfg = load_config(a.profile, overrides=dict(model=model_id, model_file=a.model_file or "", grad_accum=2,
                                                devices=[a.device] * copies, replicas=copies, compile=a.compile))
    spec = get_spec(cfg.model)
    plan = best_plan(spec, parse_device_specs(cfg.devices), cfg.workload(), 2, replicas=copies)
    model, prefix = comfy_bridge.build_dit(spec, TORCH_DTYPES[cfg.weight_dtype], cfg.model_file, seed=cfg.seed)
    replicas = Replicas(place_replicas(cfg, spec, plan, model, prefix, lambda *_: None), plan.shares)
    encoders = StandInEncoders(spec)
    side = cfg.resolution
    latent = encoders.encode_images(torch.rand(1, 3, side, side) * 2 - 1)[0]
    context = encoders.encode_text(["a photo"])[0]

    def loss_of(replica, k: int) -> torch.Tensor:
        return micro_loss(replica.model, spec, cfg, [latent], [context], k, replica.layout.first) / 2
    optimizer = torch.optim.AdamW(replicas.lead.params, lr=cfg.lr)
    wall, cpu = [], []
    try:
        for step in range(a.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            replicas.step([2 * step, 2 * step + 1], loss_of)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        launches = kernel_launches(replicas, loss_of, a.steps) if a.device.startswith("cuda") else None
    finally:
        replicas.release()
    cpu_s = statistics.median(cpu[a.warmup:])
    return {"case": f"{copies} worker(s)", "replicas": copies, "device": a.device, "profile": a.profile,
            "model": spec.id, "micro_batches": 2, "s_per_step": statistics.median(wall[a.warmup:]), "cpu_s_per_step":
            cpu_s, "step_times": wall, "kernel_launches": launches, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else None}


def kernel_launches(replicas: Replicas, loss_of, k: int) -> int:
    """Kernels launched in one step (torch.profiler's CPU-side launch events)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        replicas.step([2 * k, 2 * k + 1], loss_of)
    return sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="klein-9b-1024", help="the training profile (its model, resolution, rank)")
    p.add_argument("--model-file", help="the DiT file (random weights: bench/model_files.py dit); tiny profiles "
                                        "need none")
    p.add_argument("--device", default="cuda:0", help="the one device both replicas run on")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="first steps not timed")
    p.add_argument("--rows", required=True, help="the JSON lines file the rows are appended to")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error(f"--steps {a.steps}: more than --warmup {a.warmup}, or nothing is timed")
    bridge_folder = comfy_bridge.find_comfyui_or_raise()
    comfy_bridge.import_comfy(bridge_folder, cpu=not a.device.startswith("cuda"))
    with comfy_bridge.comfy_training_mode():
        one, two = case(a, 1), case(a, 2)
    loss = max(0.0, two["s_per_step"] / one["s_per_step"] - 1)
    estimate = {"estimate": "one_process_loss_one_device", "value": loss, "device": a.device, "profile": a.profile,
                "from": "two workers' step / one worker's step - 1, the same micro-batches",
                "when": time.strftime("%Y-%m-%d %H:%M")}
    Path(a.rows).parent.mkdir(parents=True, exist_ok=True)
    for row in (one, two, estimate):
        append_line(a.rows, json.dumps(row))
    print(f"one worker {one['s_per_step']:.3f} s/step, two workers {two['s_per_step']:.3f} s/step; two workers "
          f"in one process add {loss:.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

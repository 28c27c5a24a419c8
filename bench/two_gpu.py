"""Replicas against one copy of the model (issue 40), each as `python -m ugpum train` runs it: on two GPUs
against the split, or, on one GPU named twice, two worker threads of one process against one worker.

  python bench/model_files.py dit --model flux2-klein-base-9b --path /tmp/k9-base.safetensors   # random weights
  python bench/two_gpu.py --profile klein-9b-1024 --model-file /tmp/k9-base.safetensors --devices cuda:0,cuda:1 \
      --grad-accum 2,4,8 --steps 8 --rows bench/results/two_gpu.jsonl --work /tmp/two_gpu
  python bench/two_gpu.py --profile klein-9b-1024 --model-file /tmp/k9-base.safetensors --devices cuda:0,cuda:0 \
      --layouts one,replicas --grad-accum 2 --rows OUT/one_process.jsonl --work /tmp/one_process
  python bench/two_gpu.py --profile tiny-flux2 --devices cpu,cpu --grad-accum 2 --steps 3 --rows R.jsonl --work W

For every --grad-accum m, one run of each of the two --layouts, each in its own process, with the same settings:
`split` (one copy of the model, split over the two devices), `one` (one copy on the first device) and `replicas`
(a copy on each, training m / 2 micro-batches, gradients summed on the first). A row per run: the plan it trained
with (layout, forecast s/step) and what it measured (median s/step after --warmup steps, from its metrics.jsonl);
then a row comparing the two: the measured and the forecast speed-up of the second, and how far their LoRAs
differ (the replicas add the gradients in one GPU's order: on the CPU they are the same bit for bit). With one
GPU named twice, the replicas' step over the one worker's, less 1, is what one process loses driving two
workers (ugpum/planning/replicas.py's ONE_PROCESS_LOSS). Nothing of the training or the planning is here: the
runs are the command line's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ugpum.formats.atomic import append_line  # noqa: E402

LAYOUTS = {"split": 1, "one": 1, "replicas": 2}           # copies of the model


def train(a, m: int, layout: str) -> Path:
    """One `python -m ugpum train` run of `layout` at `m` micro-batches per step; its run folder."""
    out = Path(a.work) / f"{layout}_m{m}"
    devices = a.devices.split(",")[0] if layout == "one" else a.devices
    cmd = [sys.executable, "-m", "ugpum", "train", "--profile", a.profile, "--dataset", a.dataset, "--devices",
           devices, "--grad-accum", str(m), "--replicas", str(LAYOUTS[layout]), "--steps", str(a.steps),
           "--sample-every", "0", "--out", str(out), "--overwrite"]
    if a.model_file:
        cmd += ["--model", a.model_file, "--stand-in-encoders"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{layout} at grad-accum {m} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return out


def measured(a, out: Path, m: int, layout: str) -> dict:
    """The row of one run: its plan and its measured step time."""
    plan = json.loads((out / "plan.json").read_text())
    seconds = [json.loads(line)["seconds"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = seconds[a.warmup:] or seconds
    return {"layout": layout, "grad_accum": m, "devices": a.devices, "profile": a.profile,
            "copies": len(plan["replicas"]) or 1, "shares": plan["shares"] or [m], "base_compute": plan["base_compute"],
            "forecast_s": plan["predicted_step_s"], "s_per_step": statistics.median(timed), "step_times": seconds,
            "lora": str(out / "ugpum_lora.safetensors")}


def lora_difference(a_path: str, b_path: str) -> float:
    """The largest relative difference between two LoRA files, tensor by tensor."""
    from safetensors.torch import load_file
    x, y = load_file(a_path), load_file(b_path)
    return max(float((x[k] - y[k]).norm() / max(float(x[k].norm()), 1e-30)) for k in x) if x else 0.0


def compared(first: dict, second: dict) -> dict:
    return {"compare": f"{second['layout']} vs {first['layout']}", "grad_accum": first["grad_accum"],
            "devices": first["devices"], "profile": first["profile"],
            "speedup": first["s_per_step"] / second["s_per_step"],
            "forecast_speedup": first["forecast_s"] / second["forecast_s"],
            "lora_relative_difference": lora_difference(first["lora"], second["lora"])}


def layouts(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",")]
    if len(names) != 2 or not set(names) <= set(LAYOUTS) or names[0] == names[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: two of {', '.join(LAYOUTS)}, e.g. split,replicas")
    return names


def ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: whole numbers separated by commas, e.g. 2,4,8") from None
    if not values or min(values) < 2 or any(v % 2 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: even numbers of at least 2 (each replica trains half)")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="klein-9b-1024", help="the training profile both layouts run")
    p.add_argument("--model-file", help="the DiT file (random weights from bench/model_files.py dit; tiny "
                                        "profiles need none); the runs use stand-in encoders")
    p.add_argument("--devices", default="cuda:0,cuda:1", help="the two devices, e.g. cuda:0,cuda:1 (cpu,cpu: smoke)")
    p.add_argument("--dataset", default=str(ROOT / "demo_datasets" / "loranne"))
    p.add_argument("--grad-accum", type=ints, default=[2, 4, 8], help="micro-batches per step, e.g. 2,4,8")
    p.add_argument("--layouts", type=layouts, default=["split", "replicas"], help="the two compared: split,replicas "
                                                                                  "or one,replicas")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="first steps not timed (compiling, warming up)")
    p.add_argument("--rows", required=True, help="the JSON lines file the rows are appended to")
    p.add_argument("--work", required=True, help="a scratch folder for the runs")
    a = p.parse_args(argv)
    if len(a.devices.split(",")) != 2:
        p.error(f"--devices {a.devices}: name two devices, e.g. cuda:0,cuda:1")
    if a.steps <= a.warmup:
        p.error(f"--steps {a.steps}: more than --warmup {a.warmup}, or nothing is timed")
    Path(a.rows).parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    for m in a.grad_accum:
        first, second = (measured(a, train(a, m, layout), m, layout) for layout in a.layouts)
        for row in (first, second, compared(first, second)):
            append_line(a.rows, json.dumps({**row, "when": stamp}))
        print(f"grad-accum {m}: " + ", ".join(f"{r['layout']} {r['s_per_step']:.3f} s/step" for r in (first, second)),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

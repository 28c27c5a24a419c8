"""Profile a few training steps of any Python program that steps a torch optimizer, and write a kernel table
by op class (issue 41): our CLI through bench/cards.py, or the reference peer, unchanged.

    python bench/profile_steps.py --out OUT/prof_ours_033 -- bench/cards.py --model-file K9 ... --rows R --work W
    python bench/profile_steps.py --out OUT/prof_peer -- peer_reference.py --out OUT/speed.jsonl --call X

The program runs in this process (runpy, its own argv). A global optimizer-step hook advances torch.profiler's
schedule: `--skip` steps pass unrecorded (compile, warm-up), then `--active` steps are recorded, each from one
optimizer step's end to the next one's: forward, backward and the optimizer's own kernels, and whatever the
program does between steps. Writes OUT.json and OUT.txt: GPU time per step by op class (matmuls, attention,
norms and modulation, activations, casts and copies, other elementwise, optimizer, memory copies), the GPU's busy
share of the step's wall time, host syncs, the 25 costliest kernels, and the matrix products by shape (LoRA's
have the rank as one dimension); with --trace, OUT.trace.json.gz is the timeline (Perfetto). On the CPU, aten
ops stand in for kernels.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import runpy
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

# First match wins: kernel names of cuBLAS/CUTLASS/flash/cuDNN and of inductor's fused Triton kernels (whose
# names list the ops they fuse), and aten op names on the CPU.
OP_CLASSES = [
    ("optimizer", r"adam|multi_tensor|foreach|_fused_adam"),
    ("attention", r"flash|fmha|attention|sdpa|_efficient_attention|cudnn.*(sdpa|mha)"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|wgmma|\bmm\b|aten::(mm|addmm|bmm|matmul|linear|_scaled_mm|_int_mm)|"
               r"triton_tem|sm90_|splitk|cublas|^scaled_mm_8bit"),     # (the last: ugpum.compute.kernels')
    ("memory copy", r"memcpy|memset|Memcpy|Memset"),
    ("norm and modulation", r"rsqrt|norm|layer_norm|rms|mean"),
    ("activation", r"silu|gelu|sigmoid|tanh|swiglu"),
    ("casts and copies", r"_to_copy|copy_|clone|cat|contiguous|convert|to_copy|fill|zero"),
    ("elementwise (rope, residuals, LoRA scale)", r"triton_|elementwise|mul|add|sub|div|pow|where|reduce|sum"),
]


def op_class(name: str) -> str:
    for label, pattern in OP_CLASSES:
        if re.search(pattern, name, re.I):
            return label
    return "other"


def is_annotation(name: str) -> bool:
    """A range the profiler draws on the GPU's timeline beside the kernels (the step, a compiled graph's call,
    the optimizer's step): it spans kernels, it is none."""
    return name.startswith(("ProfilerStep", "## ", "Optimizer.", "autograd::", "CompiledFunction"))


def kernel_events(prof) -> tuple[list, bool]:
    """(events, on_gpu): the device kernels and copies of the recorded steps, else the CPU's aten ops."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not getattr(e, "is_user_annotation", False) and not is_annotation(e.name)]
    if events:
        return events, True
    top = [e for e in prof.events() if e.name.startswith("aten::")
           and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
    return top, False


def busy_ms(events) -> float:
    """The union of the kernels' time intervals (ms): the GPU's busy time, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in events):
        total += max(0.0, stop - max(start, end))         # the part of it after everything before it ended
        end = max(end, stop)
    return total / 1000


def mm_shapes(prof, steps: int, on_gpu: bool) -> list:
    """The matrix products by input shape (device time per step; CPU time on the CPU), costliest first."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if re.fullmatch(r"aten::(mm|addmm|bmm|_scaled_mm|_int_mm)", e.key):
            us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
            rows.append({"op": e.key, "shapes": str(e.input_shapes)[:160], "calls_per_step": e.count / steps,
                         "ms_per_step": round(us / 1000 / steps, 3)})
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:30]


def summarise(prof, steps: int, wall_s: list[float]) -> dict:
    events, on_gpu = kernel_events(prof)
    by_class, by_name = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e in events:
        ms = (e.time_range.end - e.time_range.start) / 1000 if on_gpu else e.self_cpu_time_total / 1000
        by_class[op_class(e.name)] += ms
        by_name[e.name][0] += ms
        by_name[e.name][1] += 1
    total = sum(by_class.values())
    syncs = defaultdict(int)
    for e in prof.events():
        if re.search(r"Synchronize|cudaMemcpy(Async)?$|item|_local_scalar_dense", e.name):
            syncs[e.name] += 1
    step_wall_ms = 1000 * sum(wall_s) / max(1, len(wall_s))
    return {
        "device": "cuda" if on_gpu else "cpu", "steps": steps,
        "step_wall_ms": round(step_wall_ms, 1),
        "kernel_ms_per_step": round(total / steps, 1),
        "gpu_busy_ms_per_step": round(busy_ms(events) / steps, 1) if on_gpu else None,
        "by_class_ms_per_step": {k: round(v / steps, 2) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "host_syncs_per_step": {k: v / steps for k, v in sorted(syncs.items())},
        "top_kernels": [{"name": n[:140], "class": op_class(n), "ms_per_step": round(v[0] / steps, 2),
                         "calls_per_step": v[1] / steps}
                        for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]],
        "matmuls_by_shape": mm_shapes(prof, steps, on_gpu),
    }


def write_table(summary: dict, path: Path, label: str) -> None:
    s = summary
    lines = [f"# {label}: {s['steps']} steps on {s['device']}; wall {s['step_wall_ms']} ms/step, kernels "
             f"{s['kernel_ms_per_step']} ms/step, GPU busy {s['gpu_busy_ms_per_step']} ms/step", "",
             "| op class | ms/step | share |", "|---|---|---|"]
    total = sum(s["by_class_ms_per_step"].values()) or 1
    lines += [f"| {k} | {v:.1f} | {100 * v / total:.1f} % |" for k, v in s["by_class_ms_per_step"].items()]
    # (aten::item reads CPU tensors too, AdamW's step counters among them: only the CUDA calls wait for the GPU)
    lines += ["", "host syncs and scalar reads per step: " + (", ".join(
        f"{k} {v:g}" for k, v in s["host_syncs_per_step"].items()) or "none"), "", "| kernel | class | ms/step | calls/step |",
              "|---|---|---|---|"]
    lines += [f"| `{k['name']}` | {k['class']} | {k['ms_per_step']} | {k['calls_per_step']:g} |"
              for k in s["top_kernels"]]
    lines += ["", "| matmul | shapes | calls/step | ms/step |", "|---|---|---|---|"]
    lines += [f"| {m['op']} | {m['shapes']} | {m['calls_per_step']:g} | {m['ms_per_step']} |"
              for m in s["matmuls_by_shape"]]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        sys.exit("usage: profile_steps.py --out PREFIX [--skip N] [--active N] -- (PROGRAM.py | -m MODULE) [ARGS...]")
    cut = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="path prefix of the files written (.json, .txt, .trace.json.gz)")
    p.add_argument("--skip", type=int, default=6, help="optimizer steps before recording (compile, warm-up)")
    p.add_argument("--active", type=int, default=2, help="optimizer steps recorded")
    p.add_argument("--label", default="")
    p.add_argument("--trace", action="store_true", help="also write the timeline, OUT.trace.json.gz")
    a = p.parse_args(argv[:cut])
    program, program_args = argv[cut + 1], argv[cut + 2:]       # PROGRAM.py, or -m MODULE
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    wall: list[float] = []
    last, done = [None], [False]

    def ready(prof):
        summary = summarise(prof, a.active, wall[-a.active:])
        summary.update(label=a.label or out.name, command=" ".join(sys.argv))
        out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
        write_table(summary, out.with_suffix(".txt"), summary["label"])
        if a.trace:
            trace = out.with_suffix(".trace.json")
            prof.export_chrome_trace(str(trace))
            with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            trace.unlink()
        print(f"profile_steps: {a.active} steps recorded -> {out}.txt", flush=True)
        done[0] = True

    prof = profile(activities=activities, record_shapes=True,
                   schedule=schedule(wait=a.skip - 1, warmup=1, active=a.active, repeat=1), on_trace_ready=ready)

    def after_step(optimizer, args, kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if last[0] is not None:
            wall.append(now - last[0])
        last[0] = now
        if not done[0]:
            prof.step()

    handle = register_optimizer_step_post_hook(after_step)
    sys.argv = [program, *program_args]
    prof.start()
    try:
        if program == "-m":
            sys.argv = program_args
            sys.path.insert(0, str(Path.cwd()))          # as `python -m` puts the working folder first
            runpy.run_module(program_args[0], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(program, run_name="__main__")
    except SystemExit as stop:
        return int(stop.code or 0) if not isinstance(stop.code, str) else 1
    finally:
        handle.remove()
        if not done[0]:
            prof.stop()
            print(f"profile_steps: the program stepped its optimizer {len(wall) + 1} times, fewer than "
                  f"--skip {a.skip} + --active {a.active}: nothing recorded", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

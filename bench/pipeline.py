"""GPU check for the pipeline (issue 6): two stages placed on the same GPU cost no more than 3 % over
the unsplit model, at m = 1 and m = 4 micro-batches, for every schedule; and no host synchronisation
happens inside a step (torch.profiler: cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize
events inside the step's range).

  COMFYUI_PATH=/path/to/ComfyUI python bench/pipeline.py --model flux2-klein-9b --out bench/results

Random weights are made on the GPU (the model is built on the meta device by ComfyUI's own class,
then `to_empty` + normal(0, 0.02)), so no checkpoint file is needed. LoRA rank 16 on every block
Linear, FLUX.2's in-place guard, per-block checkpointing unless --checkpointing none, bf16 autocast.
Steps of the configurations are interleaved round by round so clock drift hits all of them alike.
Writes DIR/pipeline.json and DIR/pipeline.md (and the profiler traces, gzipped, beside them).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # lets cuBLAS run deterministically (grad check)
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from comfy_bridge import build_meta, comfy_training_mode, find_comfyui_or_raise, import_comfy  # noqa: E402
from ugpum.arch import Workload, get_spec  # noqa: E402
from ugpum.compute.recompute import recompute_blocks  # noqa: E402
from ugpum.compute.compile import compile_blocks  # noqa: E402
from ugpum.compute.inplace_guard import guard_inplace_residuals  # noqa: E402
from ugpum.placement.pipeline import SCHEDULES, accumulate  # noqa: E402
from ugpum.placement.place import Layout, place  # noqa: E402
from ugpum.compute.lora import attach_lora, lora_targets  # noqa: E402

GIB = 1024 ** 3
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
BLOCKING_COPIES = ("cudaMemcpy", "cudaMemcpy2D", "cudaMemset")   # the non-Async forms wait for the GPU
STEP_RANGE = "ugpum_step"


def random_model(spec, dev: str):
    model = build_meta(spec, torch.bfloat16)
    model.to_empty(device=dev)
    gen = torch.Generator(dev).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for b in model.buffers():          # none in ComfyUI's FLUX.2 / Wan; keep them finite anyway
            if b.is_floating_point():
                b.zero_()
    model.requires_grad_(False)
    return model


def micro_batches(spec, w: Workload, m: int, dev: str) -> list[dict]:
    gen = torch.Generator(dev).manual_seed(1)
    out = []
    for _ in range(m):
        if spec.family == "wan":
            x = torch.randn(1, 16, 1 + (w.frames - 1) // 4, w.height // 8, w.width // 8, device=dev, generator=gen)
        else:
            x = torch.randn(1, 128, w.height // 16, w.width // 16, device=dev, generator=gen)
        ctx = torch.randn(1, w.text_tokens, spec.context_dim, device=dev, generator=gen)
        t = torch.rand(1, device=dev, generator=gen) * spec.timestep_scale
        out.append(dict(x=x.bfloat16(), timestep=t, context=ctx.bfloat16(), target=torch.randn_like(x)))
    return out


def make_step(model, m: int, dev: str):
    def step(mb):
        with torch.autocast(torch.device(dev).type, dtype=torch.bfloat16):
            out = model(mb["x"], mb["timestep"], mb["context"], transformer_options={})
        return (out.float() - mb["target"]).pow(2).mean() / m
    return step


class Bench:
    def __init__(self, args):
        self.args = args
        self.dev = "cuda:0" if torch.cuda.is_available() else "cpu"    # cpu: a smoke run only
        self.spec = get_spec(args.model)
        self.w = Workload(width=args.resolution, height=args.resolution, frames=args.frames,
                          recompute="all" if args.checkpointing == "block" else "none", rank=16)
        self.model = random_model(self.spec, self.dev)
        paths = [b.path for b in self.spec.blocks]
        targets = lora_targets(paths, [b.linears for b in self.spec.blocks])
        self.lora = attach_lora(self.model, targets, rank=16, alpha=16)
        self.params = [p for _, a in self.lora.items() for p in a.parameters()]
        with torch.no_grad():                          # B != 0: every adapter gets a gradient
            for _, a in self.lora.items():
                a.B.normal_(0.0, 1e-3)
        guard_inplace_residuals(self.model, include_rms=False)
        compile_blocks(self.model, paths, args.compile)      # before checkpointing wraps the forwards
        if self.w.recompute == "all":
            recompute_blocks(self.model, paths)
        cut = args.cut or len(paths) // 2
        self.layout = Layout({p: self.dev for p in paths}, self.dev, self.dev, self.spec.tail_modules,
                             (tuple(paths[:cut]), tuple(paths[cut:])))
        self.cut = cut
        self.opt = torch.optim.AdamW(self.params, lr=1e-6)
        self.batches = {m: micro_batches(self.spec, self.w, m, self.dev) for m in args.micro_batches}
        self.placement = None

    # split = two stages on the GPU (router + pipeline); unsplit = the plain model
    def split(self, on: bool) -> None:
        if on and self.placement is None:
            self.placement = place(self.model, self.layout)
        elif not on and self.placement is not None:
            self.placement.undo()
            self.placement = None

    def step(self, split: bool, schedule: str, m: int, profile_range: bool = False):
        self.split(split)
        mbs = self.batches[m]
        ctx = torch.profiler.record_function(STEP_RANGE) if profile_range else _null()
        with ctx:
            losses = accumulate(make_step(self.model, m, self.dev), mbs, schedule, self.layout, self.model)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return losses

    def timed_step(self, split: bool, schedule: str, m: int) -> float:
        _sync()
        t0 = time.perf_counter()
        self.step(split, schedule, m)
        _sync()
        return time.perf_counter() - t0

    def grads(self, split: bool, schedule: str, m: int) -> torch.Tensor:
        self.split(split)
        self.opt.zero_grad(set_to_none=True)
        accumulate(make_step(self.model, m, self.dev), self.batches[m], schedule, self.layout, self.model)
        g = torch.cat([p.grad.float().flatten() for p in self.params])
        self.opt.zero_grad(set_to_none=True)
        return g


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def configs(ms: list[int]) -> list[tuple[str, bool, str, int]]:
    out = []
    for m in ms:
        out.append((f"unsplit m={m}", False, "sequential", m))
        out += [(f"2 stages {s} m={m}", True, s, m) for s in SCHEDULES]
    return out


def count_syncs(trace_path: Path) -> dict:
    """Host-synchronising CUDA calls inside the step's range of a chrome trace."""
    data = json.loads(trace_path.read_text())
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if e.get("name") == STEP_RANGE and e.get("cat") in ("user_annotation", "cpu_op")]
    if not steps:
        return {"error": f"no '{STEP_RANGE}' range in the trace"}
    a = min(e["ts"] for e in steps)
    b = max(e["ts"] + e["dur"] for e in steps)
    inside = [e for e in events if a <= e["ts"] <= b]
    syncs = [e for e in inside if any(s in e["name"] for s in SYNC_CALLS) or e["name"] in BLOCKING_COPIES]
    launches = sum(1 for e in inside if e.get("cat") == "cuda_runtime" and "Launch" in e["name"])
    kernels = sum(1 for e in inside if e.get("cat") == "kernel")
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    return {"step_ms": round((b - a) / 1e3, 2), "sync_calls": len(syncs),
            "sync_names": sorted({e["name"] for e in syncs}),
            "kernel_launches": launches, "kernels": kernels,
            "first_syncs": [{"name": e["name"], "ms_into_step": round((e["ts"] - a) / 1e3, 3)} for e in syncs[:5]],
            "gpu_busy_ms": round(sum(y - x for x, y in _merge(gpu)) / 1e3, 2)}


def _merge(spans):
    out = []
    for x, y in spans:
        if out and x <= out[-1][1]:
            out[-1][1] = max(out[-1][1], y)
        else:
            out.append([x, y])
    return out


def profile(bench: Bench, split: bool, schedule: str, m: int, out_dir: Path, label: str) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    bench.timed_step(split, schedule, m)                      # settle hooks/allocator before tracing
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        bench.step(split, schedule, m, profile_range=True)
        torch.cuda.synchronize()                               # outside the step's range
    raw = out_dir / f"pipeline_trace_{label}.json"
    prof.export_chrome_trace(str(raw))
    result = count_syncs(raw)
    with open(raw, "rb") as f, gzip.open(str(raw) + ".gz", "wb") as g:
        g.write(f.read())
    raw.unlink()
    result["trace"] = raw.name + ".gz"
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux2-klein-9b")
    p.add_argument("--out", default="bench/results", help="folder for pipeline.json / pipeline.md")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--frames", type=int, default=1)
    p.add_argument("--checkpointing", choices=["block", "none"], default="block")
    p.add_argument("--micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--rounds", type=int, default=5, help="timed steps per configuration")
    p.add_argument("--cut", type=int, default=0, help="first block of stage 2 (default: the middle)")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--compile", choices=["off", "on"], default="off",
                   help="compiled blocks (ugpum.compute.compile); results go to pipeline_compiled.json/.md")
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    comfy_path = find_comfyui_or_raise()
    import_comfy(comfy_path, cpu=not torch.cuda.is_available())

    with comfy_training_mode():
        t0 = time.time()
        bench = Bench(args)
        print(f"model built in {time.time() - t0:.0f} s; stages: blocks 0-{bench.cut - 1} | "
              f"{bench.cut}-{len(bench.spec.blocks) - 1}", flush=True)
        cases = configs(args.micro_batches)

        # correctness on the GPU: accumulated LoRA gradients, split schedules vs the unsplit model, with
        # deterministic kernels (bf16 kernels that reduce in a varying order make two runs of the same
        # unsplit model differ by ~1e-2 through 32 random blocks); the unsplit repeat is the noise floor
        m_check = 2
        bench.batches.setdefault(m_check, micro_batches(bench.spec, bench.w, m_check, bench.dev))
        torch.use_deterministic_algorithms(True, warn_only=True)
        ref = bench.grads(False, "sequential", m_check)
        grad_check = {"unsplit again": float((bench.grads(False, "sequential", m_check) - ref).norm() / ref.norm())}
        grad_check.update({s: float((bench.grads(True, s, m_check) - ref).norm() / ref.norm()) for s in SCHEDULES})
        torch.use_deterministic_algorithms(False)
        print("gradient relative difference vs unsplit:", grad_check, flush=True)

        peak = {}
        for name, split, schedule, m in cases:                 # warm-up; peak memory per configuration
            bench.timed_step(split, schedule, m)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            bench.timed_step(split, schedule, m)
            peak[name] = _peak_gib()
        times = {name: [] for name, *_ in cases}
        for r in range(args.rounds):
            for name, split, schedule, m in cases:
                times[name].append(bench.timed_step(split, schedule, m))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {t[-1]:.3f}" for n, t in times.items()),
                  flush=True)

        rows = []
        for name, split, schedule, m in cases:
            med = statistics.median(times[name])
            base = statistics.median(times[f"unsplit m={m}"])
            rows.append({"config": name, "split": split, "schedule": schedule, "micro_batches": m,
                         "s_per_step_median": round(med, 4), "s_per_step": [round(t, 4) for t in times[name]],
                         "overhead_vs_unsplit": round(med / base - 1, 4),
                         "peak_gib": round(peak[name], 2)})

        profiles = {}
        if not args.no_profile and torch.cuda.is_available():
            m = max(args.micro_batches)
            for label, split, schedule in (("unsplit", False, "sequential"), ("gpipe", True, "gpipe"),
                                           ("1f1b", True, "1f1b")):
                profiles[f"{label} m={m}"] = profile(bench, split, schedule, m, out_dir, f"{label}_m{m}")
                print(label, profiles[f"{label} m={m}"], flush=True)
        bench.split(False)

    worst = max(r["overhead_vs_unsplit"] for r in rows if r["split"])
    syncs = sum(p.get("sync_calls", 0) for k, p in profiles.items() if not k.startswith("unsplit"))
    record = {
        "issue": 6, "command": " ".join(sys.argv), "model": bench.spec.id,
        "workload": {"resolution": args.resolution, "frames": args.frames, "checkpointing": args.checkpointing,
                     "rank": 16, "autocast": "bf16", "compile": args.compile, "stages": [[0, bench.cut], [bench.cut, len(bench.spec.blocks)]],
                     "device": f"both stages on {bench.dev}"},
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "comfyui": str(comfy_path), "rounds": args.rounds,
        "results": rows, "grad_rel_diff_vs_unsplit": grad_check, "profiles": profiles,
        "verdict": {"worst_overhead": worst, "overhead_ok": worst <= 0.03,
                    "host_syncs_in_pipelined_steps": syncs, "no_host_sync": syncs == 0 if profiles else None},
    }
    name = "pipeline_compiled" if args.compile == "on" else "pipeline"
    (out_dir / f"{name}.json").write_text(json.dumps(record, indent=1))
    (out_dir / f"{name}.md").write_text(markdown(record))
    print(json.dumps(record["verdict"]))


def markdown(r: dict) -> str:
    w = r["workload"]
    lines = [f"# Pipeline overhead on one GPU ({r['model']}, issue 6)", "",
             f"{r['gpu']}, torch {r['torch']}, {w['resolution']}² x{w['frames']} frame(s), LoRA rank {w['rank']}, "
             f"{w['autocast']} autocast, checkpointing {w['checkpointing']}; two stages (blocks "
             f"{w['stages'][0][0]}-{w['stages'][0][1] - 1} | {w['stages'][1][0]}-{w['stages'][1][1] - 1}) both on "
             f"{w['device'].split(' on ')[-1]} vs the unsplit model. Median of {r['rounds']} interleaved steps.", "",
             "| configuration | s/step | vs unsplit | peak GiB |", "|---|---:|---:|---:|"]
    for row in r["results"]:
        lines.append(f"| {row['config']} | {row['s_per_step_median']:.3f} | "
                     f"{100 * row['overhead_vs_unsplit']:+.1f} % | {row['peak_gib']:.1f} |")
    lines += ["", "Gradient of the accumulated LoRA (m = 2, deterministic kernels), relative difference to the "
              "unsplit model: "
              + ", ".join(f"{k} {v:.1e}" for k, v in r["grad_rel_diff_vs_unsplit"].items())]
    if r["profiles"]:
        lines += ["", "| profiled step | step ms | GPU busy ms | host syncs | kernels |", "|---|---:|---:|---:|---:|"]
        for k, p in r["profiles"].items():
            lines.append(f"| {k} | {p.get('step_ms')} | {p.get('gpu_busy_ms')} | {p.get('sync_calls')} | "
                         f"{p.get('kernels')} |")
    v = r["verdict"]
    lines += ["", f"Worst overhead of a split configuration: {100 * v['worst_overhead']:+.1f} % "
              f"({'within' if v['overhead_ok'] else 'OVER'} the 3 % budget). Host syncs inside pipelined steps: "
              f"{v['host_syncs_in_pipelined_steps']}.", "", f"Command: `{r['command']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

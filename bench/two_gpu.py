"""Two GPUs in one process (issue 7): the split against one GPU, each card capped to play a consumer card.

  COMFYUI_PATH=/path/to/ComfyUI python bench/two_gpu.py --devices cuda:0,cuda:1 --ckpt-dir /tmp --out bench/results
  python bench/two_gpu.py --cases klein_schedules --micro-batches 1,2,4,8 --ckpt-dir /tmp --out DIR
  python bench/two_gpu.py --devices cuda:0,cuda:0 ...        # the one-GPU trial: it runs, not how fast
  python bench/two_gpu.py --devices cpu,cpu --model tiny-flux2 --resolution 64 --text-tokens 8 --rank 2 --steps 2

Cases (--cases, comma-separated, most important first; default all):
  wan_split        Wan 2.1 14B (bf16, one 1024² frame, LoRA): split over two GPUs capped at --cap-gib each, at
                   --wan-micro-batches with the schedule training picks ("auto"; it stays sequential when the
                   plan swaps blocks) and, as an experiment, 1f1b forced over the swapped stages; against one
                   GPU capped at --cap-gib with block swap (one micro-batch per step).
  klein_schedules  FLUX.2 klein 9B at 1024²: one GPU unconstrained (sequential accumulation) against the split
                   at every m of --micro-batches with every schedule; throughput ratio against p·m/(m+p-1).
  mixed_caps       klein 9B on two GPUs capped at --mixed-caps-gib (16,8 GiB): the planner's split against an
                   even one (each stage swapping what does not fit).
  staged_copies    klein 9B split, GPU-to-GPU copies direct against staged through pinned host memory (what
                   GeForce cards without peer access do; `ugpum.placement.copy.staged_copies`), interleaved step by
                   step in one process; raw copy bandwidth of both paths; LoRA gradients of both compared.
Every entry holds, per GPU, the plan's memory forecast and the allocator's peak (the issue's case 5).

Weights are random, written once per model to --ckpt-dir (deleted afterwards unless --keep-ckpt) and
streamed from there by the plan, as training does; LoRA rank --rank on every block linear, bf16
autocast, per-block checkpointing, AdamW. Each run (one placement: a device set, caps and a split) goes
in a process of its own on CUDA, so caps never meet memory another run still holds; its configurations
(schedule x micro-batches x copy path) are timed round by round, interleaved. Results are merged into
OUT/two_gpu.json (a list of entries; an entry measured again is replaced) and OUT/two_gpu.md after
every run, so a session cut short keeps what finished.

--devices cuda:0,cuda:0 runs both stages on one GPU (caps summed and applied once to it): this proves the
code runs end to end, with memory within the summed cap. It measures no speed-up (both stages share one
GPU's compute), and no copy between stages happens (same device); the copy bandwidth probe then measures
a device-to-device copy against a round trip through host memory on that GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import (DEFAULT_ALLOC_CONF, GIB, add_workload_arguments, cap_devices, capped_device,  # noqa: E402
                          command_line, example_inputs, fmt, lora_training_setup, real_device,
                          sync as sync_device, write_random_checkpoint)

CASES = ("wan_split", "klein_schedules", "mixed_caps", "staged_copies")
WAN, KLEIN = "wan2.1-14b", "flux2-klein-9b"
CASE_MODEL = {"wan_split": WAN, "klein_schedules": KLEIN, "mixed_caps": KLEIN, "staged_copies": KLEIN}
# entries with the same values here describe the same measurement: the newer one replaces the older
ENTRY_KEY = ("case", "variant", "model", "devices", "caps_gib", "micro_batches", "schedule_requested",
             "staged_copies", "resolution", "frames", "text_tokens", "rank")
TARGETS = {"overhead_m1": 0.05, "klein_m4_speedup": 1.5, "wan_m4_vs_swap": 1.5}


# ---------------------------------------------------------------------------------------------
# what to run

@dataclass
class Run:
    """One placement (devices, caps, split) and the configurations timed on it."""
    case: str
    variant: str
    model: str
    devices: list[str]
    caps_gib: list[float] | None
    configs: list[tuple[str, int]]              # (schedule or "auto", micro-batches per step)
    split: str = "plan"                          # "plan" or "even"
    staged_modes: list[bool] = field(default_factory=lambda: [False])
    grad_checks: list[tuple[str, str, bool]] = field(default_factory=list)   # (label, schedule, staged)
    measure_copies: bool = False

    @property
    def name(self) -> str:
        return f"{self.case}/{self.variant}"


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers separated by commas") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers of at least 1")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected GiB values separated by commas") from None
    if len(values) != 2 or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected two positive GiB values, e.g. 16,8")
    return values


def case_runs(case: str, args) -> list[Run]:
    d0, d1 = args.devices
    model = args.model or CASE_MODEL[case]
    if case == "wan_split":
        cap = args.cap_gib
        runs = []
        for schedule in args.wan_schedules:
            ms = [m for m in args.wan_micro_batches if schedule in ("auto", "sequential") or m > 1]
            if ms:
                runs.append(Run(case, "split" if schedule == "auto" else f"split_{schedule}", model, [d0, d1],
                                [cap, cap], [(schedule, m) for m in ms],
                                grad_checks=[] if schedule in ("auto", "sequential") else
                                [(f"{schedule} vs sequential", schedule, False)]))
        runs.append(Run(case, "swap", model, [d0], [cap], [("sequential", 1)]))
        return runs
    if case == "klein_schedules":
        from ugpum.placement.pipeline import SCHEDULES
        return [Run(case, "one_gpu", model, [d0], None, [("sequential", m) for m in args.micro_batches]),
                Run(case, "split", model, [d0, d1], None,
                    [(s, m) for m in args.micro_batches for s in SCHEDULES])]
    if case == "mixed_caps":
        configs = [("auto", m) for m in args.mixed_micro_batches]
        return [Run(case, "planner", model, [d0, d1], list(args.mixed_caps_gib), configs),
                Run(case, "even", model, [d0, d1], list(args.mixed_caps_gib), configs, split="even")]
    if case == "staged_copies":
        return [Run(case, "copies", model, [d0, d1], None, [("auto", m) for m in args.copy_micro_batches],
                    staged_modes=[False, True], measure_copies=True,
                    grad_checks=[("run's schedule, direct copies", "auto", False),
                                 ("run's schedule, staged copies", "auto", True)])]
    raise ValueError(f"unknown case {case!r}: choose from {', '.join(CASES)}")


def selected_runs(args) -> list[Run]:
    runs = [r for case in args.cases for r in case_runs(case, args)]
    if args.only:
        unknown = set(args.only) - {r.name for r in runs}
        if unknown:
            raise SystemExit(f"--only {','.join(sorted(unknown))}: no such run among "
                             f"{', '.join(r.name for r in runs)}")
        runs = [r for r in runs if r.name in args.only]
    return runs


# ---------------------------------------------------------------------------------------------
# one run (in a child process on CUDA)

def workload(args):
    from ugpum.arch import Workload
    return Workload(width=args.resolution, height=args.resolution, frames=args.frames,
                    text_tokens=args.text_tokens, recompute="all", rank=args.rank)


def logical_devices(run: Run) -> tuple[list, list]:
    """(the plan's devices, capped where the run caps them; the real devices probed, one per GPU)."""
    real = {}
    for d in run.devices:
        if d not in real:
            real[d] = dataclasses.replace(real_device(d), torch_device=d)
    devices = [real[d] if not run.caps_gib else capped_device(real[d], cap)
               for d, cap in zip(run.devices, run.caps_gib or [None] * len(run.devices))]
    return devices, list(real.values())


def allocator_limits(run: Run, devices) -> dict[str, int]:
    """Bytes the allocator of each capped GPU may hold: what its stages may use, summed when two
    stages share one GPU (the one-GPU trial)."""
    limits: dict[str, int] = {}
    for d in devices if run.caps_gib else []:
        if d.torch_device.startswith("cuda"):
            limits[d.torch_device] = limits.get(d.torch_device, 0) + d.free_bytes
    return limits


def even_split(n: int, p: int) -> list[int]:
    return [n // p + (1 if k < n % p else 0) for k in range(p)]


def busy_stages(plan) -> int:
    return sum(1 for s in plan.stages if s.blocks[1] > s.blocks[0])


def resolve(spec, devices, w, requested: str, m: int, split):
    """(plan, schedule, micro-batches in flight) the way training resolves them (train/loop.py)."""
    from ugpum.placement.pipeline import best_schedule, in_flight
    from ugpum.planning.plan import make_plan
    plan = make_plan(spec, devices, w, grad_accum=m, split=split)
    schedule = best_schedule(plan, m) if requested == "auto" else requested
    held = in_flight(schedule, busy_stages(plan), m)
    if held > 1:
        plan = make_plan(spec, devices, w, grad_accum=m, in_flight=held, split=split)
    return plan, schedule, held


def memory_forecast(spec, devices, w, held: int, placed) -> list[dict[str, float]]:
    """Per stage, the plan's memory (bytes by kind) for `held` micro-batches in flight on the blocks
    and swap tier actually placed (`placed`, the plan the placement followed)."""
    from ugpum.planning.plan import StageCosts
    ev = StageCosts(spec, devices, w, held)
    return [ev._memory(k, s.blocks[0], s.blocks[1], tuple(s.offloaded)) for k, s in enumerate(placed.stages)]


def copy_bandwidth(devices: list[str], sizes: list[int], repeats: int = 5) -> dict:
    """GB/s of one copy between the two devices, each way, direct (`copy.direct_gpu_copy`: peer access
    where there is some) and staged through pinned host memory (`copy.staged_copy`), timed by wall
    clock (an event pair cannot span two devices); plus torch's plain copy and peer access."""
    from ugpum.placement.copy import direct_gpu_copy, staged_copy
    from ugpum.planning.devices import measure_gpu_to_gpu_gbps, peer_access_matrix
    pairs = [(devices[0], devices[1])] + ([(devices[1], devices[0])] if devices[0] != devices[1] else [])
    cuda = all(d.startswith("cuda") for d in devices)

    def sync():
        for d in set(devices):
            sync_device(d)

    out = {"pairs": [], "peer_access": peer_access_matrix() if cuda else []}
    for src, dst in pairs:
        s, t = torch.device(src), torch.device(dst)
        for nbytes in sizes:
            x = torch.randn(nbytes // 2, device=s).to(torch.bfloat16)
            row = {"src": src, "dst": dst, "mib": round(nbytes / 2 ** 20, 3)}
            direct = (lambda: direct_gpu_copy(x, t)) if cuda else (lambda: x.to(t, copy=True))
            for mode, fn in (("direct", direct), ("staged", lambda: staged_copy(x, t))):
                for _ in range(2):                       # warm: streams, pinned host blocks
                    y = fn()
                sync()
                t0 = time.perf_counter()
                for _ in range(repeats):
                    y = fn()
                sync()
                row[f"{mode}_gbps"] = round(nbytes * repeats / (time.perf_counter() - t0) / 1e9, 2)
                row[f"{mode}_exact"] = bool(torch.equal(y.to(s), x))
            if cuda and s != t:
                row["torch_copy_gbps"] = round(measure_gpu_to_gpu_gbps(s.index, t.index, nbytes, repeats), 2)
            out["pairs"].append(row)
            del x, y
    return out


@dataclass
class Measured:
    """What timing a run's configurations gave, per variant (configuration x copy path)."""
    times: list[list[float]]
    peaks: list[dict[str, float]]
    moved: list[list[int]]
    losses: list[float | None]
    errors: list[str | None]
    load_s: float
    grad_check: dict[str, float]
    copies: dict | None


def execute_run(run: Run, args, ckpt: Path, command: str) -> list[dict]:
    """Place the model by the run's plan, time every configuration, return one entry each."""
    from ugpum.arch import get_spec, recognise
    from ugpum.planning.cost import block_weight_bytes
    from ugpum.planning.devices import gpu_to_gpu_gbps
    from ugpum.planning.plan import make_plan

    spec = get_spec(run.model)
    found, prefix, stored = recognise(ckpt)
    if found.id != spec.id and not spec.id.startswith("tiny"):
        raise ValueError(f"{ckpt} holds {found.id}, not {spec.id}: delete it or point --ckpt-dir elsewhere")
    w = workload(args)
    devices, real = logical_devices(run)
    gpus = sorted({d for d in run.devices if d.startswith("cuda")})
    limits = allocator_limits(run, devices)
    split = even_split(len(spec.blocks), len(devices)) if run.split == "even" else None
    if gpus:
        torch.cuda.empty_cache()          # the device probe's buffers must not count against a cap
    undo_caps = cap_devices(limits) if limits else (lambda: None)
    try:
        resolved = [(req, m, *resolve(spec, devices, w, req, m, split)) for req, m in run.configs]
        # one placement for all configurations: the plan of the one holding the most micro-batches in flight
        placed = max(resolved, key=lambda r: (r[4], r[1]))[2]
        print(f"{run.name}: {placed.verdict}", flush=True)
        variants = [(req, m, plan, schedule, held, staged) for staged in run.staged_modes
                    for req, m, plan, schedule, held in resolved]
        got = measure(run, args, spec, w, placed, ckpt, prefix, resolved, variants, gpus)
    finally:
        undo_caps()

    counts = [s.blocks[1] - s.blocks[0] for s in placed.stages]
    offloaded_bytes = sum(block_weight_bytes(spec.blocks[i], w) for s in placed.stages for i in s.offloaded)
    base = {
        "case": run.case, "variant": run.variant, "model": spec.id, "devices": run.devices,
        "caps_gib": run.caps_gib, "caps_applied": bool(limits),
        "allocator_limit_gib": {d: round(v / GIB, 3) for d, v in limits.items()},
        "one_gpu_trial": len(set(run.devices)) < len(run.devices), "split": run.split,
        "resolution": args.resolution, "frames": args.frames, "text_tokens": args.text_tokens, "batch": 1,
        "rank": args.rank, "checkpointing": "block", "stored_dtype": stored, "command": command,
        "gpus": {d: torch.cuda.get_device_name(d) for d in gpus},
        "torch": torch.__version__, "python": platform.python_version(),
        "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if gpus else "",
        "device_probe": [d.to_json() for d in real], "load_s": round(got.load_s, 1),
        "host_rss_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if len(devices) > 1:      # what the planner assumes for a copy between the stages, and the staged path
        base["forecast_copy_gbps"] = {
            "planner": round(gpu_to_gpu_gbps(devices[0], devices[1]), 2),
            "staged": round(1 / (1 / devices[0].host_gbps + 1 / devices[1].host_gbps), 2)}
    if got.grad_check:
        base["grad_rel_diff"] = got.grad_check
    if got.copies is not None:
        base["copy_bandwidth"] = got.copies
    entries = []
    for i, (req, m, plan, schedule, held, staged) in enumerate(variants):
        mem = memory_forecast(spec, devices, w, held, placed)
        forecast: dict[str, float] = {}
        for stage, parts in zip(placed.stages, mem):
            forecast[stage.torch_device] = forecast.get(stage.torch_device, 0.0) + sum(parts.values()) / GIB
        times = got.times[i]
        timed = times[args.warmup:] or times
        s = round(statistics.median(timed), 4) if timed else None
        at = make_plan(spec, devices, w, grad_accum=m, in_flight=held, split=counts)
        predicted = at.step_s["sequential" if schedule == "sequential" else "pipelined"][min(m, 8) - 1]
        peak = {d: round(v, 3) for d, v in got.peaks[i].items()} if gpus and times else None
        moved = got.moved[i][args.warmup:] or got.moved[i]
        entry = dict(base)
        entry.update({
            "micro_batches": m, "schedule_requested": req, "schedule": schedule, "in_flight": held,
            "staged_copies": staged,
            "stages": [{"device": st.torch_device, "label": st.device, "blocks": st.blocks,
                        "offloaded": st.offloaded, "budget_gib": st.budget_gib,
                        "forecast_gib": round(sum(parts.values()) / GIB, 3),
                        "detail_gib": {k: round(v / GIB, 3) for k, v in parts.items()}}
                       for st, parts in zip(placed.stages, mem)],
            "s_per_step": s, "step_times": [round(v, 4) for v in times],
            "throughput_mb_per_s": round(m / s, 4) if s else None,
            "predicted_s": round(predicted, 4),
            "peak_gib": peak,
            "forecast_gib": {d: round(v, 3) for d, v in forecast.items()},
            "forecast_error": {d: round(forecast[d] / v - 1, 4) for d, v in peak.items() if v} if peak else None,
            "swap_bytes_per_step": int(statistics.median(moved)) if moved else 0,
            "forecast_swap_bytes_per_step": 2 * offloaded_bytes * m,
            "crossing_bytes_per_step": at.crossing_bytes_per_step,
            "final_loss": got.losses[i], "error": got.errors[i]})
        entries.append(entry)
    return entries


def measure(run: Run, args, spec, w, placed, ckpt: Path, prefix: str, resolved, variants, gpus) -> Measured:
    """Stream the model onto the devices by `placed`, add LoRA, and time each variant round by round."""
    from comfy_bridge import build_meta, comfy_training_mode
    from ugpum.placement.copy import staged_copies
    from ugpum.placement.pipeline import accumulate
    from ugpum.placement.place import place_by_plan

    def sync():
        for d in gpus:
            sync_device(d)

    model = build_meta(spec, torch.bfloat16)
    for d in gpus:
        torch.cuda.reset_peak_memory_stats(d)
    t0 = time.perf_counter()
    placement = place_by_plan(model, placed, spec.tail_modules, str(ckpt), prefix)
    load_s = time.perf_counter() - t0
    guards, undo_ckpt, lora = [], None, None
    n = len(variants)
    got = Measured([[] for _ in range(n)], [dict.fromkeys(gpus, 0.0) for _ in range(n)], [[] for _ in range(n)],
                   [None] * n, [None] * n, load_s, {}, None)
    try:
        swaps = list(getattr(placement, "swaps", []))
        layout = placement.layout
        guards, undo_ckpt, lora, params = lora_training_setup(model, spec, w)
        with torch.no_grad():              # B != 0: every adapter gets a gradient (checked by grad_checks)
            for _, a in lora.items():
                a.B.normal_(0.0, 1e-3)
        opt = torch.optim.AdamW(params, lr=1e-4)
        first, last = layout.first, layout.last
        batches = []
        for _ in range(max(m for _, m in run.configs)):
            x, t, ctx = example_inputs(spec, w, first)
            batches.append((x, t, ctx, x.float().to(last)))

        def accumulate_step(schedule: str, m: int):
            def model_step(mb):
                x, t, ctx, target = mb
                with torch.autocast(torch.device(first).type, dtype=torch.bfloat16):
                    out = model(x, t, ctx, transformer_options={})
                return (out.float() - target).pow(2).mean() / m
            return accumulate(model_step, batches[:m], schedule, layout, model)

        with comfy_training_mode():
            if run.grad_checks:
                got.grad_check = check_gradients(run, resolved, accumulate_step, params, opt)
                print(f"{run.name}: LoRA gradient, relative difference to sequential with direct copies: "
                      f"{got.grad_check}", flush=True)
            for r in range(args.steps):
                for i, (req, m, plan, schedule, held, staged) in enumerate(variants):
                    if got.errors[i]:
                        continue
                    try:
                        with staged_copies(staged):
                            for d in gpus:
                                torch.cuda.reset_peak_memory_stats(d)
                            before = sum(s.stats["bytes"] for s in swaps)
                            sync()
                            t0 = time.perf_counter()
                            losses = accumulate_step(schedule, m)
                            opt.step()
                            opt.zero_grad(set_to_none=True)
                            sync()
                            got.times[i].append(time.perf_counter() - t0)
                    except torch.OutOfMemoryError as e:     # one configuration too big: the others go on
                        got.errors[i] = f"out of memory: {str(e).splitlines()[0]}"
                        opt.zero_grad(set_to_none=True)
                        gc.collect()
                        torch.cuda.empty_cache()
                        print(f"{run.name} {schedule} m={m}: {got.errors[i]}", flush=True)
                        continue
                    got.moved[i].append(sum(s.stats["bytes"] for s in swaps) - before)
                    for d in gpus:
                        got.peaks[i][d] = max(got.peaks[i][d], torch.cuda.max_memory_allocated(d) / GIB)
                    got.losses[i] = sum(float(v) for v in losses)
                print(f"{run.name} round {r + 1}/{args.steps}: " + ", ".join(
                    f"{v[3]} m={v[1]}{' staged' if v[5] else ''} "
                    + (f"{got.times[i][-1]:.3f}s" if got.times[i] else "failed") for i, v in enumerate(variants)),
                    flush=True)
        if run.measure_copies:
            big = 256 * 2 ** 20 if gpus else 4 * 2 ** 20      # (a CPU smoke run only checks the path)
            got.copies = copy_bandwidth(run.devices, [spec.boundary_bytes(w), big])
    finally:
        if undo_ckpt is not None:
            undo_ckpt()
        for g in guards:
            g.remove()
        if lora is not None:
            lora.remove()
        placement.undo("meta")
        del model, placement, lora
        gc.collect()
        if gpus:
            torch.cuda.empty_cache()
    return got


def check_gradients(run: Run, resolved, accumulate_step, params, opt) -> dict[str, float]:
    """Relative difference of the accumulated LoRA gradient of each of `run.grad_checks` against
    the plain path (sequential schedule, direct copies), at the run's largest m."""
    from ugpum.placement.copy import staged_copies
    m = max(r[1] for r in resolved)
    auto = next((r[3] for r in resolved if r[1] == m), "sequential")

    def gradient(schedule: str, staged: bool) -> list[torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        with staged_copies(staged):
            accumulate_step(auto if schedule == "auto" else schedule, m)
        g = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu() for p in params]
        opt.zero_grad(set_to_none=True)
        return g

    ref = gradient("sequential", False)
    ref_norm = sum(float(r.pow(2).sum()) for r in ref) ** 0.5
    out = {}
    for label, schedule, staged in run.grad_checks:
        got = gradient(schedule, staged)
        diff = sum(float((a - b).pow(2).sum()) for a, b in zip(got, ref)) ** 0.5
        out[label] = diff / ref_norm if ref_norm else diff
    return out


def failed_entries(run: Run, args, command: str, error: str) -> list[dict]:
    """Entries for a run that produced none (its process died or ran out of time)."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return [{"case": run.case, "variant": run.variant, "model": run.model, "devices": run.devices,
             "caps_gib": run.caps_gib, "one_gpu_trial": len(set(run.devices)) < len(run.devices),
             "split": run.split, "micro_batches": m, "schedule_requested": req, "schedule": None,
             "staged_copies": staged, "resolution": args.resolution, "frames": args.frames,
             "text_tokens": args.text_tokens, "rank": args.rank, "s_per_step": None, "peak_gib": None,
             "forecast_gib": None, "error": error, "command": command, "torch": torch.__version__, "date": date}
            for staged in run.staged_modes for req, m in run.configs]


# ---------------------------------------------------------------------------------------------
# results

def load_entries(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text())
    except ValueError as e:
        raise SystemExit(f"{path} is not valid JSON ({e}): move it away or fix it, then run again") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise SystemExit(f"{path} is not a list of entries: move it away, then run again")
    return entries


def _key(e: dict) -> str:
    return json.dumps([e.get(k) for k in ENTRY_KEY])


def merge(entries: list[dict], new: list[dict]) -> list[dict]:
    keys = {_key(e) for e in new}
    return [e for e in entries if _key(e) not in keys] + new


def _find(entries: list[dict], **want) -> dict | None:
    for e in reversed(entries):
        if e.get("s_per_step") and not e.get("error") and all(e.get(k) == v for k, v in want.items()):
            return e
    return None


def annotate(entries: list[dict]) -> list[dict]:
    """Each measured entry's comparison with its baseline among `entries`, as `comparison`."""
    for e in entries:
        e.pop("comparison", None)
        if not e.get("s_per_step") or e.get("error"):
            continue
        same = {k: e.get(k) for k in ("model", "resolution", "frames", "text_tokens", "rank")}
        m, s = e["micro_batches"], e["s_per_step"]
        if e["case"] == "klein_schedules" and e["variant"] == "split":
            one = _find(entries, case=e["case"], variant="one_gpu", devices=e["devices"][:1], micro_batches=m, **same)
            if one:
                p = len(e["devices"])
                ratio, bound = one["s_per_step"] / s, p * m / (m + p - 1)
                e["comparison"] = {"against": "one GPU unconstrained, same m", "throughput_ratio": round(ratio, 4),
                                   "bound": round(bound, 4), "of_bound": round(ratio / bound, 4)}
                if m == 1:                       # what routing costs when nothing can overlap
                    e["comparison"]["overhead"] = round(s / one["s_per_step"] - 1, 4)
        elif e["case"] == "wan_split" and e["variant"].startswith("split"):
            swap = _find(entries, case=e["case"], variant="swap", devices=e["devices"][:1], **same)
            if swap:
                ratio = (m / s) / (swap["micro_batches"] / swap["s_per_step"])
                e["comparison"] = {"against": "one capped GPU with block swap", "throughput_ratio": round(ratio, 4)}
        elif e["case"] == "mixed_caps" and e["variant"] == "planner":
            even = _find(entries, case=e["case"], variant="even", devices=e["devices"], caps_gib=e["caps_gib"],
                         micro_batches=m, **same)
            if even:
                e["comparison"] = {"against": "even split, same caps", "throughput_ratio":
                                   round(even["s_per_step"] / s, 4)}
        elif e["case"] == "staged_copies" and e.get("staged_copies"):
            direct = _find(entries, case=e["case"], variant=e["variant"], devices=e["devices"], micro_batches=m,
                           staged_copies=False, **same)
            if direct:
                e["comparison"] = {"against": "direct copies, same m", "throughput_ratio":
                                   round(direct["s_per_step"] / s, 4),
                                   "extra_s_per_step": round(s - direct["s_per_step"], 4)}
    return entries


def targets(entries: list[dict]) -> list[dict]:
    """The issue's three targets, per device set measured."""
    rows = []
    for devices in sorted({tuple(e["devices"]) for e in entries if len(e.get("devices", [])) == 2}):
        mine = [e for e in entries if tuple(e["devices"]) == devices and e.get("comparison")]
        trial = len(set(devices)) < 2

        def best(pred, key="throughput_ratio"):
            got = [e for e in mine if pred(e)]
            return max(got, key=lambda e: e["comparison"][key]) if got else None

        m1 = best(lambda e: e["case"] == "klein_schedules" and e["micro_batches"] == 1
                  and e["schedule"] == "sequential")
        if m1:
            v = m1["comparison"]["overhead"]
            rows.append({"target": "routing overhead, klein split at m = 1 (sequential) vs one GPU",
                         "devices": list(devices), "measured": f"{v:+.1%}", "goal": f"<= {TARGETS['overhead_m1']:.0%}",
                         "met": None if trial else v <= TARGETS["overhead_m1"]})
        m4 = best(lambda e: e["case"] == "klein_schedules" and e["micro_batches"] == 4)
        if m4:
            v = m4["comparison"]["throughput_ratio"]
            rows.append({"target": f"klein m = 4 throughput vs one unconstrained GPU (best: {m4['schedule']}; "
                                   f"bound {m4['comparison']['bound']:.2f})",
                         "devices": list(devices), "measured": f"{v:.2f}x",
                         "goal": f">= {TARGETS['klein_m4_speedup']}x",
                         "met": None if trial else v >= TARGETS["klein_m4_speedup"]})
        for variant in sorted({e["variant"] for e in mine if e["case"] == "wan_split"}):
            wan = best(lambda e: e["case"] == "wan_split" and e["variant"] == variant and e["micro_batches"] == 4)
            if wan:
                v = wan["comparison"]["throughput_ratio"]
                how = "the schedule training picks" if variant == "split" else "forced, an experiment"
                rows.append({"target": f"Wan split at 2x{wan['caps_gib'][0]:g} GiB, m = 4, {wan['schedule']} ({how}) "
                                       "vs one capped GPU with swap",
                             "devices": list(devices), "measured": f"{v:.2f}x",
                             "goal": f">= {TARGETS['wan_m4_vs_swap']}x",
                             "met": None if trial else v >= TARGETS["wan_m4_vs_swap"]})
    return rows


def _per_gpu(d: dict | None, spec=".2f") -> str:
    if not d:
        return "-"
    return " / ".join(format(v, spec) for v in d.values())


def runs_table(entries: list[dict]) -> str:
    lines = ["| case | variant | devices | caps GiB | m | schedule | copies | s/step | mb/s | vs (bound) | "
             "blocks per stage (swapped) | peak GiB per GPU | forecast GiB per GPU | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        c = e.get("comparison") or {}
        vs = "-"
        if c:
            vs = f"{c['throughput_ratio']:.2f}x" + (f" ({c['bound']:.2f})" if "bound" in c else "")
        stages = ", ".join(f"{s['blocks'][1] - s['blocks'][0]} ({len(s['offloaded'])})"
                           for s in e.get("stages", [])) or "-"
        caps = ",".join(f"{cap:g}" for cap in e["caps_gib"]) if e.get("caps_gib") else "none"
        lines.append(
            f"| {e['case']} | {e['variant']} | {','.join(e['devices'])} | {caps} | {e['micro_batches']} | "
            f"{e.get('schedule') or e.get('schedule_requested')} | {'staged' if e.get('staged_copies') else 'direct'} | "
            f"{fmt(e.get('s_per_step'), '.3f')} | {fmt(e.get('throughput_mb_per_s'))} | {vs} | {stages} | "
            f"{_per_gpu(e.get('peak_gib'))} | {_per_gpu(e.get('forecast_gib'))} | {e.get('error') or ''} |")
    return "\n".join(lines) + "\n"


def markdown(entries: list[dict]) -> str:
    gpus = sorted({f"{k} {v}" for e in entries for k, v in (e.get("gpus") or {}).items()})
    torches = sorted({e["torch"] for e in entries if e.get("torch")})
    lines = [
        "# Two GPUs in one process: the split against one GPU (issue 7)", "",
        "Written by `bench/two_gpu.py`. Random bf16 weights streamed from a safetensors file by the plan, "
        "LoRA on every block linear, bf16 autocast, per-block checkpointing, AdamW, batch 1 per micro-batch. "
        "Caps: `torch.cuda.set_per_process_memory_fraction` per GPU (cap minus 0.5 GiB of CUDA context). "
        "s/step: median after warm-up; mb/s: micro-batches per second; vs: throughput against the row's "
        "baseline (one GPU for klein, one capped GPU with swap for Wan, the even split for the planner's, "
        "direct copies for staged ones), with p·m/(m+p-1) in brackets where it bounds it. Peak: "
        "`torch.cuda.max_memory_allocated` per GPU during the steps; forecast: the plan's, for the blocks "
        "and swap tier placed and the micro-batches in flight.", "",
        f"GPUs: {', '.join(gpus) or 'none (CPU smoke run)'}; torch {', '.join(torches) or '-'}.", "",
        "Rows whose devices repeat one GPU (`cuda:0,cuda:0`) are the one-GPU trial: they show the code runs "
        "within the summed cap; they measure no speed-up and make no copy between stages.", "",
    ]
    rows = targets(entries)
    if rows:
        lines += ["## Targets", "", "| target | devices | measured | goal | met |", "|---|---|---|---|---|"]
        for r in rows:
            met = "n/a (one device for both)" if r["met"] is None else ("yes" if r["met"] else "**no**")
            lines.append(f"| {r['target']} | {','.join(r['devices'])} | {r['measured']} | {r['goal']} | {met} |")
        lines.append("")
    lines += ["## Runs", "", runs_table(entries)]
    copies = [e for e in entries if e.get("copy_bandwidth") and not e.get("staged_copies")]
    seen = set()
    rows = []
    for e in copies:
        for row in e["copy_bandwidth"]["pairs"]:
            key = (tuple(e["devices"]), row["src"], row["dst"], row["mib"])
            if key not in seen:
                seen.add(key)
                rows.append(row)
    if rows:
        lines += ["## Copy bandwidth (staged_copies)", "",
                  "| from | to | MiB | direct GB/s | staged GB/s | torch copy_ GB/s |", "|---|---|---|---|---|---|"]
        for row in rows:
            lines.append(f"| {row['src']} | {row['dst']} | {row['mib']:g} | {row['direct_gbps']} | "
                         f"{row['staged_gbps']} | {row.get('torch_copy_gbps', '-')} |")
        lines.append("")
    grads = {(e["case"], e["variant"], tuple(e["devices"])): e["grad_rel_diff"] for e in entries if e.get("grad_rel_diff")}
    if grads:
        lines += ["LoRA gradient, relative difference to the sequential schedule with direct copies: " + "; ".join(
            f"{case}/{variant} on {','.join(d)}: " + ", ".join(f"{k} {v:.1e}" for k, v in g.items())
            for (case, variant, d), g in grads.items()), ""]
    commands = list(dict.fromkeys(e["command"] for e in entries if e.get("command")))
    lines += ["## Commands", ""] + [f"- `{c}`" for c in commands] + [""]
    return "\n".join(lines)


def save(out: Path, new: list[dict]) -> list[dict]:
    from ugpum.formats.atomic import atomic_path, write_json_atomic
    out.mkdir(parents=True, exist_ok=True)
    entries = annotate(merge(load_entries(out / "two_gpu.json"), new))
    write_json_atomic(out / "two_gpu.json", entries)
    with atomic_path(out / "two_gpu.md") as tmp:
        tmp.write_text(markdown(entries), encoding="utf-8")
    return entries


# ---------------------------------------------------------------------------------------------
# the driver: checkpoints, then each run (in a child process on CUDA), results merged after each

def checkpoint_for(args, model: str) -> Path:
    return Path(args.ckpt_dir) / f"{model}.safetensors"


def isolated(args) -> bool:
    return args.isolate == "always" or (args.isolate == "auto" and any(d.startswith("cuda") for d in args.devices))


def child_env(args) -> dict:
    env = dict(os.environ)
    if args.alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in env:
        env["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    env["PYTHONUNBUFFERED"] = "1"
    return env


def in_child(job: dict, args, timeout: float | None) -> tuple[dict | None, str | None]:
    """Run `job` in a fresh Python process; (its result, an error message)."""
    with tempfile.TemporaryDirectory(prefix="ugpum-two-gpu-") as tmp:
        spec_file = Path(tmp) / "job.json"
        spec_file.write_text(json.dumps({"job": job, "args": vars(args)}))
        try:
            rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_file)],
                                env=child_env(args), timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout:.0f} s"
        result = spec_file.with_suffix(".out.json")
        if not result.is_file():
            return None, f"the run's process exited with code {rc} and wrote no result"
        return json.loads(result.read_text()), None


def run_job(job: dict, args) -> dict:
    """What a child (or, on CPU, this process) does for one job."""
    if job["kind"] == "write":
        from ugpum.arch import get_spec
        seconds = write_random_checkpoint(get_spec(job["model"]), Path(job["path"]), job["device"])
        return {"seconds": seconds}
    run = Run(**{**job["run"], "configs": [tuple(c) for c in job["run"]["configs"]],
                 "grad_checks": [tuple(g) for g in job["run"]["grad_checks"]]})
    try:
        return {"entries": execute_run(run, args, Path(job["ckpt"]), job["command"])}
    except Exception as e:                 # noqa: BLE001 - a plan or placement that fails is a result too
        from ugpum.planning.plan import PlanError
        if isinstance(e, PlanError):
            print(f"{run.name}: {e}", flush=True)
        else:
            import traceback
            traceback.print_exc()
        return {"entries": failed_entries(run, args, job["command"], f"{type(e).__name__}: {e}")}


def child_main(spec_file: str) -> int:
    data = json.loads(Path(spec_file).read_text())
    args = argparse.Namespace(**data["args"])
    result = run_job(data["job"], args)
    Path(spec_file).with_suffix(".out.json").write_text(json.dumps(result))
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench/two_gpu.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from: {', '.join(CASES)}")
    p.add_argument("--only", default="", help="comma-separated runs (case/variant, e.g. wan_split/split_1f1b) to run "
                   "among the cases'")
    p.add_argument("--devices", default="cuda:0,cuda:1",
                   help="the two devices: cuda:0,cuda:1; cuda:0,cuda:0 (one-GPU trial); cpu,cpu (smoke run, tiny model)")
    p.add_argument("--model", default="", help=f"one model for every case (default: {WAN} for wan_split, {KLEIN} "
                   "for the others; tiny-flux2 or tiny-wan on cpu)")
    add_workload_arguments(p, steps=4, warmup=1)
    p.add_argument("--cap-gib", type=float, default=16.0, help="wan_split: memory of each card played (GiB)")
    p.add_argument("--wan-micro-batches", type=_ints, default=[1, 4])
    p.add_argument("--wan-schedules", default="auto,1f1b",
                   help="wan_split: schedules of the split (auto: what training picks; 1f1b/gpipe: forced)")
    p.add_argument("--micro-batches", type=_ints, default=[1, 2, 4, 8], help="klein_schedules: m per step")
    p.add_argument("--mixed-caps-gib", type=_floats, default=[16.0, 8.0], help="mixed_caps: the two caps (GiB)")
    p.add_argument("--mixed-micro-batches", type=_ints, default=[4])
    p.add_argument("--copy-micro-batches", type=_ints, default=[1, 4])
    p.add_argument("--ckpt-dir", default=str(Path(tempfile.gettempdir()) / "ugpum-bench"),
                   help="random-weight checkpoints, <model id>.safetensors (written when missing)")
    p.add_argument("--keep-ckpt", action="store_true", help="keep the checkpoints this invocation wrote")
    p.add_argument("--write-only", action="store_true", help="write the cases' checkpoints, then stop")
    p.add_argument("--isolate", choices=["auto", "always", "never"], default="auto",
                   help="each run in a process of its own: auto = on CUDA (caps must not meet another run's memory)")
    p.add_argument("--time-limit-s", type=float, default=0.0,
                   help="wall-clock budget of this invocation: a run still going at the end is stopped and "
                        "recorded as timed out; later runs are skipped (0: none)")
    p.add_argument("--out", default="bench/results", help="folder for two_gpu.json / two_gpu.md")
    p.add_argument("--alloc-conf", default=DEFAULT_ALLOC_CONF, help="PYTORCH_CUDA_ALLOC_CONF for the runs when not set")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in args.cases if c not in CASES]
    if bad or not args.cases:
        p.error(f"--cases {','.join(bad) or '(empty)'}: choose from {', '.join(CASES)}")
    args.only = [r.strip() for r in args.only.split(",") if r.strip()]
    args.devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if len(args.devices) != 2:
        p.error(f"--devices needs two devices (e.g. cuda:0,cuda:1 or cuda:0,cuda:0), got {args.devices}")
    from ugpum.placement.pipeline import SCHEDULES
    args.wan_schedules = [s.strip() for s in args.wan_schedules.split(",") if s.strip()]
    bad = [s for s in args.wan_schedules if s not in ("auto",) + SCHEDULES]
    if bad or not args.wan_schedules:
        p.error(f"--wan-schedules {','.join(bad) or '(empty)'}: choose from auto, {', '.join(SCHEDULES)}")
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must be more than --warmup {args.warmup}")
    cpu = [d for d in args.devices if d == "cpu"]
    if cpu and not (args.model or "").startswith("tiny"):
        p.error("--devices cpu runs only tiny models: add --model tiny-flux2 (or tiny-wan)")
    if any(d.startswith("cuda") for d in args.devices) and not torch.cuda.is_available():
        p.error(f"--devices {','.join(args.devices)}: no CUDA here (a smoke run: --devices cpu,cpu --model tiny-flux2)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    started = time.monotonic()

    def left() -> float | None:
        return None if not args.time_limit_s else args.time_limit_s - (time.monotonic() - started)

    command = command_line() if argv is None else shlex.join(["python", "bench/two_gpu.py", *argv])
    runs = selected_runs(args)
    out = Path(args.out)
    load_entries(out / "two_gpu.json")                  # a broken results file stops us before any work
    wrote = []
    failures = 0
    try:
        for model in dict.fromkeys(r.model for r in runs):
            path = checkpoint_for(args, model)
            if path.is_file():
                continue
            job = {"kind": "write", "model": model, "path": str(path), "device": args.devices[0]}
            result, error = in_child(job, args, left()) if isolated(args) else (run_job(job, args), None)
            if error:
                path.unlink(missing_ok=True)
                raise SystemExit(f"writing {path}: {error}")
            wrote.append(path)
            print(f"wrote {path} ({path.stat().st_size / GIB:.1f} GiB) in {result['seconds']:.0f} s", flush=True)
        if args.write_only:
            return 0
        for run in runs:
            remaining = left()
            if remaining is not None and remaining < 15:
                print(f"{run.name}: skipped, out of time (--time-limit-s {args.time_limit_s:g})", flush=True)
                continue
            print(f"=== {run.name}: {','.join(run.devices)}, caps {run.caps_gib or 'none'}, "
                  f"{len(run.configs) * len(run.staged_modes)} configuration(s)", flush=True)
            job = {"kind": "run", "run": dataclasses.asdict(run), "ckpt": str(checkpoint_for(args, run.model)),
                   "command": command}
            if isolated(args):
                result, error = in_child(job, args, remaining)
                new = result["entries"] if result else failed_entries(run, args, command, error)
            else:
                new = run_job(job, args)["entries"]
            failures += sum(1 for e in new if e.get("error"))
            entries = save(out, new)
            print(runs_table([e for e in entries if _key(e) in {_key(n) for n in new}]), flush=True)
    finally:
        if not args.keep_ckpt:
            for path in wrote:
                path.unlink(missing_ok=True)
    for row in targets(load_entries(out / "two_gpu.json")):
        print(f"target: {row['target']} on {','.join(row['devices'])}: {row['measured']} (goal {row['goal']})", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

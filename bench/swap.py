"""Block swap on one GPU (issue 5): unconstrained vs capped to play a smaller card, with swap.

  python -m ugpum bench swap --model flux2-klein-9b --cap-gib 16 --steps 6 --out bench/results
  python bench/swap.py        --model flux2-klein-9b --cap-gib 16 --steps 6 --out bench/results

`swap`: a full-size DiT with random weights (written once to a safetensors file, then streamed from
it block by block) trains LoRA steps at a training shape (bf16 autocast, per-block checkpointing, the
in-place guard, AdamW on the adapters):
  1. one GPU unconstrained, placed by the plan for that GPU (nothing swapped);
  2. the same GPU capped to play a smaller card (`torch.cuda.set_per_process_memory_fraction`), placed
     by the plan for a device of that size: the planner picks the offloaded blocks, `ugpum.placement.swap`
     streams them from pinned host memory.
Each entry records the command, GPU, torch version, s/step (median after warm-up), peak GiB against
the plan's forecast, bytes moved per step and copy-stream seconds, in OUT/swap.json (a list, one
entry per model/cap/shape, replaced when measured again) and OUT/swap.md (+ swap.png with matplotlib).

The model classes are ComfyUI's (through `comfy_bridge`, imported only here, at run time): set
COMFYUI_PATH. `--device cpu` runs the same code on a tiny model without a GPU (a smoke test).
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
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import (DEFAULT_ALLOC_CONF, GIB, add_workload_arguments, capped_device,  # noqa: E402
                          checkpoint_path, command_line, example_inputs, fmt, lora_training_setup, merge_results,
                          real_device, sync, write_random_checkpoint)


def add_swap_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model id: flux2-klein-9b, wan2.1-14b, flux2-dev, ... (tiny-flux2 with --device cpu)")
    p.add_argument("--cap-gib", type=float, default=16.0, help="memory of the card to play, GiB (default 16)")
    add_workload_arguments(p, steps=6, warmup=2)
    p.add_argument("--slots", type=int, default=2, help="GPU slots in the swap ring")
    p.add_argument("--out", default="bench/results", help="folder for swap.json / swap.md")
    p.add_argument("--ckpt", default="", help="random-weight checkpoint to use or write "
                   "(default: $TMPDIR/ugpum-bench/<model>.safetensors, deleted afterwards if written here)")
    p.add_argument("--keep-ckpt", action="store_true", help="keep a checkpoint this run wrote")
    p.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a smoke run on a tiny model")
    p.add_argument("--cases", choices=["both", "unconstrained", "swap"], default="both")
    p.add_argument("--no-pin", action="store_true", help="pageable host copies (to measure what pinning buys)")
    p.add_argument("--alloc-conf", default=DEFAULT_ALLOC_CONF,
                   help="PYTORCH_CUDA_ALLOC_CONF when not already set ('' for torch's default)")


def run_case(spec, plan, ckpt: Path, prefix: str, w, args, swap: bool) -> dict:
    """Place by `plan` (swapping its offloaded blocks when `swap`), train, measure, tear down."""
    from comfy_bridge import build_meta, comfy_training_mode

    from ugpum.placement.place import place, place_with_swap, swap_plan

    stages = [s.torch_device for s in plan.stages]
    device = stages[0]
    cuda = device.startswith("cuda")
    model = build_meta(spec, torch.bfloat16)
    layout, offloaded = swap_plan(plan, stages, spec.tail_modules)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    if swap and offloaded:
        placed = place_with_swap(model, layout, offloaded, checkpoint=ckpt, key_prefix=prefix,
                                 slots=args.slots, pin=not args.no_pin, timing=cuda)
        swaps = placed.swaps
    else:
        placed, swaps = place(model, layout, checkpoint=ckpt, key_prefix=prefix), []
    load_s = time.perf_counter() - t0
    load_peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    guards, undo_ckpt, lora, params = lora_training_setup(model, spec, w, args.compile)
    opt = torch.optim.AdamW(params, lr=1e-4)
    x, t, ctx = example_inputs(spec, w, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, moved, copy_s, losses = [], [], [], []
    try:
        with comfy_training_mode():
            for _ in range(args.steps):
                sync(device)
                before = sum(s.stats["bytes"] for s in swaps)
                t0 = time.perf_counter()
                with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                    out = model(x, t, ctx, transformer_options={})
                loss = (out.float() - x.float()).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync(device)
                times.append(time.perf_counter() - t0)
                moved.append(sum(s.stats["bytes"] for s in swaps) - before)
                copy_s.append(sum(s.copy_seconds() for s in swaps))
                losses.append(loss.item())
        peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
        reserved = torch.cuda.max_memory_reserved(device) / GIB if cuda else None
    finally:
        undo_ckpt()
        for g in guards:
            g.remove()
        lora.remove()
        stats = [dict(s.stats) for s in swaps]
        slot_mib = [s.slot_bytes / 2 ** 20 for s in swaps]
        host_gib = sum(s.host_bytes for s in swaps) / GIB
        pinned = all(b.host.pinned for s in swaps for b in s.blocks) if swaps else None
        placed.undo("meta")
        del model, placed, lora, opt, params, swaps
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    timed = times[args.warmup:] or times
    stage = plan.stages[0]
    return {
        "device": stage.device, "offloaded_blocks": len(offloaded) if swap else 0,
        "offloaded_paths": offloaded if swap else [],
        "s_per_step": round(statistics.median(timed), 4), "step_times": [round(v, 4) for v in times],
        "predicted_step_s": round(plan.predicted_step_s, 4),
        "peak_gib": None if peak is None else round(peak, 3),
        "peak_reserved_gib": None if reserved is None else round(reserved, 3),
        "load_peak_gib": None if load_peak is None else round(load_peak, 3),
        "forecast_gib": stage.forecast_gib, "forecast_detail_gib": stage.detail_gib, "budget_gib": stage.budget_gib,
        "forecast_error": None if not peak else round(stage.forecast_gib / peak - 1, 4),
        "bytes_moved_per_step": int(statistics.median(moved[args.warmup:] or moved)) if moved else 0,
        "bytes_moved_first_step": moved[0] if moved else 0,
        "forecast_swap_bytes_per_step": plan.swap_bytes_per_step,
        "copy_s_per_step": round(statistics.median(copy_s[args.warmup:] or copy_s), 4) if copy_s else 0.0,
        "swap_stats": stats, "slot_mib": [round(v, 1) for v in slot_mib], "host_copy_gib": round(host_gib, 3),
        "host_pinned": pinned, "load_s": round(load_s, 1), "final_loss": losses[-1] if losses else None,
    }


def _earlier_case(path: Path, model: str, args, case: str) -> dict | None:
    """The `case` result of an earlier entry for the same model, cap and shape (any swap choice for
    the unconstrained case; the same slots for the swap case)."""
    if not path.is_file():
        return None
    try:
        entries = json.loads(path.read_text())
    except ValueError:
        return None
    same = ("cap_gib", "resolution", "frames", "rank", "text_tokens") + (("slots",) if case == "swap" else ())
    for e in reversed(entries if isinstance(entries, list) else []):
        if e.get("model") == model and all(e.get(k) == getattr(args, k) for k in same) and e.get(case) \
                and e.get("compile", "off") == args.compile \
                and (case == "unconstrained" or e.get("offload") == "plan"):
            return e[case]
    return None


def markdown_table(entries: list[dict]) -> str:
    lines = [
        "# Block swap on one GPU: unconstrained vs capped to a smaller card",
        "",
        "Written by `python -m ugpum bench swap` (bench/swap.py). s/step is the median after warm-up; "
        "peak is `torch.cuda.max_memory_allocated` during training against the plan's forecast; "
        "GiB moved is host-to-device per step (measured, and the plan's forecast).",
        "",
        "| model | shape | cap GiB | blocks swapped (choice) | unconstrained s/step | swap s/step | ratio | "
        "peak GiB | forecast GiB | forecast err | GiB moved/step (forecast) | copy s/step | GPU | torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        shape = f"{e.get('resolution')}²" + (f" x{e['frames']}f" if e.get("frames", 1) > 1 else "") \
            + (", compiled" if e.get("compile") == "on" else "")
        moved = e.get("bytes_moved_per_step")
        fc = e.get("forecast_swap_bytes_per_step")
        err = e.get("forecast_error")
        lines.append(
            f"| {e['model']} | {shape} | {e['cap_gib']:g} | {e.get('offloaded_blocks', '-')} ({e.get('offload', 'plan')}) | "
            f"{fmt(e.get('unconstrained_s'), '.3f')} | {fmt(e.get('swap_s'), '.3f')} | {fmt(e.get('ratio'))} | "
            f"{fmt(e.get('peak_gib'))} | {fmt(e.get('forecast_gib'))} | "
            f"{'-' if err is None else f'{err:+.1%}'} | "
            f"{fmt(None if moved is None else moved / GIB, '.1f')} ({fmt(None if fc is None else fc / GIB, '.1f')}) | "
            f"{fmt(e.get('copy_s_per_step'), '.3f')} | {e.get('gpu', '-')} | {e.get('torch', '-')} |")
    return "\n".join(lines) + "\n"


def write_plot(entries: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [e for e in entries if e.get("unconstrained_s") and e.get("swap_s")]
    if not rows:
        return False
    labels = [f"{e['model']}\n{e['cap_gib']:g} GiB" for e in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(4, 2.2 * len(rows)), 3.6))
    ax.bar([i - 0.2 for i in xs], [e["unconstrained_s"] for e in rows], 0.4, label="one GPU, unconstrained")
    ax.bar([i + 0.2 for i in xs], [e["swap_s"] for e in rows], 0.4, label="capped, block swap")
    for i, e in zip(xs, rows):
        ax.text(i + 0.2, e["swap_s"], f"{e['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("s / step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_swap_bench(args) -> int:
    cuda = args.device.startswith("cuda")
    if cuda and args.alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and not torch.cuda.is_initialized():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA here (use --device cpu for a smoke run)")
    from ugpum.arch import Workload, get_spec, recognise
    from ugpum.planning.plan import make_plan

    spec = get_spec(args.model)
    ckpt = checkpoint_path(args, spec)
    wrote = None
    if not ckpt.is_file():
        wrote = write_random_checkpoint(spec, ckpt, args.device)
        print(f"wrote {ckpt} ({ckpt.stat().st_size / GIB:.1f} GiB) in {wrote:.0f} s", flush=True)
    try:
        found, prefix, stored = recognise(ckpt)
        if found.id != spec.id and not spec.id.startswith("tiny"):
            raise ValueError(f"{ckpt} holds {found.id}, not {spec.id}")
        w = Workload(width=args.resolution, height=args.resolution, frames=args.frames,
                     text_tokens=args.text_tokens, recompute="all", rank=args.rank)
        real = real_device(args.device)
        real = dataclasses.replace(real, torch_device=args.device)
        capped = capped_device(real, args.cap_gib)
        results = {}
        if args.cases in ("both", "unconstrained"):
            plan = make_plan(spec, [real], w)
            print(f"unconstrained: {plan.verdict}", flush=True)
            results["unconstrained"] = run_case(spec, plan, ckpt, prefix, w, args, swap=False)
            print("unconstrained:", json.dumps({k: v for k, v in results["unconstrained"].items()
                                                if k != "offloaded_paths"}), flush=True)
        limit = None
        if args.cases in ("both", "swap"):
            plan = make_plan(spec, [capped], w)
            print(f"capped at {args.cap_gib:g} GiB: {plan.verdict}", flush=True)
            if cuda:
                index = torch.device(args.device).index or 0
                torch.cuda.empty_cache()
                total = torch.cuda.get_device_properties(index).total_memory
                limit = capped.free_bytes
                torch.cuda.set_per_process_memory_fraction(limit / total, index)
            try:
                results["swap"] = run_case(spec, plan, ckpt, prefix, w, args, swap=True)
            finally:
                if cuda:
                    torch.cuda.set_per_process_memory_fraction(1.0, index)
            print("swap:", json.dumps({k: v for k, v in results["swap"].items() if k != "offloaded_paths"}),
                  flush=True)
    finally:
        if wrote is not None and not args.keep_ckpt:
            ckpt.unlink(missing_ok=True)

    # the cases run in separate processes (a capped case must not share memory with an unconstrained
    # one): pair this run with the other case recorded earlier for the same model and shape
    out = Path(args.out)
    u = results.get("unconstrained") or _earlier_case(out / "swap.json", spec.id, args, "unconstrained")
    s = results.get("swap")
    if s is None:
        s = _earlier_case(out / "swap.json", spec.id, args, "swap")
    # "offload": which blocks were swapped; "plan" = the planner's rule (entries recorded before it
    # changed on 2026-12-03 carry the rule they measured)
    entry = {
        "model": spec.id, "cap_gib": args.cap_gib, "resolution": args.resolution, "frames": args.frames,
        "text_tokens": args.text_tokens, "batch": 1, "rank": args.rank, "checkpointing": "block",
        "slots": args.slots, "offload": "plan", "stored_dtype": stored, "compile": args.compile,
        "unconstrained_s": u["s_per_step"] if u else None,
        "swap_s": s["s_per_step"] if s else None,
        "ratio": round(s["s_per_step"] / u["s_per_step"], 4) if u and s else None,
        "peak_gib": s["peak_gib"] if s else None,
        "forecast_gib": s["forecast_gib"] if s else None,
        "forecast_error": s["forecast_error"] if s else None,
        "unconstrained_peak_gib": u["peak_gib"] if u else None,
        "unconstrained_forecast_gib": u["forecast_gib"] if u else None,
        "unconstrained_forecast_error": u["forecast_error"] if u else None,
        "offloaded_blocks": s["offloaded_blocks"] if s else None,
        "bytes_moved_per_step": s["bytes_moved_per_step"] if s else None,
        "forecast_swap_bytes_per_step": s["forecast_swap_bytes_per_step"] if s else None,
        "copy_s_per_step": s["copy_s_per_step"] if s else None,
        "allocator_limit_gib": None if limit is None else round(limit / GIB, 3),
        "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "host_rss_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3),
        "checkpoint_written_s": None if wrote is None else round(wrote, 1),
        "command": command_line(),
        "gpu": torch.cuda.get_device_name(args.device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_probe": real.to_json(),
        "unconstrained": u, "swap": s,
    }
    out.mkdir(parents=True, exist_ok=True)
    from ugpum.formats.atomic import atomic_path, write_json_atomic
    entries = merge_results(out / "swap.json", entry)
    write_json_atomic(out / "swap.json", entries)
    with atomic_path(out / "swap.md") as tmp:
        tmp.write_text(markdown_table(entries), encoding="utf-8")
    write_plot(entries, out / "swap.png")
    print(markdown_table([entry]), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/swap.py", description=__doc__.split("\n\n")[1] if __doc__ else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_swap_arguments(p)
    return run_swap_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

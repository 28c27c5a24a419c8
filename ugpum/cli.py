"""`python -m ugpum`: plan (and, as they land, train, demo, bench)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .arch import UnknownModel, Workload, get_spec
from .arch.base import latent_frames
from .devices import parse_device_specs
from .bench_cli import add_bench_parser, run_bench
from .doctor import add_doctor_parser, run_doctor
from .download import add_download_parser, run_download
from .plan import GIB, PlanError, make_plan
from .train.config import PROFILES, ConfigError, load_config


class UsageError(ValueError):
    pass


def _resolution(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    try:
        width, height = int(w), int(h or w)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--resolution {text!r}: give pixels, e.g. 1024 or 832x480")
    if width % 16 or height % 16 or width <= 0 or height <= 0:
        raise argparse.ArgumentTypeError(f"--resolution {text!r}: width and height must be positive multiples of 16")
    return width, height


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="split a model over GPUs and forecast memory and step time")
    p.add_argument("--model", required=True, help="model id (e.g. flux2-klein-9b) or a .safetensors DiT file")
    p.add_argument("--gpu", action="append", required=True, metavar="SPEC",
                   help="a GPU: auto, cuda:N, a size (16GiB), or a preset (rtx4090), optionally @pcie4x4; repeat")
    p.add_argument("--resolution", type=_resolution, default=(1024, 1024), metavar="PX",
                   help="one side (square) or WIDTHxHEIGHT, e.g. 832x480 for Wan's 480p")
    p.add_argument("--frames", type=int, default=1, help="video frames per clip (Wan: 4k+1, e.g. 17 or 33)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16", help="base weight dtype")
    p.add_argument("--checkpointing", choices=["block", "none"], default="block")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def spec_for(model: str):
    if model.endswith(".safetensors"):
        from .arch import recognise
        return recognise(model)[0]
    return get_spec(model)


def run_plan(args) -> int:
    spec = spec_for(args.model)
    for name in ("batch", "grad_accum", "rank"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if spec.frames_error(args.frames):
        raise UsageError(f"--frames {args.frames}: {spec.frames_error(args.frames)}")
    w = Workload(width=args.resolution[0], height=args.resolution[1], frames=args.frames, batch=args.batch,
                 checkpointing=args.checkpointing == "block", weight_dtype=args.dtype, rank=args.rank)
    devices = parse_device_specs(args.gpu)
    if not devices:
        raise UsageError("--gpu auto: no CUDA GPU found here; describe one instead, e.g. --gpu 16GiB or --gpu rtx4090")
    plan = make_plan(spec, devices, w, grad_accum=args.grad_accum)
    print(json.dumps(plan.to_json(), indent=1) if args.json else format_plan(plan))
    return 0


def _block_range(paths: list[str], a: int, b: int) -> str:
    if a == b:
        return "-"
    first, last = paths[a], paths[b - 1]
    return f"{a}-{b - 1} ({first} .. {last})"


def format_plan(plan) -> str:
    w = plan.workload
    clip = f", {w['frames']} frames ({latent_frames(w['frames'])} latent)" if w["frames"] > 1 else ""
    lines = [f"{plan.model}  {w['width']}x{w['height']}{clip}"
             + f"  batch {w['batch']}  grad-accum {plan.grad_accum}  rank {w['rank']}  {w['weight_dtype']}"
             + f"  checkpointing {'block' if w['checkpointing'] else 'none'}", ""]
    header = f"{'device':<24} {'blocks':<44} {'swapped':>7} {'forecast / budget GiB':>22} {'s/micro-batch':>13}"
    lines += [header, "-" * len(header)]
    for s in plan.stages:
        lines.append(f"{s.device[:24]:<24} {_block_range(plan.block_paths, *s.blocks):<44} "
                     f"{len(s.offloaded):>7} {s.forecast_gib:>10.1f} / {s.budget_gib:<9.1f} {s.seconds:>13.2f}")
    lines += ["", f"hidden state per boundary: {plan.boundary_mib:.1f} MiB; per step "
              f"{plan.crossing_bytes_per_step / 2**20:.0f} MiB between devices, "
              f"{plan.swap_bytes_per_step / GIB:.1f} GiB block swap",
              "s/step for 1..8 micro-batches:",
              "  sequential " + " ".join(f"{t:.2f}" for t in plan.step_s["sequential"]),
              "  pipelined  " + " ".join(f"{t:.2f}" for t in plan.step_s["pipelined"])]
    if plan.swap_forecast:
        sf = plan.swap_forecast
        lines.append(f"one GPU ({sf['device']}) with swap: {sf['predicted_step_s']:.2f} s/step, "
                     f"{len(sf['offloaded_blocks'])} blocks swapped, {sf['forecast_gib']:.1f} GiB")
    lines += [f"predicted: {plan.predicted_step_s:.2f} s/step", "", plan.verdict]
    from .text_encoder_split import forecast_line
    text_encoder = forecast_line(plan)
    if text_encoder:
        lines += ["", text_encoder]
    return "\n".join(lines)


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a LoRA (the engine the LoRA Trainer node uses)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="a TOML file of TrainConfig settings (top level or [train])")
    src.add_argument("--profile", help="a built-in profile: " + ", ".join(PROFILES))
    p.add_argument("--dataset", help="folder of images or clips (Wan) with same-stem .txt captions, "
                                     "or a musubi dataset .toml")
    p.add_argument("--model", help="the DiT .safetensors file (its header names the model)")
    p.add_argument("--devices", help="auto, cuda:0,cuda:1 or cpu,cpu")
    p.add_argument("--steps", type=int)
    p.add_argument("--frames", type=int, help="Wan clips: frames from each clip's start (4k+1, e.g. 17 or 33)")
    p.add_argument("--batch", type=int, help="samples per micro-batch (items of one bucket and text length)")
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--schedule", choices=["auto", "sequential", "gpipe", "1f1b"],
                   help="order of the micro-batches over the stages (default auto: the best for the plan)")
    p.add_argument("--resume", metavar="DIR", help="continue the run whose output folder is DIR")
    p.add_argument("--out", help="output folder (LoRA, metrics.jsonl, samples/, checkpoints/)")
    p.add_argument("--stand-in-encoders", action="store_true",
                   help="fixed random encoders instead of a VAE/text encoder (benchmarks on random weights)")
    p.add_argument("--sample-every", type=int, help="render a sample every N steps (0: never)")


def train_config_from_args(args):
    overrides = {"dataset": args.dataset, "steps": args.steps, "frames": args.frames, "batch": args.batch,
                 "grad_accum": args.grad_accum,
                 "schedule": args.schedule, "devices": args.devices.split(",") if args.devices else None,
                 "stand_in_encoders": True if args.stand_in_encoders else None,
                 "sample_every": args.sample_every}
    if args.model:
        from .arch import recognise
        overrides["model"] = recognise(args.model)[0].id
        overrides["model_file"] = args.model
    if not args.config and not args.profile:
        raise UsageError("give --config FILE.toml or --profile NAME (" + ", ".join(PROFILES) + ")")
    return load_config(args.profile or "", args.config or "", overrides)


def run_train(args) -> int:
    out = args.out or args.resume
    if not out:
        raise UsageError("give --out DIR (or --resume DIR to continue a run)")
    cfg = train_config_from_args(args)
    if not cfg.dataset:
        raise UsageError("no dataset: give --dataset DIR (or set dataset in the config)")
    from .train.loop import train
    result = train(cfg, out, resume=bool(args.resume))
    print(f"LoRA: {result.lora_path}")
    return 0


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="the bundled workflow, headless: dataset -> plan -> train -> LoRA + report")
    p.add_argument("--models", help="a ComfyUI models/ folder with the real Klein 9B files")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default="out/demo")


def run_demo(args) -> int:
    from .demo import run_demo as demo
    return demo(models=args.models, steps=args.steps, out=args.out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ugpum", description="UGPUM: LoRA training split over GPUs")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    add_train_parser(sub)
    add_demo_parser(sub)
    add_download_parser(sub)
    add_doctor_parser(sub)
    add_bench_parser(sub)
    return parser


COMMANDS = {"plan": run_plan, "train": run_train, "demo": run_demo, "download": run_download,
            "doctor": run_doctor, "bench": run_bench}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (UsageError, UnknownModel, PlanError, ConfigError, ValueError, RuntimeError, OSError) as e:
        if os.environ.get("UGPUM_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2

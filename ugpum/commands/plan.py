"""`python -m ugpum plan`: split a model over GPUs and forecast memory and step time, loading nothing."""
from __future__ import annotations

import argparse
import dataclasses
import json

from ..arch import get_spec, recognise
from ..compute.modes import SETTINGS as BASE_COMPUTE_SETTINGS
from ..planning.devices import CPU_TRAINABLE_PARAMS, resolve_devices
from ..planning.forecast import format_plan, plan_for_config, recompute_line
from ..placement.schedules import ALL_SETTINGS, DISTRIBUTED_ONLY
from ..train.config import TrainConfig, load_config
from ..wording import for_cli
from .errors import UsageError


def resolution(text: str) -> tuple[int, int]:
    """'1024' -> (1024, 1024); '832x480' -> (832, 480)."""
    w, _, h = text.lower().partition("x")
    try:
        width, height = int(w), int(h or w)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--resolution {text!r}: give pixels, e.g. 1024 or 832x480")
    if width % 16 or height % 16 or width <= 0 or height <= 0:
        raise argparse.ArgumentTypeError(f"--resolution {text!r}: width and height must be positive multiples of 16")
    return width, height


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="split a model over GPUs and forecast memory and step time",
                       description="The plan `train` would make for these settings (a profile, a TOML config "
                                   "and flags, read as train reads them), on described or real GPUs; nothing "
                                   "is loaded. Flags left out keep the profile's or config's value.")
    p.add_argument("--model", help="model id (e.g. flux2-klein-base-9b) or a .safetensors DiT file "
                                   "(default: the profile's or config's)")
    p.add_argument("--profile", help="start from a built-in profile (e.g. klein-9b-1024), as train --profile")
    p.add_argument("--config", metavar="FILE.toml", help="start from a training config, as train --config")
    p.add_argument("--gpu", action="append", metavar="SPEC",
                   help="a GPU: auto, cuda:N, a size (16GiB), or a preset (rtx4090), optionally @pcie4x4; repeat "
                        "(default: the config's devices, else auto)")
    p.add_argument("--resolution", type=resolution, metavar="PX",
                   help="one side (square, as train's resolution) or WIDTHxHEIGHT for one bucket, e.g. 832x480")
    p.add_argument("--frames", type=int, help="video frames per clip (Wan: 4k+1, e.g. 17 or 33)")
    p.add_argument("--batch", type=int, help="samples per micro-batch (default 1)")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--schedule", choices=ALL_SETTINGS,
                   help="order of the micro-batches over the stages (auto: the fastest for the split); with "
                        "--distributed also interleaved-1f1b or zero-bubble (two pipeline stages per rank)")
    p.add_argument("--replicas", type=int, metavar="R",
                   help="copies of the model side by side, each training its share of the micro-batches on devices / R "
                        "of the GPUs (default 0: the planner weighs one card, the split, replicas and splits x "
                        "replicas and takes the fastest that fits; 1: one copy)")
    p.add_argument("--rank", type=int, help="LoRA rank (default 16)")
    p.add_argument("--dtype", choices=["bf16", "fp8"], help="base weight dtype (default bf16)")
    p.add_argument("--recompute", choices=["auto", "all", "none"],
                   help="blocks recomputed in backward: auto keeps the activations of as many blocks as the memory "
                        "left after the weights holds (the largest saving first), all recomputes every block, none "
                        "keeps every block's (default auto)")
    p.add_argument("--checkpointing", choices=["block", "none"], help=argparse.SUPPRESS)   # older: all / none
    p.add_argument("--compile", choices=["auto", "on", "off"],
                   help="plan compiled blocks (auto and on) or eager ones (off), as train runs them (default auto)")
    p.add_argument("--base-compute", choices=BASE_COMPUTE_SETTINGS,
                   help="the frozen base's matmuls: 8-bit holds the base at 1 byte a weight and runs it faster")
    p.add_argument("--desktop-gib", type=float, metavar="GIB",
                   help="GPU memory left to the desktop on each card (default: 0.5 on a card that drives a display; "
                        "a card given by name or size is taken to); 0 for cards that drive none")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    # past one machine (README "Past one machine"): the --gpu list is one machine's GPUs
    p.add_argument("--distributed", action="store_true",
                   help="forecast a torchrun run on torch.distributed.pipelining: per-rank memory, step time with the "
                        "network, the all-reduce of LoRA gradients, and whether one process is the better choice")
    p.add_argument("--nodes", type=int, default=1, metavar="K", help="with --distributed: K machines with these GPUs")
    p.add_argument("--data-parallel", type=int, metavar="R",
                   help="with --distributed: R replicas of the pipeline (default: one per machine)")
    p.add_argument("--network-gbps", type=float, default=10.0, metavar="GBIT",
                   help="with --distributed: the network between machines in Gbit/s (default 10: 10 GbE)")


def spec_for(model: str):
    return recognise(model)[0] if model.endswith(".safetensors") else get_spec(model)


def plan_config(args) -> tuple[TrainConfig, object]:
    """(TrainConfig, spec) from the flags, read through the profile/config/override path `train` uses,
    so `plan` checks every setting as `train` does and forecasts the run `train` would make."""
    if not (args.model or args.profile or args.config):
        raise UsageError("give --model ID|FILE, --profile NAME or --config FILE.toml")
    spec = spec_for(args.model) if args.model else None
    side = None
    if args.resolution:
        width, height = args.resolution
        side = width if width == height else max(16, round((width * height) ** 0.5 / 16) * 16)
    overrides = {"model": spec.id if spec else None, "model_file": args.model if spec and args.model != spec.id
                 else None, "resolution": side, "frames": args.frames, "batch": args.batch,
                 "grad_accum": args.grad_accum, "schedule": args.schedule, "replicas": args.replicas,
                 "rank": args.rank,
                 "alpha": float(args.rank) if args.rank else None, "weight_dtype": args.dtype,
                 "recompute": args.recompute,
                 "checkpointing": None if args.checkpointing is None else args.checkpointing == "block",
                 "compile": args.compile, "base_compute": args.base_compute, "devices": args.gpu,
                 "desktop_gib": args.desktop_gib}
    cfg = load_config(args.profile or "", args.config or "", overrides)
    return cfg, spec or get_spec(cfg.model)


def run_plan(args) -> int:
    cfg, spec = plan_config(args)
    bucket = args.resolution if args.resolution and args.resolution[0] != args.resolution[1] else None
    devices = resolve_devices(list(cfg.devices), spec)
    if spec.params > CPU_TRAINABLE_PARAMS and all(d.torch_device == "cpu" for d in devices):
        raise UsageError(f"no GPU here to plan {spec.id} on: describe one with --gpu (e.g. --gpu rtx4090, "
                         "--gpu 16GiB --gpu 16GiB)")
    if args.distributed or args.nodes != 1 or args.data_parallel:
        w = cfg.workload()
        w = dataclasses.replace(w, width=bucket[0], height=bucket[1]) if bucket else w
        return _plan_distributed(args, spec, w, devices, cfg)
    if cfg.schedule in DISTRIBUTED_ONLY:
        raise UsageError(f"--schedule {cfg.schedule} puts two pipeline stages on each rank of a distributed run: "
                         "add --distributed, or use auto, sequential, gpipe or 1f1b")
    plan = plan_for_config(cfg, devices, spec=spec, bucket=bucket)
    if args.json:                       # (the verdict's and the note's advice, as everywhere, in plan's flags)
        print(json.dumps({**plan.to_json(), "verdict": for_cli(plan.verdict, "plan"),
                          "base_compute_note": for_cli(plan.base_compute_note, "plan"),
                          "recompute_line": recompute_line(plan)}, indent=1))
    else:
        print(for_cli(format_plan(plan), "plan"))
    return 0


def _plan_distributed(args, spec, w, devices, cfg) -> int:
    from ..distributed.forecast import forecast_distributed, format_distributed
    if not args.distributed:
        raise UsageError("--nodes and --data-parallel forecast a distributed run: add --distributed")
    if args.nodes < 1 or args.network_gbps <= 0:
        raise UsageError("--nodes must be at least 1 and --network-gbps positive")
    fc = forecast_distributed(spec, devices, w, cfg.grad_accum, nodes=args.nodes, data_parallel=args.data_parallel,
                              network_gbps=args.network_gbps, schedule=cfg.schedule)
    print(json.dumps(fc.to_json(), indent=1) if args.json else format_distributed(fc))
    return 0

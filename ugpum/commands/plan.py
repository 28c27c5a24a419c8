"""`python -m ugpum plan`: split a model over GPUs and forecast memory and step time, loading nothing."""
from __future__ import annotations

import argparse
import json

from ..arch import Workload, get_spec, recognise
from ..devices import resolve_devices
from ..distributed.schedules import DISTRIBUTED_ONLY
from ..forecast import format_plan
from ..pipeline import SCHEDULES
from ..plan import plan_training
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
    p = sub.add_parser("plan", help="split a model over GPUs and forecast memory and step time")
    p.add_argument("--model", required=True, help="model id (e.g. flux2-klein-9b) or a .safetensors DiT file")
    p.add_argument("--gpu", action="append", required=True, metavar="SPEC",
                   help="a GPU: auto, cuda:N, a size (16GiB), or a preset (rtx4090), optionally @pcie4x4; repeat")
    p.add_argument("--resolution", type=resolution, default=(1024, 1024), metavar="PX",
                   help="one side (square) or WIDTHxHEIGHT, e.g. 832x480 for Wan's 480p")
    p.add_argument("--frames", type=int, default=1, help="video frames per clip (Wan: 4k+1, e.g. 17 or 33)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--schedule", choices=["auto", *SCHEDULES, *DISTRIBUTED_ONLY], default="auto",
                   help="order of the micro-batches over the stages (auto: the fastest for the split); with "
                        "--distributed also interleaved-1f1b or zero-bubble (two pipeline stages per rank)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16", help="base weight dtype")
    p.add_argument("--checkpointing", choices=["block", "none"], default="block")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="plan compiled blocks (auto and on) or eager ones (off), as train runs them")
    p.add_argument("--base-compute", choices=["bf16", "fp8", "int8"], default="bf16",
                   help="the frozen base's matmuls: 8-bit holds the base at 1 byte a weight and runs it faster")
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


def run_plan(args) -> int:
    spec = spec_for(args.model)
    for name in ("batch", "grad_accum", "rank"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if spec.frames_error(args.frames):
        raise UsageError(f"--frames {args.frames}: {spec.frames_error(args.frames)}")
    w = Workload(width=args.resolution[0], height=args.resolution[1], frames=args.frames, batch=args.batch,
                 checkpointing=args.checkpointing == "block", rank=args.rank, compiled=args.compile != "off",
                 base_compute=args.base_compute, weight_dtype="fp8" if args.base_compute != "bf16" else args.dtype)
    devices = resolve_devices(args.gpu, spec)
    if args.distributed or args.nodes != 1 or args.data_parallel:
        return _plan_distributed(args, spec, w, devices)
    if args.schedule in DISTRIBUTED_ONLY:
        raise UsageError(f"--schedule {args.schedule} puts two pipeline stages on each rank of a distributed run: "
                         "add --distributed, or use auto, sequential, gpipe or 1f1b")
    plan = plan_training(spec, devices, w, grad_accum=args.grad_accum, schedule=args.schedule)
    print(json.dumps(plan.to_json(), indent=1) if args.json else format_plan(plan))
    return 0


def _plan_distributed(args, spec, w, devices) -> int:
    from ..distributed.forecast import forecast_distributed, format_distributed
    if not args.distributed:
        raise UsageError("--nodes and --data-parallel forecast a distributed run: add --distributed")
    if args.nodes < 1 or args.network_gbps <= 0:
        raise UsageError("--nodes must be at least 1 and --network-gbps positive")
    fc = forecast_distributed(spec, devices, w, args.grad_accum, nodes=args.nodes, data_parallel=args.data_parallel,
                              network_gbps=args.network_gbps, schedule=args.schedule)
    print(json.dumps(fc.to_json(), indent=1) if args.json else format_distributed(fc))
    return 0

"""`python -m ugpum bench NAME ...`: hands off to the benchmark script bench/NAME.py of this checkout
(the benchmarks live wholly under bench/, with their recorded results)."""
from __future__ import annotations

import argparse
import subprocess
import sys

from .bridge import PACK_ROOT
from .errors import UsageError

BENCH_DIR = PACK_ROOT / "bench"


# What each benchmark measures, in a user's words (`bench --help`); the scripts' own --help says more.
SUMMARIES = {
    "calibration_fit": "fit the planner's memory and time model to recorded training runs",
    "cards": "train as a smaller card would: the GPU capped to a card's memory, the plan's forecast against it",
    "gradient_cosine": "each 8-bit base-compute mode's per-block LoRA gradient cosine against the bf16 base",
    "model_files": "write full-size model files with random weights, in the layouts real checkpoints have",
    "peer_wan": "a diffusers + PEFT LoRA step on Wan 2.1 14B, the peer for Wan's speed rows",
    "profile_steps": "a kernel table by op class of a few training steps of any program",
    "two_gpu": "replicas against the split on two GPUs (or two workers against one on one GPU), through the CLI",
}


def add_bench_parser(sub) -> None:
    # `bench --help` is this verb's help; `bench NAME --help` reaches the benchmark (REMAINDER after NAME)
    p = sub.add_parser("bench", help="GPU benchmarks (bench/NAME.py: cards, profile_steps, ...) recorded into "
                                     "bench/results",
                       description="Runs bench/NAME.py of this checkout with its own arguments; "
                                   "`bench NAME --help` lists them. Results go to bench/results/.",
                       epilog="benchmarks:\n" + "\n".join(f"  {name:<20}{SUMMARIES.get(name, '')}"
                                                           for name in available()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", help="the benchmark (listed below)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its own arguments (NAME --help lists them)")


def available() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith(("_", "common")))


def run_bench(args) -> int:
    if not args.name or args.name not in available():
        raise UsageError(f"bench: name one of {', '.join(available())} (they live in {BENCH_DIR}; "
                         "this needs the pack's git checkout)")
    return subprocess.call([sys.executable, str(BENCH_DIR / f"{args.name}.py"), *args.args], cwd=PACK_ROOT)

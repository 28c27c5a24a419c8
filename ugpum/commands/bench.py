"""`python -m ugpum bench NAME ...`: hands off to the benchmark script bench/NAME.py of this checkout
(the benchmarks live wholly under bench/, with their recorded results)."""
from __future__ import annotations

import argparse
import subprocess
import sys

from .bridge import PACK_ROOT
from .errors import UsageError

BENCH_DIR = PACK_ROOT / "bench"


def add_bench_parser(sub) -> None:
    # `bench --help` is this verb's help; `bench NAME --help` reaches the benchmark (REMAINDER after NAME)
    p = sub.add_parser("bench", help="GPU benchmarks (bench/NAME.py: swap, pipeline, speed, ...) recorded into "
                                     "bench/results",
                       description="Runs bench/NAME.py of this checkout with its own arguments; "
                                   "`bench NAME --help` lists them. Results go to bench/results/.")
    p.add_argument("name", nargs="?", help="the benchmark: " + ", ".join(available()))
    p.add_argument("args", nargs=argparse.REMAINDER, help="its own arguments (NAME --help lists them)")


def available() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith(("_", "common")))


def run_bench(args) -> int:
    if not args.name or args.name not in available():
        raise UsageError(f"bench: name one of {', '.join(available())} (they live in {BENCH_DIR}; "
                         "this needs the pack's git checkout)")
    return subprocess.call([sys.executable, str(BENCH_DIR / f"{args.name}.py"), *args.args], cwd=PACK_ROOT)

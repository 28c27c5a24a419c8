"""Benchmarks run in a child process, as `python bench/NAME.py ...` (what `python -m ugpum bench NAME ...`
hands off to, without that verb's own Python and torch start; `via_cli` goes through the verb). Tests
never import the bench scripts."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_bench(name: str, args: list[str], threads: int | None = None, timeout: float = 600,
              via_cli: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    command = ["-m", "ugpum", "bench", name] if via_cli else [str(REPO / "bench" / f"{name}.py")]
    return subprocess.run([sys.executable, *command, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)

"""Benchmarks run as a user runs them: `python -m ugpum bench NAME ...` in a child process (tests
never import the bench scripts)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_bench(name: str, args: list[str], threads: int | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return subprocess.run([sys.executable, "-m", "ugpum", "bench", name, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)

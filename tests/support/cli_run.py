"""`python -m ugpum train ...` in a child process, its output readable line by line as it comes (`Run`:
for what needs a process of its own, such as a signal, a lock or another environment), or run to its
end through the same `main` in the test's process (`main_here`, `train`: a child process adds seconds
of Python and torch starting per call)."""
from __future__ import annotations

import contextlib
import io
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Run:
    """`prefix`: a command the child runs under (e.g. setpriv, to drop root's right to read every file)."""

    def __init__(self, *args: str, env: dict | None = None, prefix: tuple[str, ...] = (), verb: str = "train"):
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "ugpum", verb, *args], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {})))
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_until(self, ready, timeout: float = 300, what: str = "the condition") -> None:
        """Poll `ready()` every 10 ms while the run lives."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            if ready():
                return
            time.sleep(0.01)
        raise AssertionError(f"never saw {what}:\n{''.join(self.output)}")

    def wait_for(self, text: str, timeout: float = 120) -> None:
        """Until a line holding `text` is printed."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if text in self.lines.get(timeout=max(end - time.monotonic(), 0.01)):
                    return
            except queue.Empty:
                break
        raise AssertionError(f"never saw {text!r}:\n{''.join(self.output)}")

    def wait_for_metrics(self, out: Path, steps: int, timeout: float = 120) -> None:
        """Until the run's metrics.jsonl records `steps` steps."""
        metrics = out / "metrics.jsonl"
        self.wait_until(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= steps, timeout,
                        f"{steps} steps logged")

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        time.sleep(0.05)
        return rc, "".join(self.output)


def main_here(*args: str) -> subprocess.CompletedProcess:
    """`python -m ugpum ARGS` through the same `main`, in this process, on one thread as `Run` is."""
    import torch

    from ugpum.commands import main
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(args))
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def train(*args: str, env: dict | None = None) -> tuple[int, str]:
    """`ugpum train ARGS` to its end: (exit code, all it printed); in a child process only for `env`."""
    if env is not None:
        return Run(*args, env=env).finish()
    done = main_here("train", *args)
    return done.returncode, done.stdout + done.stderr


def one_sentence(text: str) -> None:
    """The run's end is a sentence, never a traceback or a raw OS error number."""
    assert "Traceback" not in text and "[Errno" not in text, text

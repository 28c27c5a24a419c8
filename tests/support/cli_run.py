"""`python -m ugpum train ...` in a child process, its output readable line by line as it comes."""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Run:
    def __init__(self, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "ugpum", "train", *args], cwd=REPO,
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

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        time.sleep(0.05)
        return rc, "".join(self.output)


def train(*args: str, env: dict | None = None) -> tuple[int, str]:
    return Run(*args, env=env).finish()


def one_sentence(text: str) -> None:
    """The run's end is a sentence, never a traceback or a raw OS error number."""
    assert "Traceback" not in text and "[Errno" not in text, text

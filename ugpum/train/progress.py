"""A progress line with loss, it/s and ETA; the nodes pass their own callback instead."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, start: int = 0, label: str = "train", stream=None):
        # (sys.stderr as it is when the run starts: the command line's guarded stream, ugpum/commands/output.py)
        self.total, self.start, self.label, self.stream = total, start, label, stream or sys.stderr
        self.t0 = time.perf_counter()

    def rate(self, step: int) -> float:
        done = step - self.start
        return done / max(time.perf_counter() - self.t0, 1e-9)

    def update(self, step: int, loss: float) -> None:
        rate = self.rate(step)
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        width = 24
        filled = int(width * step / max(self.total, 1))
        line = (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} "
                f"loss {loss:.4f}  {rate:.2f} it/s  ETA {format_seconds(eta)}")
        if self.stream.isatty():                    # redraw one line in a terminal
            self.stream.write("\r" + line + ("\n" if step >= self.total else ""))
        elif step >= self.total or step % max(1, self.total // 10) == 0:
            self.stream.write(line + "\n")        # logs get a line every tenth of the run
        self.stream.flush()


def format_seconds(s: float) -> str:
    if s == float("inf"):
        return "--:--"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"

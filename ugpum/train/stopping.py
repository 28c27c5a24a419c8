"""How a run stops without losing what it trained.

Ctrl-C raises KeyboardInterrupt; SIGTERM (`kill`, `timeout`, `docker stop`, systemd) is turned into the
same (`Stopped`), so both take the path that saves a checkpoint and the LoRA so far. While a save is
being written, both signals are held back (`saving`): a second Ctrl-C cannot cut a checkpoint in
half. Signal handlers exist only in the main thread; elsewhere (ComfyUI runs nodes in a worker
thread, and stops them with its own Cancel) these are no-ops. A stop in any other phase (reading the
data, caching features, placing the model) says what is kept and how to go on (`stopped_note`).
"""
from __future__ import annotations

import contextlib
import signal

from ..startup import signals_handled
from ..wording import setting


class Stopped(KeyboardInterrupt):
    """A stop asked for by a signal other than Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_sigterm():
    """SIGTERM stops the run the way Ctrl-C does (for the duration of the block)."""
    with signals_handled(_raise_stopped, (signal.SIGTERM,)):
        yield


_saves: list[list[int]] = []          # the stops each save under way holds back (innermost last)


def request_stop(signum: int) -> None:
    """Stop as signal `signum` would (a front end whose output was lost asks so): raised here, or once
    the save under way is complete."""
    if _saves:
        _saves[-1].append(signum)
        return
    raise KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)


@contextlib.contextmanager
def saving(log, stopping: bool = False):
    """Hold Ctrl-C and SIGTERM (and `request_stop`) back while the block writes a save. A stop that came
    meanwhile stops the run once the save is complete, unless the run is `stopping` already (then it is
    noted)."""
    held: list[int] = []

    def hold(signum, _frame):
        held.append(signum)
        log(f"{signal.Signals(signum).name}: finishing the save first, then stopping")
    _saves.append(held)
    try:
        with signals_handled(hold):
            yield
    finally:
        _saves.remove(held)
    if held and not stopping:
        stop = KeyboardInterrupt() if held[0] == signal.SIGINT else Stopped(held[0])
        stop.after_save = True               # the save is complete: nothing of it needs doing again
        raise stop


def stopped_note(out, resume: bool = False) -> str:
    """Where a run stopped outside its steps' own saves stands (reading data, caching features, placing
    the model, validating): what is kept and the command that goes on."""
    from .run.checkpoint import latest_checkpoint
    checkpoint = latest_checkpoint(out)
    if checkpoint is not None:
        return (f"stopped before any new step was trained: {out} keeps its checkpoint {checkpoint.name}; "
                f"continue with {setting('resume', out)}")
    again = f"the same command (without {setting('resume')})" if resume else "the same command"
    return (f"stopped before the first step: nothing was trained; the features cached so far are kept, so "
            f"{again} starts again from them")

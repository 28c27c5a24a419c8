"""How a run stops without losing what it trained.

Ctrl-C raises KeyboardInterrupt; SIGTERM (`kill`, `timeout`, `docker stop`, systemd) is turned into the
same (`Stopped`), so both take the path that saves a checkpoint and the LoRA so far. While a save is
being written, both signals are held back (`saving`): a second Ctrl-C cannot cut a checkpoint in
half. Signal handlers exist only in the main thread; elsewhere (ComfyUI runs nodes in a worker
thread, and stops them with its own Cancel) these are no-ops. A stop in any other phase (reading the
data, caching features, placing the model) says what is kept and how to go on (`stopped_note`).

How a run stopped is one value, `Stop`: why, and what its newest complete save holds. It travels with the
exception that stopped the run (`Stop.throw`), so the loop and the front ends read it there (`Stop.of`).
"""
from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from ..startup import signals_handled
from ..wording import setting


class Stopped(KeyboardInterrupt):
    """A stop asked for by a signal other than Ctrl-C, or by any signal on some rank of a distributed run
    (`DistributedStop`)."""

    def __init__(self, signum: int, message: str | None = None):
        super().__init__(message or signal.Signals(signum).name)
        self.signum = signum


_CARRIED = "ugpum_stop"               # the attribute a Stop rides on its exception as


@dataclass(frozen=True)
class Stop:
    """Why a run stopped, and what it kept. Made where that is known (a save that held a stop back until
    it was complete, the stop every rank of a distributed run takes, the loop's one stop handler) and
    raised with its exception (`throw`); the loop and the front ends read it back (`Stop.of`)."""
    why: BaseException           # Ctrl-C, a signal (`Stopped`), ComfyUI's Cancel, an error, a distributed stop
    saved: int = 0               # the step the newest complete save holds (0: none, or not known where it was made)
    lora: Path | None = None     # that save's LoRA (None: no save of this run)
    told: bool = False           # what is kept was said (a rank's stop: its front end says it)

    @classmethod
    def of(cls, error: BaseException) -> Stop:
        """The Stop `error` was raised with; for an exception raised without one, a Stop that knows only why."""
        return getattr(error, _CARRIED, None) or cls(error)

    def throw(self) -> NoReturn:
        """Raise `why`, carrying this Stop (the one attribute put on an exception)."""
        setattr(self.why, _CARRIED, self)
        raise self.why

    @property
    def signum(self) -> int | None:
        """The signal that asked for the stop (Ctrl-C: SIGINT); None for an error or ComfyUI's Cancel."""
        if isinstance(self.why, Stopped):
            return self.why.signum
        return signal.SIGINT if isinstance(self.why, KeyboardInterrupt) else None


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_sigterm():
    """SIGTERM stops the run the way Ctrl-C does (for the duration of the block)."""
    with signals_handled(_raise_stopped, (signal.SIGTERM,)):
        yield


_saves: list[list[int]] = []          # the stops each holding block (a save, the lock being taken, a step applied
                                      # or read) holds back, innermost last


def request_stop(signum: int) -> None:
    """Stop as signal `signum` would (a front end whose output was lost asks so): raised here, or once
    the save under way is complete."""
    if _saves:
        _saves[-1].append(signum)
        return
    raise interruption(signum)


def interruption(signum: int) -> KeyboardInterrupt:
    """The exception a stop by signal `signum` raises: Ctrl-C's own, or `Stopped` for any other."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)


@contextlib.contextmanager
def _held_back(on_hold=None):
    """Ctrl-C and SIGTERM (and `request_stop`) held back for the block; yields the signals that came."""
    held: list[int] = []

    def hold(signum, _frame):
        held.append(signum)
        if on_hold is not None:
            on_hold(signum)
    _saves.append(held)
    try:
        with signals_handled(hold):
            yield held
    finally:
        _saves.remove(held)


@contextlib.contextmanager
def saving(log, at: int, stopping: bool = False):
    """Hold Ctrl-C and SIGTERM (and `request_stop`) back while the block writes the save of step `at`. A
    stop that came meanwhile stops the run once the save is complete (its Stop says so), unless the run is
    `stopping` already (then it is noted)."""
    def said(signum):
        log(f"{signal.Signals(signum).name}: finishing the save first, then stopping")
    with _held_back(said) as held:
        yield
    if held and not stopping:
        Stop(interruption(held[0]), saved=at).throw()      # the save is complete: nothing of it is done again


@contextlib.contextmanager
def uninterrupted():
    """A stop that comes during the block (taking the run folder's lock, applying a step and counting it) is
    raised once the block is done, so that what the block set up is in place to be undone or kept."""
    with _held_back() as held:
        yield
    if held:
        raise interruption(held[0])


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

"""What the command line prints, and what it does when its output cannot be written.

While a verb runs, standard output and standard error go through `Guarded` streams:
- every value the user gave on the command line that is longer than 300 characters is cut where a
  message repeats it (`wording.cut_values`), on every verb and option, argparse's own messages included;
- standard output that cannot be written stops the command as a signal would (a training run saves what
  it trained first: `stopping.request_stop`), and what would have followed is discarded: a closed pipe
  (`ugpum ... | head`) ends quietly with the exit code of a process SIGPIPE ended, as standard tools do;
  a full device (`> /dev/full`) or another failure is one sentence on standard error.
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
from pathlib import Path

from ..train.stopping import request_stop
from ..wording import cut_values

PIPE_CLOSED = 128 + signal.SIGPIPE


def _long_values(argv: list[str]) -> list[str]:
    """The arguments worth cutting, also as a message may show them (expanded, made absolute)."""
    values = [a for a in argv if len(a) > 300]
    for value in list(values):
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            values.append(str(Path(value).expanduser().absolute()))
    return values


class Guarded:
    """A text stream that cuts long values; for standard output (`lost` not None: a list), a write the
    system refuses is recorded there, stops the command, and later writes are dropped."""

    def __init__(self, stream, values: list[str], lost: list | None = None):
        self._stream, self._values, self._lost = stream, values, lost

    def write(self, text: str) -> int:
        if self._lost:
            return len(text)
        try:
            self._stream.write(cut_values(text, self._values))
            if "\n" in text:
                self._stream.flush()          # (a failure is met where it happens, not at exit)
        except OSError as error:
            self._failed(error)
        return len(text)

    def flush(self) -> None:
        if self._lost:
            return
        try:
            self._stream.flush()
        except OSError as error:
            self._failed(error)

    def _failed(self, error: OSError) -> None:
        if self._lost is None:                 # standard error: nothing more to say it on
            return
        self._lost.append(error)
        _discard(self._stream)
        request_stop(signal.SIGPIPE)           # (after a save under way)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _discard(stream) -> None:
    """From now on what `stream` holds or is given goes nowhere (its descriptor onto /dev/null), so that
    Python's own flush at exit meets no closed pipe or full device either."""
    with contextlib.suppress(OSError, ValueError, AttributeError):    # (a stream without a descriptor: tests)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)


class Output:
    """The verb's standard output and error, guarded for the block (`guarded`)."""

    def __init__(self, argv: list[str]):
        self.values = _long_values(argv)
        self.lost: list[OSError] = []
        self.training = bool(argv) and argv[0] == "train"

    def exit_code(self, code: int) -> int:
        """`code`, or what a lost output makes of it: quiet for a closed pipe, else one sentence."""
        if not self.lost:
            return code
        error = self.lost[0]
        if error.errno == errno.EPIPE:
            return PIPE_CLOSED
        reason = (error.strerror or str(error)).lower()
        full = " (the device it goes to is full)" if error.errno == errno.ENOSPC else ""
        kept = " (as Ctrl-C stops a run: every step it trained is saved)" if self.training else ""
        sys.stderr.write(f"error: standard output cannot be written: {reason}{full}; the command stopped there{kept}; "
                         "send its output to a file on a disk with room, or to a terminal\n")
        return 2


@contextlib.contextmanager
def guarded(argv: list[str]):
    """For the block, sys.stdout and sys.stderr as `Guarded` streams; what stdout still holds is written
    at the end (a failure then is a lost output too)."""
    output = Output(argv)
    before = sys.stdout, sys.stderr
    sys.stdout = Guarded(before[0], output.values, output.lost)
    sys.stderr = Guarded(before[1], output.values)
    try:
        yield output
    finally:
        with contextlib.suppress(KeyboardInterrupt):        # (a stop asked for by the last flush: too late)
            sys.stdout.flush()
        sys.stdout, sys.stderr = before

"""The command line's first second or two, while Python imports torch and the engine: a stop then
(Ctrl-C, or SIGTERM from `kill`, `timeout`, a service manager) ends the process with one sentence and
the signal's exit code, where Python would print a KeyboardInterrupt traceback or, for SIGTERM, end
without a word. Nothing is written before the command runs, so there is nothing to keep.

Only the command line is guarded (`python -m ugpum`, whose package is imported while `sys.argv[0]` is
still "-m", and the `ugpum` launcher); a library user's or ComfyUI's process keeps its own handlers.
Standard library only: this runs before anything heavy is imported.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading


def is_command_line() -> bool:
    """Whether this process is UGPUM's command line, starting."""
    first = sys.argv[0] if sys.argv else ""
    return first == "-m" or first.replace("\\", "/").endswith("/ugpum")


@contextlib.contextmanager
def signals_handled(handler, signals=(signal.SIGINT, signal.SIGTERM)):
    """For the block, `signals` go to `handler` (in the main thread; elsewhere nothing changes); the
    handlers before it are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


def _stop(signum, _frame):
    sys.stderr.write(f"\nstopped by {signal.Signals(signum).name} while starting: nothing was done\n")
    sys.stderr.flush()
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def stops_while_starting(command_line: bool | None = None):
    """For the block (the imports), Ctrl-C and SIGTERM end the command line as the module says; the
    handlers before it are restored after. `command_line`: None tells by `is_command_line()`."""
    guarded = is_command_line() if command_line is None else command_line
    if not guarded:
        yield
        return
    with signals_handled(_stop):
        yield

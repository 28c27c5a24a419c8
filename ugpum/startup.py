"""The command line's start-up, while Python imports torch and the engine and the verb loads ComfyUI and
the model: a stop then (Ctrl-C, or SIGTERM from `kill`, `timeout`, a service manager) ends the process
with one sentence and the signal's exit code, where Python would print a KeyboardInterrupt traceback or,
for SIGTERM, end without a word. Nothing is written before the command's work begins, so there is
nothing to keep, and the process ends in the handler itself (`os._exit`): an exception raised there
could be caught by the code it lands in (torch's C++ import of numpy drops one, ComfyUI's import has
bare `except:` clauses) and the process would then go on.

The guard is held from the package's first import (`hold_stops`) until the verb's work begins
(`started`); a verb with more start-up of its own (train: ComfyUI, the model) guards it again
(`stops_while_starting`). Only the command line is guarded (`python -m ugpum`, whose package is imported
while `sys.argv[0]` is still "-m", and the `ugpum` launcher); a library user's or ComfyUI's process
keeps its own handlers. Standard library only: this runs before anything heavy is imported.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_held: dict[int, object] = {}          # the handlers the start-up guard replaced, while it is held
_command_line: list[bool] = []         # told once, at the package's first import


def is_command_line() -> bool:
    """Whether this process is UGPUM's command line (decided when the package was first imported)."""
    if not _command_line:
        first = sys.argv[0] if sys.argv else ""
        _command_line.append(first == "-m" or first.replace("\\", "/").endswith("/ugpum"))
    return _command_line[0]


@contextlib.contextmanager
def signals_handled(handler, signals=SIGNALS):
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
    text = f"\nstopped by {signal.Signals(signum).name} while starting: nothing was done\n"
    with contextlib.suppress(BaseException):  # (the process ends below whatever the flush meets)
        sys.stdout.flush()                   # what was printed before stays in order
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - stderr replaced or closed: the sentence goes to the descriptor
        with contextlib.suppress(OSError):
            os.write(2, text.encode())
    os._exit(128 + signum)


def hold_stops(command_line: bool | None = None) -> None:
    """From here until `started`, Ctrl-C and SIGTERM end the command line as the module says (nothing
    changes for a library user, or outside the main thread). `command_line`: None tells by
    `is_command_line()`."""
    if command_line:
        _command_line[:] = [True]
    if _held or not is_command_line() or threading.current_thread() is not threading.main_thread():
        return
    _held.update({s: signal.signal(s, _stop) for s in SIGNALS})


def started() -> None:
    """The command's work begins: each signal the start-up guard still handles goes back to the handler
    it had before (one a verb installed meanwhile, such as SIGTERM's stop, stays)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s, before in _held.items():
        if signal.getsignal(s) is _stop:
            signal.signal(s, before)
    _held.clear()


@contextlib.contextmanager
def stops_while_starting(command_line: bool | None = None):
    """For the block (more start-up: imports, loading), Ctrl-C and SIGTERM end the command line as the
    module says; the handlers before it are restored after. `command_line`: None tells by
    `is_command_line()`."""
    guarded = is_command_line() if command_line is None else command_line
    if not guarded:
        yield
        return
    with signals_handled(_stop):
        yield

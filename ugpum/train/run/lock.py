"""One run at a time in a run folder: a lock taken before any work and held for the run's life.

Two runs started into one folder (by hand a moment apart, two ComfyUI queues, a resume while the run
still caches) would both train, replace each other's LoRA and interleave metrics.jsonl. The lock is an
operating-system lock on a small file in the folder (flock on POSIX, a byte-range lock on Windows):
the system releases it when its process ends in any way, even `kill -9`, so a lock left by a killed run
is never "held". The file names the process that holds it, for the refusal's sentence; the holder
removes it when it lets go, and a file a killed run left is taken over (and said so).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import TrainingError
from .layout import LOCK_NAME, RunFolder  # noqa: F401 (LOCK_NAME: the lock file, named by the run folder)


try:
    import fcntl
except ImportError:                      # Windows
    fcntl = None
    import msvcrt


class RunLocked(TrainingError):
    """Another run holds the run folder; the message says which process and what to do."""


def _try_lock(fd: int) -> bool:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return True
    except (BlockingIOError, PermissionError):
        return False
    except OSError as err:               # EACCES/EAGAIN on some systems mean "held" as well
        if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise


def _holder(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8") or "{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "another process"
    since = time.strftime("%H:%M:%S", time.localtime(holder["started"])) if holder.get("started") else "?"
    return f"process {holder['pid']} on {holder.get('host', '?')}, since {since}"


class RunLock:
    """The lock on one run folder (made if missing). `acquire` refuses with RunLocked when another run
    holds it; `release` lets go (also on any exit through `hold_run_folder`)."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self.path = RunFolder(self.folder).lock
        self._fd: int | None = None
        self.taken_over: dict | None = None     # what a run that ended without letting go had written
        self.unlocked: str = ""                  # why the folder could not be locked (a filesystem without locks)

    def acquire(self) -> "RunLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                locked = _try_lock(fd)
            except OSError as err:               # (some network filesystems have no locks: run unlocked, say so)
                os.close(fd)
                self.unlocked = err.strerror or str(err)
                with contextlib.suppress(OSError):
                    self.path.unlink()            # (nothing left behind: the file locks nothing here)
                return self
            if not locked:
                os.close(fd)
                raise RunLocked(f"{self.folder} is in use by another run ({_describe(_holder(self.path))}); "
                                "wait for it to end, or train into another folder")
            try:                                  # the file may have been removed by the run that just let go
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        left = _holder(self.path)
        self.taken_over = left if left.get("pid") else None
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        try:                                      # who holds it, for another run's refusal (a full disk: unsaid)
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, record.encode())
        except OSError:
            pass
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if fcntl is not None:                 # removed while held: nobody can lock a stale copy
                with contextlib.suppress(OSError):   # (a disk gone read-only keeps it: the next run takes it over)
                    self.path.unlink(missing_ok=True)
            else:
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        finally:
            os.close(fd)
        if fcntl is None:
            with contextlib.suppress(OSError):
                self.path.unlink()


@contextlib.contextmanager
def hold_run_folder(folder: Path | str, log=print) -> Iterator[RunLock]:
    """The run folder locked for the block (released however the block ends)."""
    lock = RunLock(folder).acquire()
    try:
        if lock.unlocked:
            log(f"note: {lock.folder} cannot be locked ({lock.unlocked}); start no second run into it meanwhile")
        if lock.taken_over:
            log(f"took over the lock a run that ended without releasing it left in {lock.folder} "
                f"({_describe(lock.taken_over)})")
        yield lock
    finally:
        lock.release()

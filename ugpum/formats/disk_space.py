"""A full disk as one sentence: the space a write needs and the space free, both measured, and only
a true claim about what was kept.

A write that can know its size asks first (`check_space`), so a file is never started that cannot be
finished; a write that fills the disk anyway (another program wrote meanwhile) is turned into the
same sentence (`refused_write`, which words the system's other refusals too: `refused.py`). Sizes are
shown in MiB with one decimal, or in bytes below 1 MiB, so a small LoRA never "needs about 0 MiB".
"""
from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import NoReturn

from .refused import SaveRefused, os_error_code, refusal

FULL = (errno.ENOSPC,)          # (a used-up quota is worded as such: refused.py)
# Headers, metadata and the filesystem's own blocks: a write needs a little more than its tensors.
MARGIN = 64 * 2**10


class DiskFull(SaveRefused):
    """No space left for a write; the message says how much is needed, how much is free and what is kept."""

    def __init__(self, message: str):
        super().__init__(message, errno.ENOSPC)


def size_text(n: int) -> str:
    """'12.3 MiB', or '812 bytes' below 1 MiB."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def existing_folder(path: Path) -> Path:
    """`path`, or its nearest folder that exists (whose filesystem a new folder there would be on)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(folder: Path) -> int:
    """Bytes this user may still write on the filesystem holding `folder` (made or not)."""
    return shutil.disk_usage(existing_folder(folder)).free


def is_disk_full(err: BaseException) -> bool:
    """ENOSPC, also as a library reports it (its own error type, with the OS error in the text)."""
    return isinstance(err, DiskFull) or os_error_code(err) in FULL


def _sentence(folder: Path, what: str, needed: int | None, free: int, kept: str | None) -> str:
    need = f"it needs about {size_text(needed)} and {size_text(free)} are free" if needed is not None \
        else f"{size_text(free)} are free"
    keep = f"; {kept}" if kept else ""
    return f"no space left on the disk holding {folder} for {what}: {need}; free some space{keep}"


def check_space(folder: Path, needed: int, what: str, kept: str | None = None) -> None:
    """Refuse, before writing, a write of about `needed` bytes into `folder` that cannot fit."""
    free = free_bytes(folder)
    if free < needed + MARGIN:
        raise DiskFull(_sentence(Path(folder), what, needed + MARGIN, free, kept))


def refused_write(err: BaseException, folder: Path, what: str, needed: int | None = None,
                  kept: str | None = None) -> BaseException:
    """`err` as one sentence when the system refused the write (a DiskFull for a full disk, a SaveRefused
    for the other refusals), else `err` itself (to re-raise)."""
    if isinstance(err, SaveRefused):
        return err
    if is_disk_full(err):
        return DiskFull(_sentence(Path(folder), what, needed, free_bytes(folder), kept))
    return refusal(err, Path(folder), what, kept)


def raise_refused(err: BaseException, folder: Path, what: str, needed: int | None = None,
                  kept: str | None = None) -> NoReturn:
    """Raise `err` as its one sentence when the system refused the write (`refused_write`: no chained
    traceback, the sentence says it all), else `err` as it is."""
    refused = refused_write(err, folder, what, needed, kept)
    if refused is err:
        raise err
    raise refused from None


def enough_space(folder: Path, needed: int) -> bool:
    return free_bytes(folder) >= needed + MARGIN


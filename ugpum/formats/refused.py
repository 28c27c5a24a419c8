"""A write the system refuses, as one sentence: the file, the reason in words and the fix, and only a
true claim about what is kept.

Besides a full disk (`disk_space.DiskFull`, which also measures the space), a system refuses a write
for a file-size limit (EFBIG: `ulimit -f`, or the filesystem's largest file), a used-up quota (EDQUOT),
a disk that is read-only now (EROFS: mounted so, or remounted by Linux after disk errors) and an I/O
error (EIO: a failing disk, cable or network share). The error may come as Python's OSError or as a
library's own type with the OS error in its text (safetensors: "... (os error 27)").
"""
from __future__ import annotations

import errno
import re
from pathlib import Path

from ..wording import EngineError

# errno -> (the reason, the fix), each in words
REASONS = {
    errno.EFBIG: ("the file would be larger than this system lets a process write (a file-size limit, as "
                  "`ulimit -f` sets, or the largest file its filesystem takes)",
                  "raise the limit (ulimit -f unlimited) or write to a filesystem that takes larger files"),
    errno.EDQUOT: ("this user's disk quota there is used up",
                   "free some of your files on that disk, or ask for a larger quota"),
    errno.EROFS: ("its disk is read-only now (mounted so, or remounted read-only, as Linux does after disk "
                  "errors)", "make it writable again (after disk errors, check the disk first: dmesg)"),
    errno.EIO: ("the disk reported an input/output error (a failing disk, cable or network share)",
                "check the disk (dmesg) and its connection before going on"),
}
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class SaveRefused(OSError, EngineError):
    """The system refused a write; the message names the file, the reason, the fix and what is kept."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.errno = code

    def __str__(self) -> str:                  # OSError would print "[Errno 30] ..." before the sentence
        return self.args[0]


def os_error_code(err: BaseException) -> int | None:
    """The OS error number of `err`: an OSError's, or the one a library's own error type names in its text."""
    code = getattr(err, "errno", None)
    if isinstance(code, int):
        return code
    found = _OS_ERROR.search(str(err))
    return int(found[1]) if found else None


def refusal(err: BaseException, folder: Path, what: str, kept: str | None = None) -> BaseException:
    """`err` as a SaveRefused sentence when it is one of the refusals above, else `err` itself (to re-raise)."""
    if isinstance(err, SaveRefused):
        return err
    code = os_error_code(err)
    if code not in REASONS:
        return err
    reason, fix = REASONS[code]
    return SaveRefused(f"cannot write {what} in {folder}: {reason}; {fix}" + (f"; {kept}" if kept else ""), code)

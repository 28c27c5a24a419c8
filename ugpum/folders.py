"""A folder the pack must write in, checked before any work: one sentence with the fix when it cannot
be made or written (a file in the way, a symlink to nowhere, a path too long, a read-only disk, no
permission), never a raw `Errno`; and the plain words for why a file or folder cannot be read."""
from __future__ import annotations

import errno
import os
from pathlib import Path

from .wording import EngineError

# The deepest a run writes below its folder: a cached feature's temporary file
# (cache/latents/.<40 hex>.safetensors.<pid>-<12 hex>.tmp), a checkpoint's files, a LoRA whose name takes
# the 255 bytes a file name may.
RUN_FOLDER_DEPTH = 300


class FolderError(ValueError, EngineError):
    """A folder cannot be made or written; the message names it, the setting and the fix."""


def path_max() -> int:
    """The longest path (in bytes, with its closing NUL) this system takes; 4096 on Linux."""
    try:
        return os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):
        return 4096


def too_long_name(path: Path, room: int = RUN_FOLDER_DEPTH) -> str:
    """'' unless a name in `path` is longer than the 255 bytes a file name may take, or the whole path
    leaves less than `room` bytes for what is written inside it before this system's path limit (then:
    which)."""
    long = [part for part in Path(path).parts if len(part.encode("utf-8", "surrogateescape")) > 255]
    if long:
        return f"the name {long[0][:40]}... is longer than the 255 bytes a file name may take"
    size, limit = len(os.fsencode(str(Path(path).absolute()))), path_max() - 1
    if size + room > limit:
        return (f"the path is {size:,} bytes long, and with the {room} bytes the files written inside it add, "
                f"it passes the {limit:,} bytes this system takes for a path")
    return ""


def dangling_link(path: Path) -> str:
    """'' unless `path`, or a folder on the way to it, is a symlink to something that does not exist."""
    for part in [Path(path), *Path(path).parents]:
        if part.is_symlink() and not part.exists():
            return f"{part} is a symlink to {os.readlink(part)}, which does not exist"
        if part.exists():
            return ""
    return ""


def unusable_reason(path: Path) -> str:
    """'' when `path` is (or can be made as) a folder this user writes in, else why not."""
    path = Path(path).expanduser().absolute()
    if too_long_name(path):                      # (first: the filesystem refuses even to look such a name up)
        return too_long_name(path)
    if dangling_link(path):
        return dangling_link(path)
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a folder"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, so no folder can be made inside it"
    if not os.access(existing, os.W_OK | os.X_OK):
        if hasattr(os, "statvfs") and os.statvfs(existing).f_flag & os.ST_RDONLY:
            return f"{existing} is on a read-only filesystem"
        return f"this user cannot write in {existing} (permission denied)"
    return ""


def check_writable(path: Path | str, setting: str, fix: str) -> Path:
    """`path` if it can hold the pack's files, else FolderError: '<setting> <path>: <why>; <fix>'."""
    reason = unusable_reason(Path(path))
    if reason:
        raise FolderError(f"{setting} {shown_path(path)}: {reason}; {fix}")
    return Path(path)


def shown_path(path: Path | str, limit: int = 200) -> str:
    """A path as a message quotes it: whole, or its start and end around how much was left out."""
    text = str(path)
    if len(text) <= limit:
        return text
    return f"{text[:limit // 2]}...({len(text) - limit:,} characters left out)...{text[-limit // 2:]}"


# errno -> why a path cannot be read, in words
_READ_REASONS = {errno.EACCES: "this user may not read it (permission denied)",
                 errno.EPERM: "this user may not read it (operation not permitted)",
                 errno.EISDIR: "it is a folder, not a file",
                 errno.ENOTDIR: "a part of its path is a file, not a folder",
                 errno.ENOENT: "it is not there (deleted or moved while the run read it)",
                 errno.ENAMETOOLONG: "its path is longer than this system takes",
                 errno.ELOOP: "it is a symlink that loops back on itself",
                 errno.EIO: "the disk reported an input/output error (a failing disk or a lost network share)"}


def read_reason(err: OSError) -> str:
    """Why reading a file or folder failed, in words (never a bare errno)."""
    return _READ_REASONS.get(getattr(err, "errno", None)) or (err.strerror or str(err)).lower()


def read_fix(err: OSError, path: Path | str, kind: str = "file") -> str:
    """What to do about `read_reason(err)` for `path` (a file or a folder)."""
    if getattr(err, "errno", None) in (errno.EACCES, errno.EPERM):
        mode = "a+rx" if kind == "folder" else "a+r"
        return f"make it readable for the user running UGPUM (chmod {mode} {shown_path(path)}), or remove it"
    if getattr(err, "errno", None) == errno.EISDIR:
        return "move that folder out of the way, or remove it"
    return "check the disk, or remove it"

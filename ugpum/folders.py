"""A folder the pack must write in, checked before any work: one sentence with the fix when it cannot
be made or written (a file in the way, a read-only disk, no permission), never a raw `Errno`."""
from __future__ import annotations

import os
from pathlib import Path


class FolderError(ValueError):
    """A folder cannot be made or written; the message names it, the setting and the fix."""


def too_long_name(path: Path) -> str:
    """'' unless a name in `path` is longer than the 255 bytes a file name may take (then: which)."""
    long = [part for part in Path(path).parts if len(part.encode("utf-8", "surrogateescape")) > 255]
    return f"the name {long[0][:40]}... is longer than the 255 bytes a file name may take" if long else ""


def unusable_reason(path: Path) -> str:
    """'' when `path` is (or can be made as) a folder this user writes in, else why not."""
    path = Path(path).expanduser().absolute()
    if too_long_name(path):                      # (first: the filesystem refuses even to look such a name up)
        return too_long_name(path)
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
        raise FolderError(f"{setting} {path}: {reason}; {fix}")
    return Path(path)

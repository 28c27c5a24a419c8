"""Atomic file writes: write to a temporary name in the same folder, then os.replace.

A reader (ComfyUI's LoRA list, a resume after a crash) must never see half a file under
the final name; os.replace is atomic only within one filesystem, hence the same folder.
Every file ends up with the mode the user's umask gives a new file (0644 under umask 022), whatever
the writer used: safetensors writes 0600, which a ComfyUI running as another user cannot read.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _temp_name_for(final: Path) -> Path:
    # Hidden and with a random part, so it never collides with or looks like a finished file.
    return final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.tmp")


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask can only be read by
    setting it, which another thread creating a file at that moment would see)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(*paths: Path | str) -> None:
    """Give each file the mode a new file gets under the user's umask (0o666 & ~umask)."""
    mode = 0o666 & ~current_umask()
    for path in paths:
        os.chmod(path, mode)


def _fsync_file(path: Path) -> None:
    # Flush the data before the rename so a power cut cannot leave an empty file behind.
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


@contextlib.contextmanager
def atomic_path(final: Path | str) -> Iterator[Path]:
    """Yield a temporary path next to `final`; the body writes it completely.

    On success the temporary file, given the umask's mode (`honour_umask`), replaces `final` in one
    step. On any exception the temporary file is removed, `final` is left as it was, and the
    exception propagates.
    """
    final = Path(final)
    if not final.parent.is_dir():
        raise FileNotFoundError(
            f"cannot write {final}: folder {final.parent} does not exist; create it first"
        )
    temp = _temp_name_for(final)
    try:
        yield temp
        if not temp.exists():
            raise FileNotFoundError(
                f"nothing was written for {final}: the writer did not create {temp.name}"
            )
        _fsync_file(temp)
        honour_umask(temp)
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path | str, obj: Any) -> None:
    """Write `obj` as indented UTF-8 JSON to `path` atomically."""
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"  # serialise first: a bad obj writes nothing
    with atomic_path(path) as temp:
        temp.write_text(text, encoding="utf-8")

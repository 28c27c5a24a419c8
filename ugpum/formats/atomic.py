"""Atomic file writes: write to a temporary name in the same folder, then os.replace.

A reader (ComfyUI's LoRA list, a resume after a crash) must never see half a file under
the final name; os.replace is atomic only within one filesystem, hence the same folder.
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


def _fsync_file(path: Path) -> None:
    # Flush the data before the rename so a power cut cannot leave an empty file behind.
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


@contextlib.contextmanager
def atomic_path(final: Path | str) -> Iterator[Path]:
    """Yield a temporary path next to `final`; the body writes it completely.

    On success the temporary file replaces `final` in one step. On any exception the
    temporary file is removed, `final` is left as it was, and the exception propagates.
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
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path | str, obj: Any) -> None:
    """Write `obj` as indented UTF-8 JSON to `path` atomically."""
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"  # serialise first: a bad obj writes nothing
    with atomic_path(path) as temp:
        temp.write_text(text, encoding="utf-8")

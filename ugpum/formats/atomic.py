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
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .disk_space import check_space, raise_refused


def temp_name_for(final: Path) -> Path:
    # Hidden and with a random part, so it never collides with or looks like a finished file; the
    # writer's process id in it tells a leftover of a killed writer from a write under way.
    # A final name near the 255 bytes a file name may take is shortened in it (the name stays unique).
    tail = f".{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp"
    name = final.name.encode("utf-8", "surrogateescape")[:255 - 1 - len(tail)].decode("utf-8", "ignore")
    return final.with_name(f".{name}{tail}")


_TEMP = re.compile(r"^\..+\.(?:(\d+)-)?[0-9a-f]{12}\.tmp$")
# The temporary names of the safetensors library's own writer (Rust's tempfile: ".tmp" and six letters or
# digits), which older versions wrote through inside atomic_path's: it says not which process wrote it.
_LIBRARY_TEMP = re.compile(r"^\.tmp[0-9A-Za-z]{6}$")


def is_temp_name(name: str) -> bool:
    """Whether `name` is one of atomic_path's temporary names (this version's or an older one's)."""
    return _TEMP.match(name) is not None


def _held_open(path: Path) -> bool:
    """Whether some process has `path` open (Linux's /proc says; where it cannot tell: taken to be)."""
    try:
        target = os.stat(path)
        processes = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True
    for pid in processes:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    st = os.stat(fd.path)
                    if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                        return True
    return False


def _started(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), where Linux's /proc says; else None."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _ended(pid: int) -> bool:
    """Whether process `pid` has ended but is not yet reaped by its parent (a zombie: it writes nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _alive(pid: int, written: float | None = None) -> bool:
    """Whether the process numbered `pid` may still be writing a file last written at `written`: it
    exists, has not ended (a killed process whose parent has not reaped it yet has), and started before
    that write (a later process given the same number is another one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        pass                             # another user's process: /proc may still tell
    if _ended(pid):
        return False
    started = _started(pid)
    return written is None or started is None or started <= written + 2.0     # (/proc's boot time: whole seconds)


def abandoned_temp(path: Path) -> bool:
    """A temporary file whose writer is gone: its process has ended (also when not yet reaped), or its
    number now belongs to a process started after the file was written, or the name (from an older
    version) does not say which process wrote it; the safetensors library's own temporary file when no
    process holds it open. A write under way in another process is kept."""
    if _LIBRARY_TEMP.match(path.name):
        return not _held_open(path)          # (a writer holds its temporary file open until it renames it)
    match = _TEMP.match(path.name)
    if match is None:
        return False
    pid = match.group(1)
    if pid is None:
        return True
    try:
        written = path.stat().st_mtime
    except OSError:
        return False                     # gone already
    return int(pid) != os.getpid() and not _alive(int(pid), written)


def remove_abandoned(folder: Path | str) -> list[Path]:
    """Delete the temporary files (and folders named as atomic_path names files) of killed writers in
    `folder`, not those of writes under way."""
    folder = Path(folder)
    found = sorted({*folder.glob(".*.tmp"), *folder.glob(".tmp*")})
    gone = [p for p in found if (p.is_file() or (p.is_dir() and is_temp_name(p.name))) and abandoned_temp(p)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
    return gone


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
def atomic_path(final: Path | str, needed: int | None = None, kept: str | None = None) -> Iterator[Path]:
    """Yield a temporary path next to `final`; the body writes it completely.

    On success the temporary file, given the umask's mode (`honour_umask`), replaces `final` in one
    step. On any exception the temporary file is removed, `final` is left as it was, and the
    exception propagates; a write the system refuses as one sentence naming the file: a full disk as
    DiskFull with the free space (`needed`: the bytes the file takes, when known, checked before
    anything is written), a file-size limit, quota, read-only disk or I/O error as SaveRefused
    (`kept`: what the sentence may say is kept).
    """
    final = Path(final)
    if not final.parent.is_dir():
        raise FileNotFoundError(
            f"cannot write {final}: folder {final.parent} does not exist; create it first"
        )
    if needed is not None:
        check_space(final.parent, needed, final.name, kept)
    temp = temp_name_for(final)
    try:
        yield temp
        if not temp.exists():
            raise FileNotFoundError(
                f"nothing was written for {final}: the writer did not create {temp.name}"
            )
        _fsync_file(temp)
        honour_umask(temp)
        os.replace(temp, final)
    except BaseException as err:
        with contextlib.suppress(OSError):          # (a disk that went read-only keeps it: the next run clears it)
            temp.unlink(missing_ok=True)
        raise_refused(err, final.parent, final.name, needed, kept)


def write_json_atomic(path: Path | str, obj: Any) -> None:
    """Write `obj` as indented UTF-8 JSON to `path` atomically."""
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"  # serialise first: a bad obj writes nothing
    with atomic_path(path) as temp:
        temp.write_text(text, encoding="utf-8")


def append_line(path: Path | str, line: str) -> None:
    """Append one line to a log (metrics.jsonl) whole or not at all: a write the disk cuts short is
    taken back, so a reader never meets half a line; a refused write as one sentence naming the file."""
    path = Path(path)
    size = path.stat().st_size if path.exists() else 0
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line.rstrip("\n") + "\n")
    except OSError as err:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise_refused(err, path.parent, path.name, len(line) + 1)

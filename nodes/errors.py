"""Turn what ugpum raises into one sentence a ComfyUI user can act on (never a bare traceback).

Only the exceptions ugpum raises on purpose are translated (its EngineErrors, the settings they mark
worded as the nodes' inputs, and a few builtin ones); anything else is a bug and keeps its traceback. ComfyUI's own interruption (Cancel) passes through untouched.
"""
from __future__ import annotations

import contextlib
import errno
import re

from ugpum.arch import UnknownModel, family_titles
from ugpum.planning.devices import DeviceError
from ugpum.formats.safetensors_header import HeaderError
from ugpum.wording import EngineError, for_nodes


class UGPUMError(RuntimeError):
    """Shown to the user as is: a sentence that says what went wrong and what to do."""


def _optional(module: str, name: str) -> tuple[type[BaseException], ...]:
    try:
        mod = __import__(module, fromlist=[name])
        return (getattr(mod, name),)
    except (ImportError, AttributeError):
        return ()


def _sentence(text: str) -> str:
    text = " ".join(str(text).split())
    if text and text[-1] not in ".!?":
        text += "."
    return text


def _without_path(message: str) -> str:
    """ugpum's messages start with the file path; the user picked the file by name already."""
    return re.sub(r"^\S+\.safetensors:\s*", "", message)


def user_message(exc: BaseException, file_name: str | None = None) -> str | None:
    """The user-facing sentence for an exception ugpum raises on purpose, or None."""
    what = f"'{file_name}'" if file_name else "the file"
    if isinstance(exc, HeaderError):
        return _sentence(f"Cannot read {what}: {_without_path(str(exc))}; pick a .safetensors diffusion model")
    if isinstance(exc, UnknownModel):
        return _sentence(f"{what} is not a diffusion model UGPUM can train "
                         f"({_without_path(str(exc))}); it supports {family_titles(' and ')}")
    if isinstance(exc, DeviceError):              # devices are typed in the Loader's devices field
        return _sentence(f"{exc} (the UGPUM Loader's devices field)")
    if isinstance(exc, EngineError):              # the engine's own sentence (a full disk: space needed and free)
        return _sentence(str(exc))
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EROFS, errno.ENAMETOOLONG) and exc.filename:
        from ugpum.folders import shown_path
        return _sentence(f"Cannot write {shown_path(exc.filename)} ({exc.strerror}); make that folder writable, or "
                         "set ComfyUI's output folder (--output-directory) to a folder you can write in")
    if isinstance(exc, FileNotFoundError):
        return _sentence(f"File not found: {exc.filename or exc}")
    if isinstance(exc, _optional("torch", "OutOfMemoryError")):
        first = str(exc).splitlines()[0] if str(exc) else "out of memory"
        return _sentence(f"A GPU ran out of memory ({first[:200]}); lower the resolution, batch or "
                         "LoRA rank, set recompute = all on the Partition Planner, or add a GPU, then run the "
                         "Partition Planner again")
    if isinstance(exc, ValueError) and _raised_in_ugpum(exc):   # ugpum validates with a sentence
        return _sentence(str(exc))
    return None


def _raised_in_ugpum(exc: BaseException) -> bool:
    """True when the innermost frame of the traceback is ugpum's code (not torch's, not a bug below)."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and last.tb_frame.f_globals.get("__name__", "").split(".")[0] == "ugpum"


@contextlib.contextmanager
def user_errors(node: str, file_name: str | None = None):
    """Re-raise ugpum's exceptions as UGPUMError("<node>: <sentence>"), chained to the original."""
    try:
        yield
    except UGPUMError:
        raise
    except Exception as exc:
        if is_interruption(exc):
            raise
        message = user_message(exc, file_name)
        if message is None:
            raise
        raise UGPUMError(f"{node}: {for_nodes(message)}") from exc


def is_interruption(exc: BaseException) -> bool:
    """ComfyUI's Cancel (comfy.model_management.InterruptProcessingException), matched by name."""
    return type(exc).__name__ == "InterruptProcessingException"

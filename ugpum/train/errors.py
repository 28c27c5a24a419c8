"""The training engine's own errors: each message is one sentence that names the setting or the
folder and the fix (front ends word the settings it marks, ugpum/wording.py)."""
from __future__ import annotations

from ..wording import EngineError


class TrainingError(RuntimeError, EngineError):
    pass


class RunExists(TrainingError):
    """The output folder holds an earlier run; the message says how to continue or replace it."""


class DatasetError(ValueError, EngineError):
    """A dataset folder, file or setting is unusable; the message says which and what to do."""

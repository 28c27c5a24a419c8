"""The training engine's own errors: each message is one sentence that names the setting or the
folder and the fix (front ends show it as it is)."""
from __future__ import annotations


class TrainingError(RuntimeError):
    pass


class RunExists(TrainingError):
    """The output folder holds an earlier run; the message says how to continue or replace it."""


class DatasetError(ValueError):
    """A dataset folder, file or setting is unusable; the message says which and what to do."""

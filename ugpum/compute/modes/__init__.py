"""The base-compute modes (`base_compute = bf16 | fp8 | int8 | ...`): how the frozen base's Linears
compute, one module each in this folder, found from the folder alone. A module that defines `MODE` (a
`mode.ComputeMode`) is a mode: adding a mode is adding a file. Everything outside this folder asks the
mode (`mode_named`) what it quantises, holds, costs and needs, and never compares a setting with a
mode's name (tests/unit/test_package_shape.py checks both)."""
from __future__ import annotations

import importlib
import pkgutil

from .mode import ComputeMode

AUTO = "auto"               # the setting that lets the planner choose (ugpum.planning.plan.choose_base_compute)
# The least per-block cosine between a mode's LoRA gradients and the exact base's that auto accepts: it takes
# the fastest forecast among the exact base and the modes that reach it (`within_quality_bound`).
QUALITY_BOUND = 0.998


def _find_modes() -> tuple[ComputeMode, ...]:
    """The `MODE` of every module in this folder, in their `order`."""
    modules = (importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__))
    return tuple(sorted((m.MODE for m in modules if hasattr(m, "MODE")), key=lambda mode: (mode.order, mode.name)))


MODES = _find_modes()
NAMES = tuple(mode.name for mode in MODES)
SETTINGS = (AUTO,) + NAMES
EXACT = next(mode for mode in MODES if not mode.quantises)      # the base as loaded: what auto keeps on a tie
_BY_NAME = {mode.name: mode for mode in MODES}


def mode_named(name: str) -> ComputeMode:
    """The mode a base_compute setting names (not `auto`: the planner resolves that first)."""
    mode = _BY_NAME.get(name)
    if mode is None:
        raise ValueError(f"base_compute {name!r}: use one of {', '.join(NAMES)}")
    return mode


def held_dtype(setting: str, weight_dtype: str) -> str:
    """The dtype the planner counts a base weight as under this base_compute setting: its mode's, else
    the run's weight dtype (the exact base, and auto until the planner resolves it)."""
    mode = _BY_NAME.get(setting)
    return (mode.held_dtype if mode else None) or weight_dtype


def tensor_core_modes() -> tuple[ComputeMode, ...]:
    """The quantising modes with tensor-core kernels: those base_compute = auto may weigh, in their order."""
    return tuple(mode for mode in MODES if mode.quantises and mode.min_capability is not None)


def modes_run_by(capabilities: list[tuple[int, int] | None]) -> tuple[ComputeMode, ...]:
    """The tensor-core modes every one of these devices runs (None in the list: a device without CUDA tensor
    cores, such as the CPU), in their order; none for no devices."""
    return tuple(mode for mode in tensor_core_modes() if capabilities and all(mode.runs_on(c) for c in capabilities))


def fastest_mode_for(capabilities: list[tuple[int, int] | None]) -> ComputeMode | None:
    """The first tensor-core mode every one of these devices runs, or None when there is none."""
    runs = modes_run_by(capabilities)
    return runs[0] if runs else None


def within_quality_bound(mode: ComputeMode) -> bool:
    """Whether base_compute = auto may take `mode`: the exact base, or a mode whose recorded gradient cosine
    reaches QUALITY_BOUND (one never measured does not)."""
    return not mode.quantises or (mode.gradient_cosine is not None and mode.gradient_cosine >= QUALITY_BOUND)


__all__ = ["AUTO", "EXACT", "MODES", "NAMES", "QUALITY_BOUND", "SETTINGS", "ComputeMode", "fastest_mode_for",
           "held_dtype", "mode_named", "modes_run_by", "tensor_core_modes", "within_quality_bound"]

"""Model families the planner knows: look one up by id, or recognise it from a checkpoint header.

Each family is one package here (ugpum/arch/<family>/) whose `FAMILY` (ugpum.arch.family.Family) names
its ids, builds its specs and recognises its checkpoints; its spec class supplies everything the generic
code asks of a model of that family (ArchSpec's abstract members). The registry finds the families
from their folders alone: adding a family is adding a folder, holding

  __init__.py   FAMILY = Family(name=<the folder's name>, title, marker, spec_class, ids, spec, recognise)
  variants.py   the sizes the planner knows by id, and recognising one from a checkpoint's shapes
  spec.py       the ArchSpec subclass: every abstract member of ArchSpec (tests/unit/test_package_shape.py
                checks that each family supplies them all and that no code outside ugpum/arch/ asks
                which family a model is)
  stage.py      its pipeline stage for the distributed engine (a ugpum.arch.stage.Stage)

Besides code, a family needs data keyed by its name: its measured cost coefficients in
ugpum/planning/calibration.json (bench/calibration_fit.py), training presets (ugpum/catalog/profiles.py) and model
files (ugpum/catalog/models.py); and ComfyUI's model class, latent format and CLIP type for it where
the command line builds ComfyUI's objects (the pack's bridge module, reached through
ugpum/commands/bridge.py)."""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from ..formats.safetensors_header import check_file
from ..wording import EngineError
from .base import ArchSpec, BlockSpec, LinearSpec, Workload
from .family import Family
from .header import strip_prefix, weight_dtype


def _find_families() -> tuple[Family, ...]:
    """The `FAMILY` of every package in this folder, by folder name."""
    packages = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)
    return tuple(importlib.import_module(f"{__name__}.{name}").FAMILY for name in packages)


FAMILIES = _find_families()


class UnknownModel(ValueError, EngineError):
    pass


def model_ids() -> list[str]:
    return [id for fam in FAMILIES for id in fam.ids]


def get_spec(model_id: str) -> ArchSpec:
    for fam in FAMILIES:
        if model_id in fam.ids:
            return fam.spec(model_id)
    raise UnknownModel(f"unknown model id {model_id!r}; known: {', '.join(model_ids())}")


def family_named(name: str) -> Family:
    """The family whose specs have `ArchSpec.family` == `name`."""
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise UnknownModel(f"unknown model family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")


def recognise(path: str | Path) -> tuple[ArchSpec, str, str]:
    """(spec, key prefix, weight dtype) of a DiT checkpoint, from its header alone (checked against the
    file's size, so a truncated or inconsistent file is named here, before any work starts)."""
    header = check_file(path)
    shapes, prefix = strip_prefix(header.shapes())
    for fam in FAMILIES:
        spec = fam.recognise(shapes, Path(path).name)
        if spec is not None:
            return spec, prefix, weight_dtype(header)
    raise UnknownModel(f"{path}: not a {' or '.join(f.title for f in FAMILIES)} diffusion model "
                       f"(no {' or '.join(f.marker for f in FAMILIES)} tensor in its header)")


__all__ = ["ArchSpec", "BlockSpec", "Family", "LinearSpec", "Workload", "UnknownModel", "family_named", "get_spec",
           "model_ids", "recognise", "strip_prefix"]

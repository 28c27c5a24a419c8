"""Model families the planner knows: look one up by id, or recognise it from a checkpoint header.

Each family is one package here (ugpum/arch/<family>/) whose `FAMILY` (ugpum.arch.family.Family) names
its ids, builds its specs and recognises its checkpoints; its spec class supplies everything the generic
code asks of a model of that family (ArchSpec's abstract members). The registry finds the families
from their folders alone: adding a family is adding a folder, holding

  __init__.py       FAMILY = Family(name=<the folder's name>, title, marker, spec_class, ids, spec, recognise,
                    comfy, calibration)
  variants.py       the sizes the planner knows by id, and recognising one from a checkpoint's shapes
  spec.py           the ArchSpec subclass: every abstract member of ArchSpec (tests/unit/test_package_shape.py
                    checks that each family supplies them all and that no code outside ugpum/arch/ asks
                    which family a model is)
  stage.py          its pipeline stage for the distributed engine (a ugpum.arch.stage.Stage)
  sampler.py        how ComfyUI samples it (its sigmas and model function, for previews)
  comfyui.py        how ComfyUI builds and feeds it, by name (ugpum.arch.comfyui.ComfyModel: the model class
                    and its arguments, latent format, text encoder type and what loading that needs)
  calibration.json  its planner coefficients measured on a GPU (ugpum/planning/cost.py reads them)

Training presets (ugpum/catalog/profiles.py) and downloadable files (ugpum/catalog/models.py) name models
by id; a family trains without them (from a model file, or a tiny model with random weights)."""
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


def family_titles(joined_by: str = " or ") -> str:
    """The families as users know them, for messages: "FLUX.2 or Wan 2.1"."""
    return joined_by.join(f.title for f in FAMILIES)


def family_of(spec: ArchSpec) -> Family:
    """The family `spec` belongs to."""
    return family_named(spec.family)


def text_encoder_support(model_id: str) -> tuple[str, tuple]:
    """(the model's text encoder, the lines ComfyUI's source must hold to load it); ("", ()) for a model
    that needs none of ComfyUI's (the tiny test models)."""
    for fam in FAMILIES:
        if model_id in fam.comfy.text_encoders:
            return fam.comfy.text_encoders[model_id]
    return "", ()


def recognise(path: str | Path) -> tuple[ArchSpec, str, str]:
    """(spec, key prefix, weight dtype) of a DiT checkpoint, from its header alone (checked against the
    file's size, so a truncated or inconsistent file is named here, before any work starts)."""
    header = check_file(path)
    shapes, prefix = strip_prefix(header.shapes())
    for fam in FAMILIES:
        spec = fam.recognise(shapes, Path(path).name)
        if spec is not None:
            return spec, prefix, weight_dtype(header)
    raise UnknownModel(f"{path}: not a {family_titles()} diffusion model "
                       f"(no {' or '.join(f.marker for f in FAMILIES)} tensor in its header)")


__all__ = ["ArchSpec", "BlockSpec", "Family", "LinearSpec", "Workload", "UnknownModel", "family_named", "family_of",
           "family_titles", "get_spec", "model_ids", "recognise", "strip_prefix", "text_encoder_support"]

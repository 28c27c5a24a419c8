"""A model family as the registry (ugpum.arch) holds it. Each family is one package under ugpum/arch/
(its folder name is its name) whose `FAMILY` is one of these: the registry finds it from the folder
alone, and everything the generic code asks of a model of that family is a member of `spec_class`, its
ComfyUI side (`comfy`) or its measured planner coefficients (`calibration`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .base import ArchSpec
from .comfyui import ComfyModel


@dataclass(frozen=True)
class Family:
    name: str                            # ArchSpec.family of its specs: its folder's name
    title: str                           # as users know it, in messages: "FLUX.2", "Wan 2.1"
    marker: str                          # the module a header must hold to be this family (named when none is)
    spec_class: type[ArchSpec]           # what the generic code calls (ArchSpec's abstract members)
    ids: tuple[str, ...]                 # the model ids `get_spec` knows it by
    spec: Callable[[str], ArchSpec]      # the spec of one of `ids`
    # the spec of a checkpoint from its header's shapes (prefix stripped) and its file name, or None
    recognise: Callable[[dict[str, tuple[int, ...]], str], ArchSpec | None]
    comfy: ComfyModel                    # how ComfyUI builds and feeds its models (names only)
    calibration: dict                    # its planner coefficients measured on a GPU (`read_calibration`)

    @property
    def takes_clips(self) -> bool:
        return self.spec_class.takes_clips


def read_calibration(package_file: str) -> dict:
    """The calibration.json beside a family's __init__.py: the coefficients ugpum/planning/cost.py reads."""
    return json.loads((Path(package_file).parent / "calibration.json").read_text(encoding="utf-8"))

"""Wan 2.1 text-to-video DiTs (1.3B, 14B) in ComfyUI's module layout (`comfy.ldm.wan.model.WanModel`):
`variants` (the sizes the planner knows, and recognising one from a header), `spec` (what the generic
code asks of a Wan model), `stage` (its pipeline stage for the distributed engine), `sampler` (how ComfyUI
samples it), `comfyui` (how ComfyUI builds and feeds it) and `calibration.json` (its measured planner
coefficients).

Figures from DESIGN.md §4: 14B has dim 5120, 40 blocks, 40 heads, FFN 13824, umT5-XXL text (4096).
"""
from __future__ import annotations

from ..family import Family, read_calibration
from .comfyui import COMFY
from .spec import WanSpec
from .variants import NAME, VARIANTS, recognise, spec

FAMILY = Family(name=NAME, title="Wan 2.1", marker="head.modulation", spec_class=WanSpec, ids=tuple(VARIANTS),
                spec=spec, recognise=recognise, comfy=COMFY, calibration=read_calibration(__file__))

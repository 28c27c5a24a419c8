"""FLUX.2 ([klein] 4B/9B, base and distilled, and [dev]) in ComfyUI's module layout
(`comfy.ldm.flux.model.Flux` with the FLUX.2 switches): `variants` (the sizes the planner knows, and
recognising one from a header), `spec` (what the generic code asks of a FLUX.2 model), `stage` (its
pipeline stage for the distributed engine), `sampler` (how ComfyUI samples it), `comfyui` (how ComfyUI builds
and feeds it) and `calibration.json` (its measured planner coefficients).

Figures from DESIGN.md §4: hidden = heads x 128, SwiGLU MLP ratio 3, no biases, modulation computed
once per step by three top-level modules and shared by all blocks.

[dev] differs from [klein] beyond its size in one module: `guidance_in`, an embedder for the distilled
guidance scale (added to the timestep embedding). Its presence in a header is what tells a dev-like
file from a klein-like one; a model that has it must be given `guidance=` in every forward, or ComfyUI
silently skips the embedding.
"""
from __future__ import annotations

from ..family import Family, read_calibration
from .comfyui import COMFY
from .spec import Flux2Spec
from .variants import NAME, VARIANTS, recognise, spec

FAMILY = Family(name=NAME, title="FLUX.2", marker="double_stream_modulation_img", spec_class=Flux2Spec,
                ids=tuple(VARIANTS), spec=spec, recognise=recognise, comfy=COMFY,
                calibration=read_calibration(__file__))

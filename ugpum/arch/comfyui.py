"""A family as ComfyUI builds and feeds it, named, never imported: ugpum runs without ComfyUI, so each
family's folder holds the names of ComfyUI's classes and a builder of their arguments that takes
ComfyUI's own module; the pack's bridge module (the command line's, through ugpum/commands/bridge.py) and
the nodes apply them to the ComfyUI they run."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Mapping

# A line ComfyUI's source must hold for a text encoder to load: (file, line pattern, what lacks without it).
# Read as text, never imported, so a ComfyUI is checked before any download or import.
SourceLine = tuple[str, str, str]


@dataclass(frozen=True)
class ComfyModel:
    module: str                     # the module of ComfyUI's model class: "comfy.ldm.flux.model"
    model_class: str                # the class in it: "Flux"
    # the class's keyword arguments for a spec, given that module (ComfyUI's versions differ in what they take)
    kwargs: Callable[[object, ModuleType], dict]
    latent_format: str              # comfy.latent_formats.<name>: what the VAE's latents are scaled by
    clip_type: str                  # comfy.sd.CLIPType.<name>; the stock CLIPLoader's type is its lower case
    # model id -> (its text encoder, the source lines ComfyUI needs to load it)
    text_encoders: Mapping[str, tuple[str, tuple[SourceLine, ...]]]

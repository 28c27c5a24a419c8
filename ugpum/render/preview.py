"""Render prompts (images, or Wan clips) on a model placed by a plan, optionally with a LoRA at a
strength: the engine behind the Sample Preview node. Before/after uses the same seed with the LoRA at
0 and at strength."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..arch.base import ArchSpec
from ..formats.lora_file import lora_modules
from ..placement.place import place_by_plan
from ..compute.lora import LoraSet
from .prompt import render


def attach_lora_tensors(model, tensors: dict[str, torch.Tensor]) -> LoraSet:
    """Adapters holding a trained LoRA's weights (any key style ComfyUI reads), on their layers' devices."""
    lora = LoraSet()
    for path, parts in lora_modules(tensors, source="the connected LoRA").items():
        a, b = parts["A"], parts["B"]
        adapter = lora.add(model, path, a.shape[0], parts["alpha"])
        with torch.no_grad():
            adapter.A.copy_(a)
            adapter.B.copy_(b)
    return lora


@dataclass
class PreviewPrompt:
    """What one preview renders: the encoded prompts ([L, C] each), the size, the seed, the sampling
    steps (0: the model's default) and, for a Wan clip, the frames."""
    positive: torch.Tensor
    negative: torch.Tensor | None
    width: int
    height: int
    seed: int
    steps: int = 0
    frames: int = 1


@torch.no_grad()
def render_on_plan(spec: ArchSpec, plan, model, model_file: str, key_prefix: str, weight_dtype, decode,
                   prompt: PreviewPrompt, lora_tensors: dict | None = None, strength: float = 1.0,
                   before_and_after: bool = True) -> list[torch.Tensor]:
    """Samples ([T,3,H,W] in [-1,1]; T = `prompt.frames` for a Wan clip, else 1): without and with the
    LoRA, or just one. The model (built on meta, streamed from `model_file`) is placed for the call and
    released afterwards (the Sample Preview node has checked the frames)."""
    on_meta = any(p.is_meta for p in model.parameters())
    placement = place_by_plan(model, plan, spec.tail_modules, model_file, key_prefix, weight_dtype)
    lora = attach_lora_tensors(model, lora_tensors) if lora_tensors else None
    strengths = ([0.0] if lora and before_and_after else []) + [strength if lora else 0.0]
    try:
        images = []
        for s in strengths:
            if lora:
                lora.set_strength(s)
            p = prompt
            images.append(render(model, spec, decode, p.positive, p.negative, p.width, p.height, p.seed, p.steps,
                                 p.frames))
        return images
    finally:
        if lora:
            lora.remove()
        placement.undo("meta" if on_meta else None)

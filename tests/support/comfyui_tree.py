"""Folders laid out as a ComfyUI is (main.py, comfy/, its version file), for the tests of which ComfyUI
the command line finds and whether it can load a model's text encoder. `new=True` adds the few source
lines each family's ugpum/arch/<family>/comfyui.py names (a ComfyUI from 2026: FLUX.2 types, klein's Qwen3
encoders); `new=False` leaves them out, as ComfyUI 0.3.75 (the packaged copy) does. No ComfyUI code is copied: the
one real ComfyUI of this machine, the packaged copy, cannot load klein, and the newest is not on any
package registry, so where a test needs one that can, this stands in for its source text."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def comfyui_tree(root: Path, version: str = "0.33.0", new: bool = True) -> Path:
    (root / "comfy" / "text_encoders").mkdir(parents=True, exist_ok=True)
    (root / "main.py").write_text("")
    (root / "comfyui_version.py").write_text(f'__version__ = "{version}"\n')
    sd = "class CLIPType(Enum):\n    WAN = 13\n"
    flux = "def flux2_te(dtype_llama=None):\n    pass\n" if new else "# FLUX.1 only\n"
    if new:
        sd += "    FLUX2 = 25\n\nclass TEModel(Enum):\n    QWEN3_4B = 16\n    QWEN3_8B = 20\n"
        flux += "\ndef klein_te(dtype_llama=None, model_type='qwen3_4b'):\n    pass\n"
    (root / "comfy" / "sd.py").write_text(sd)
    (root / "comfy" / "text_encoders" / "flux.py").write_text(flux)
    (root / "models").mkdir(exist_ok=True)
    return root


def safetensors_file(path: Path) -> Path:
    """A small whole safetensors file (a header and the bytes it names)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"weight": torch.zeros(4, 4)}, str(path))
    return path

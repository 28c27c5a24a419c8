"""How the verbs reach `comfy_bridge.py`, ComfyUI's model, text-encoder and VAE code outside a running
ComfyUI. It sits beside the `ugpum` package in the pack's folder, which is on `sys.path` when
`python -m ugpum` runs from there; the folder is added otherwise (e.g. `-m ugpum` from elsewhere)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parents[2]


def comfy_bridge():
    if str(PACK_ROOT) not in sys.path:
        sys.path.append(str(PACK_ROOT))
    return importlib.import_module("comfy_bridge")

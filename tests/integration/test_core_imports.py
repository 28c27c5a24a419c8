"""Importing the engine in a fresh interpreter loads no command-line verb (the nodes import the core;
the verbs, which reach ComfyUI through comfy_bridge, stay out of it)."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_importing_the_core_loads_no_verbs():
    import subprocess
    code = ("import sys, ugpum, ugpum.planning.forecast, ugpum.train.loop; "
            "print(sorted(m for m in sys.modules if m.startswith('ugpum.commands')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""A temporary copy of the pack with one more compute mode (one new file) and one more model family (one new
folder), nothing else changed, and that copy imported in place of this checkout's `ugpum` for a while: what
tests/unit/test_extension_points.py and tests/integration/test_extension_training.py show the plan, the nodes
and a training run pick up."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NEW_MODE = "int8sim"
NEW_FAMILY, NEW_FAMILY_TITLE, NEW_MODEL = "toy", "Toy DiT", "tiny-toy"

MODE_FILE = '''"""base_compute = int8sim: int8's quantisation with its matmul computed in fp32, on any device."""
from __future__ import annotations

from .int8 import Int8


class Int8Simulated(Int8):
    name = "int8sim"
    order = 9
    dense_speed = {"compiled": (0.5, 0.5), "eager": (0.4, 0.4)}
    quality = "int8's quantisation, its matmuls in fp32"
    min_capability = None                # any device (so base_compute = auto never takes it)
    needs = ""
    min_rows = 0

    def matmul(self, a, sa, b_t, sb, out_dtype):
        y = (a.float() @ b_t.float().t()) * sa
        return (y if sb is None else y * sb).to(out_dtype)


MODE = Int8Simulated()
'''

FAMILY_INIT = '''"""A third model family: a FLUX.2-shaped DiT of its own name, ids and measured rows, built by ComfyUI's
Flux class."""
from __future__ import annotations

import dataclasses

from ..comfyui import ComfyModel
from ..family import Family, read_calibration
from ..flux2.comfyui import flux_kwargs
from ..flux2.spec import Flux2Spec
from ..flux2.variants import make_spec


class ToySpec(Flux2Spec):
    pass


def spec(id: str) -> ToySpec:
    shaped = make_spec(id, 64, 1, 2, 96, False, True, "Toy-tiny", head_dim=16)
    return ToySpec(**{f.name: getattr(shaped, f.name) for f in dataclasses.fields(shaped)} | {"family": "toy"})


FAMILY = Family(name="toy", title="Toy DiT", marker="toy_in", spec_class=ToySpec, ids=("tiny-toy",), spec=spec,
                recognise=lambda shapes, filename: None,
                comfy=ComfyModel(module="comfy.ldm.flux.model", model_class="Flux", kwargs=flux_kwargs,
                                 latent_format="Flux2", clip_type="FLUX2", text_encoders={}),
                calibration=read_calibration(__file__))
'''

ADDED = {f"ugpum/compute/modes/{NEW_MODE}.py": MODE_FILE,
         f"ugpum/arch/{NEW_FAMILY}/__init__.py": FAMILY_INIT,
         f"ugpum/arch/{NEW_FAMILY}/calibration.json": None}       # (FLUX.2's rows: the same blocks)


def extended_copy(root: Path) -> Path:
    """The pack (its core, nodes, scripts and ComfyUI bridge) copied to `root`, plus the files of `ADDED`."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("ugpum", "nodes", "scripts"):
        shutil.copytree(REPO / folder, root / folder, ignore=ignore)
    for name in ("comfy_bridge.py", "__init__.py"):
        shutil.copy2(REPO / name, root / name)
    for rel, text in ADDED.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            rows = json.loads((REPO / "ugpum" / "arch" / "flux2" / "calibration.json").read_text())
            text = json.dumps(rows, indent=1) + "\n"
        (root / rel).write_text(text)
    return root


def differences(root: Path) -> tuple[set[str], set[str]]:
    """(files only in the copy, files of this checkout that the copy holds otherwise or lacks)."""
    def files(base: Path) -> dict[str, bytes]:
        found = [p for folder in ("ugpum", "nodes", "scripts") for p in (base / folder).rglob("*") if p.is_file()
                 and "__pycache__" not in p.parts] + [base / "comfy_bridge.py", base / "__init__.py"]
        return {str(p.relative_to(base)): p.read_bytes() for p in found}
    mine, copy = files(REPO), files(root)
    return set(copy) - set(mine), {name for name, data in mine.items() if copy.get(name) != data}


def _ours(name: str) -> bool:
    return name in ("ugpum", "comfy_bridge", "ugpum_copy_nodes") or name.startswith(("ugpum.", "ugpum_copy_nodes."))


@contextlib.contextmanager
def imported_from(root: Path):
    """`ugpum` and `comfy_bridge` imported from `root` for the block (ComfyUI stays as imported); this
    checkout's modules are put back after."""
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if _ours(name)}
    sys.path.insert(0, str(root))
    try:
        importlib.invalidate_caches()
        yield
    finally:
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]
        sys.path.remove(str(root))
        sys.modules.update(saved)


def copy_nodes(root: Path):
    """The copy's nodes/ package (within `imported_from(root)`; ComfyUI's nodes.py owns the name `nodes`)."""
    spec = importlib.util.spec_from_file_location("ugpum_copy_nodes", root / "nodes" / "__init__.py",
                                                  submodule_search_locations=[str(root / "nodes")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["ugpum_copy_nodes"] = module
    spec.loader.exec_module(module)
    return module

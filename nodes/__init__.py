"""The four UGPUM nodes (DESIGN §2): thin ComfyUI V3 nodes over the `ugpum` core.

ComfyUI imports this repository as a package named after its folder path, so the core is made
importable as the top-level package `ugpum` (it uses absolute imports): the repository root is
appended to sys.path, after ComfyUI's own paths, unless `ugpum` already resolves to this copy.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def _make_core_importable() -> None:
    spec = importlib.util.find_spec("ugpum")
    if spec is None:
        sys.path.append(str(_ROOT))
        spec = importlib.util.find_spec("ugpum")
    found = Path(spec.origin).resolve().parent if spec and spec.origin else None
    if found != _ROOT / "ugpum":
        raise ImportError(f"UGPUM: the package 'ugpum' resolves to {found}, not to {_ROOT / 'ugpum'}; "
                          "remove the other copy from the Python path")


_make_core_importable()

from comfy_api.latest import ComfyExtension, io  # noqa: E402

from .loader import UGPUMLoader  # noqa: E402
from .planner import PartitionPlanner  # noqa: E402
from .sample_preview import SamplePreview  # noqa: E402
from .trainer import LoRATrainer  # noqa: E402

NODES: list[type[io.ComfyNode]] = [UGPUMLoader, PartitionPlanner, LoRATrainer, SamplePreview]


class UGPUMExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)

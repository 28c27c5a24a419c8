"""The pack's nodes/ package imported in-process (tests that call a node's `execute` directly)."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

PACK = Path(__file__).resolve().parents[2]


def pack_nodes():
    """The pack's nodes/ package under a name of its own (ComfyUI's nodes.py owns the name `nodes`)."""
    if "ugpum_pack_nodes" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ugpum_pack_nodes", PACK / "nodes" / "__init__.py",
                                                      submodule_search_locations=[str(PACK / "nodes")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["ugpum_pack_nodes"] = module
        spec.loader.exec_module(module)
    return (importlib.import_module("ugpum_pack_nodes.planner"), importlib.import_module("ugpum_pack_nodes.types"))

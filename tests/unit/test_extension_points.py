"""Issue 37, done when: in a temporary copy of the pack, one new file adds a compute mode and one new folder
adds a model family, no other file edited (tests/support/extension_copy.py), and `ugpum plan` and the node
definitions pick each up (a training run on them: tests/integration/test_extension_training.py); no code
outside their folders compares with a mode's or a family's name, the new ones included."""
from __future__ import annotations

import json

import pytest

from support.extension_copy import (ADDED, NEW_FAMILY, NEW_FAMILY_TITLE, NEW_MODE, NEW_MODEL, copy_nodes,
                                    differences, extended_copy, imported_from)
from support.name_branches import name_branches


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return extended_copy(tmp_path_factory.mktemp("pack"))


def test_the_copy_differs_by_the_new_file_and_folder_alone(pack):
    added, changed = differences(pack)
    assert added == set(ADDED) and changed == set()


def test_the_registries_find_them_and_no_code_outside_their_folders_names_them(pack):
    with imported_from(pack):
        from ugpum.arch import FAMILIES, get_spec
        from ugpum.compute.modes import NAMES, SETTINGS
        families, modes = {f.name for f in FAMILIES}, set(NAMES)
        assert get_spec(NEW_MODEL).family == NEW_FAMILY and NEW_MODE in SETTINGS
    assert {NEW_FAMILY, "flux2", "wan"} <= families and {NEW_MODE, "bf16", "fp8", "int8"} <= modes
    assert name_branches(pack, families, modes) == []


def test_plan_takes_the_new_mode_and_plans_the_new_family(pack, capsys):
    with imported_from(pack):
        from ugpum.commands import main

        def plan(*args: str) -> dict:
            assert main(["plan", *args, "--gpu", "rtx4090", "--recompute", "all", "--json"]) == 0, capsys.readouterr()
            return json.loads(capsys.readouterr().out)
        int8 = plan("--profile", "klein-9b-1024", "--base-compute", "int8")
        new = plan("--profile", "klein-9b-1024", "--base-compute", NEW_MODE)
        toy = plan("--model", NEW_MODEL, "--base-compute", NEW_MODE)
    # the same bytes (both hold 1 byte a weight), the new mode's dense matmuls at 0.5 of bf16's speed, int8's at 0.88
    assert new["base_compute"] == NEW_MODE and new["stages"][0]["detail_gib"] == int8["stages"][0]["detail_gib"]
    assert new["predicted_step_s"] > int8["predicted_step_s"]
    assert toy["model"] == NEW_MODEL and toy["workload"]["base_compute"] == NEW_MODE and len(toy["block_paths"]) == 3


def test_the_node_definitions_offer_them(pack, comfy):
    with imported_from(pack):
        from ugpum.arch import get_spec
        nodes = copy_nodes(pack)
        schemas = {node.__name__: node.define_schema() for node in nodes.NODES}
        inputs = {name: {i.id: i for i in schema.inputs} for name, schema in schemas.items()}
        spec = get_spec(NEW_MODEL)
        model = nodes.types.UGPUMModel(family=spec.family, model_id=spec.id, title=spec.title, path="/none.safetensors",
                                       file_name="none.safetensors", key_prefix="", stored_dtype="fp32",
                                       weight_dtype="fp32", devices=("rtx4090",), spec=spec)
        planned = nodes.PartitionPlanner.execute(model, resolution=64, batch=1, grad_accum=1, rank=4,
                                                 recompute="auto", base_compute=NEW_MODE).result[0]
    assert NEW_MODE in inputs["PartitionPlanner"]["base_compute"].options
    assert NEW_FAMILY_TITLE in schemas["UGPUMLoader"].description
    assert f"type flux2 for {NEW_FAMILY_TITLE}" in inputs["LoRATrainer"]["clip"].tooltip
    assert planned.plan.model == NEW_MODEL and planned.plan.base_compute == NEW_MODE

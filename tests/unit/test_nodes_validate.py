"""The nodes check what they can before ComfyUI runs the graph (issue 37 item 5): the LoRA Trainer its
dataset and save name, the Loader its model file (`validate_inputs`, which ComfyUI calls on queueing and
shows as the node's error: tests/server/test_node_inputs.py), and the Loader tells ComfyUI when its file
changed under the same name (`fingerprint_inputs`), so the nodes after it run again. Real ComfyUI, real
safetensors files."""
from __future__ import annotations

import importlib

import pytest
import torch
from safetensors.torch import save_file

from support.pack_nodes import pack_nodes


@pytest.fixture
def nodes(comfy):
    pack_nodes()
    return importlib.import_module("ugpum_pack_nodes.loader"), importlib.import_module("ugpum_pack_nodes.trainer")


@pytest.fixture
def diffusion_models(comfy, tmp_path, monkeypatch):
    """A diffusion_models folder of this test's own, as ComfyUI's folder_paths lists it."""
    import folder_paths
    folder = tmp_path / "diffusion_models"
    folder.mkdir()
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "diffusion_models", ([str(folder)], {".safetensors"}))
    return folder


def tiny_model_file(path, seed: int):
    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    model = build_random(get_spec("tiny-flux2"), torch.float32, seed)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def test_comfyui_calls_what_the_nodes_define(nodes):
    from comfy_api.internal import first_real_override
    loader, trainer = nodes
    assert first_real_override(trainer.LoRATrainer, "validate_inputs") is not None
    assert first_real_override(loader.UGPUMLoader, "validate_inputs") is not None
    assert first_real_override(loader.UGPUMLoader, "fingerprint_inputs") is not None


def test_the_trainer_refuses_a_save_name_and_a_dataset_before_anything_runs(nodes, tmp_path, monkeypatch):
    import folder_paths
    _, trainer = nodes
    monkeypatch.setattr(folder_paths, "input_directory", str(tmp_path))
    check = trainer.LoRATrainer.validate_inputs
    assert check(dataset="demo/loranne", save_name="loranne_klein9b") is True
    said = check(dataset="demo/loranne", save_name="runs/mine")
    assert said.startswith("LoRA Trainer: save name 'runs/mine' holds a folder separator")
    assert "not there any more" in check(dataset="input/gone", save_name="mine")
    assert "unknown dataset 'elsewhere/x'" in check(dataset="elsewhere/x", save_name="mine")


def test_the_loader_checks_its_file_and_sees_a_file_replaced_under_its_name(nodes, diffusion_models):
    loader, _ = nodes
    node = loader.UGPUMLoader
    tiny_model_file(diffusion_models / "tiny.safetensors", seed=0)
    save_file({"weight": torch.zeros(4, 4)}, str(diffusion_models / "other.safetensors"))
    assert node.validate_inputs(dit_name="tiny.safetensors") is True
    assert "not a diffusion model UGPUM can train" in node.validate_inputs(dit_name="other.safetensors")
    assert "not in models/diffusion_models any more" in node.validate_inputs(dit_name="gone.safetensors")
    before = node.fingerprint_inputs(dit_name="tiny.safetensors", weight_dtype="as stored", devices="cpu")
    assert before == node.fingerprint_inputs(dit_name="tiny.safetensors", weight_dtype="bf16", devices="auto")
    tiny_model_file(diffusion_models / "tiny.safetensors", seed=1)        # other weights, the same name and header
    assert node.fingerprint_inputs(dit_name="tiny.safetensors", weight_dtype="as stored", devices="cpu") != before

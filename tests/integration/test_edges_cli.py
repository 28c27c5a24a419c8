"""Issue 26 through the real command line (`python -m ugpum train` in child processes, tiny FLUX.2 on the
CPU): two runs into one folder, SIGTERM before the first step, damaged checkpoints at resume, another
base model's weights, non-finite weights and losses, a disk that fills at the cache or has room only for
the LoRA, bad names, unusable folders. Each ends in one sentence, a non-zero exit, no traceback, and
nothing lost."""
from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfy_bridge import find_comfyui
from support.cli_run import REPO, Run, one_sentence, train

pytestmark = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")
DATASET = REPO / "demo_datasets" / "loranne"
BASE = ["--profile", "tiny-flux2", "--dataset", str(DATASET), "--devices", "cpu", "--sample-every", "0"]
LOCK = ".ugpum_run.lock"


def steps_logged(out: Path) -> list[int]:
    metrics = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.is_file() else []


def test_two_runs_into_one_folder_one_runs_the_other_is_refused_and_a_killed_runs_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    first = Run(*BASE, "--steps", "40", "--out", str(out))
    first.wait_until(lambda: (out / LOCK).is_file(), what="the run folder locked")
    second = Run(*BASE, "--steps", "40", "--out", str(out))                  # while the first reads and caches
    rc, text = second.finish()
    assert rc == 2 and f"{out} is in use by another run (process {first.proc.pid} on " in text, text
    one_sentence(text)
    first.wait_until(lambda: len(steps_logged(out)) >= 1, what="a step")
    first.proc.kill()                                              # SIGKILL: no chance to let go of anything
    first.finish()
    assert (out / LOCK).is_file()
    rc, text = train(*BASE, "--steps", "2", "--out", str(out), "--overwrite")
    assert rc == 0 and "took over the lock a run that ended without releasing it left in" in text, text
    assert steps_logged(out) == [1, 2] and not (out / LOCK).exists()         # one run's metrics, lock gone


def test_sigterm_before_the_first_step_says_what_is_kept_and_the_same_command_goes_on(tmp_path):
    out = tmp_path / "run"
    run = Run(*BASE, "--steps", "1", "--out", str(out))
    run.wait_until(lambda: (out / LOCK).is_file(), what="the run folder locked")   # reading data, caching
    run.proc.send_signal(signal.SIGTERM)
    rc, text = run.finish()
    assert rc == 143 and "stopped by SIGTERM" in text, text
    assert "stopped before the first step: nothing was trained; the features cached so far are kept" in text
    one_sentence(text)
    assert steps_logged(out) == [] and not (out / LOCK).exists()
    rc, text = train(*BASE, "--steps", "1", "--out", str(out))
    assert rc == 0, text


def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_one_saying_so(tmp_path):
    out, config = tmp_path / "run", tmp_path / "every.toml"
    config.write_text("save_every = 1\n")
    assert train(*BASE, "--config", str(config), "--steps", "3", "--out", str(out))[0] == 0
    lora3 = out / "checkpoints" / "step_000003" / "lora.safetensors"
    lora3.write_bytes(lora3.read_bytes()[:1000])                           # cut short
    (out / "checkpoints" / "step_000002" / "optimizer.safetensors").write_bytes(b"")   # emptied
    killed = subprocess.Popen(["true"])
    killed.wait()
    leftover = out / "cache" / "latents" / f".x.safetensors.{killed.pid}-0123456789ab.tmp"   # a killed cache write
    leftover.write_bytes(b"half")
    rc, text = train(*BASE, "--config", str(config), "--steps", "4", "--resume", str(out))
    assert rc == 0, text
    assert ("checkpoints step_000003 cannot be used (lora.safetensors is cut short or damaged); step_000002 cannot "
            "be used (optimizer.safetensors is empty): continuing from the newest intact one, step_000001, "
            "instead") in text and "at step 1" in text, text
    assert steps_logged(out) == [1, 2, 3, 4] and not leftover.exists()
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "ugpum_lora.safetensors")).values())


@pytest.fixture
def tiny_model_file(tmp_path, comfy):
    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    state = {k: v.contiguous() for k, v in build_random(get_spec("tiny-flux2"), torch.float32).state_dict().items()}
    path = tmp_path / "tiny.safetensors"
    save_file(state, str(path))
    return path, state


def test_another_base_or_non_finite_numbers_are_refused_by_name_and_nothing_non_finite_is_written(
        tmp_path, tiny_model_file):
    path, state = tiny_model_file
    out = tmp_path / "run"
    assert train(*BASE, "--steps", "1", "--model", str(path), "--out", str(out))[0] == 0
    other = tmp_path / "other.safetensors"                               # the same header, other weights
    save_file({k: v * 1.5 if v.is_floating_point() else v for k, v in state.items()}, str(other))
    rc, text = train(*BASE, "--steps", "2", "--model", str(other), "--resume", str(out))
    assert rc == 2 and "cannot resume" in text and "base weights (" in text, text
    one_sentence(text)

    name = next(k for k in state if k.endswith(".weight") and state[k].dim() == 2 and "double_blocks" in k)
    nan = tmp_path / "nan.safetensors"
    save_file({**state, name: state[name].clone().index_fill_(0, torch.tensor([0]), float("nan"))}, str(nan))
    rc, text = train(*BASE, "--steps", "1", "--model", str(nan), "--out", str(tmp_path / "nan_run"))
    assert rc == 2 and f"tensor {name} holds NaN or infinite values" in text, text
    one_sentence(text)
    assert not list((tmp_path / "nan_run").glob("*.safetensors")) and not (tmp_path / "nan_run" / "checkpoints").exists()

    huge = tmp_path / "huge.safetensors"                                 # finite weights, an overflowing output
    save_file({k: v * 1e30 if k.startswith("final_layer") and v.is_floating_point() else v for k, v in state.items()},
              str(huge))
    rc, text = train(*BASE, "--steps", "3", "--model", str(huge), "--out", str(tmp_path / "huge_run"))
    assert rc == 2 and "step 1: the loss is" in text and "so the run stopped before applying it" in text, text
    one_sentence(text)
    assert not list((tmp_path / "huge_run").glob("*.safetensors")) and not (tmp_path / "huge_run" / "checkpoints").exists()


@pytest.fixture
def small_disk(tmpfs):
    """A real filesystem of 4 MiB (tests/conftest.py: tmpfs)."""
    return tmpfs("4m")


def fill(disk: Path, leave: int) -> None:
    """Fill the filesystem until `leave` bytes are free."""
    import shutil
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(free - leave, 0))


def test_a_disk_with_room_for_the_lora_only_keeps_the_lora_and_says_so(tmp_path, small_disk):
    out, config = small_disk / "run", tmp_path / "cache.toml"
    config.write_text(f'cache_dir = "{tmp_path / "cache"}"\n')
    fill(small_disk, 300 * 1024)                  # the LoRA (122 KiB) fits, the checkpoint (about 3x) does not
    rc, text = train(*BASE, "--config", str(config), "--steps", "2", "--out", str(out))
    assert rc == 2, text
    assert "for the checkpoint at step 2: it needs about" in text and "bytes are free" in text, text
    assert "kept: the LoRA of step 2 (ugpum_lora.safetensors); no checkpoint of this run is on disk" in text, text
    one_sentence(text)
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "ugpum_lora.safetensors")).values())
    assert not [p for p in (out / "checkpoints").iterdir()] if (out / "checkpoints").exists() else True


def test_a_disk_that_fills_while_caching_is_one_sentence_and_leaves_nothing_half_written(small_disk):
    out = small_disk / "run"
    fill(small_disk, 8 * 1024)
    rc, text = train(*BASE, "--steps", "2", "--out", str(out))
    assert rc == 2 and "no space left on the disk holding" in text and "the features cached so far are kept" in text
    one_sentence(text)
    assert not list(out.rglob("*.tmp")) and not (out / "metrics.jsonl").exists()


def test_bad_names_and_unusable_folders_are_refused_before_any_work(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('output_name = "a\\u0000b"\nlearning_rate = 1e-3\n')
    rc, text = train(*BASE, "--config", str(config), "--out", str(tmp_path / "run"))
    assert rc == 2 and "learning_rate (did you mean lr?)" in text, text
    config.write_text('output_name = "a\\u0000b"\n')
    rc, text = train(*BASE, "--config", str(config), "--out", str(tmp_path / "run"))
    assert rc == 2 and "setting 'output_name' = 'a\\x00b': holds a control character" in text, text
    config.write_text(f'cache_dir = "{config}/cache"\n')                 # a file in the way
    rc, text = train(*BASE, "--config", str(config), "--out", str(tmp_path / "run"))
    assert rc == 2 and f"cache_dir {config}/cache: {config} is a file" in text, text
    rc, text = train(*BASE, "--out", str(tmp_path / ("n" * 300)))
    assert rc == 2 and "is longer than the 255 bytes a file name may take" in text, text
    one_sentence(text)
    assert not (tmp_path / "run").exists()


def test_an_unwritable_home_is_one_sentence_with_the_fix(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(home)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        rc, text = train(*BASE, "--steps", "1", "--out", str(tmp_path / "run"),
                         env={"HOME": str(home), "XDG_CACHE_HOME": "", "COMFYUI_PATH": ""})
    finally:
        subprocess.run(["umount", "-l", str(home)], capture_output=True)
    assert rc == 2 and f"cannot copy ComfyUI into {home}/.cache/ugpum (Read-only file system); set " \
        "XDG_CACHE_HOME to a folder you can write in, or COMFYUI_PATH to a ComfyUI checkout" in text, text
    one_sentence(text)

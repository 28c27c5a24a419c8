"""Runs survive anything, and a resume continues only the same run (issue 15), through the real
command line in a child process: real SIGINT and SIGTERM at chosen moments, a second SIGINT during
the save, a real full filesystem (a small tmpfs, where this machine lets the test mount one). Each
way of stopping ends with one sentence, loses no completed step, and resumes to a LoRA bitwise equal
to an uninterrupted run's."""
from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from comfy_bridge import find_comfyui
from support.cli_run import Run, train

pytestmark = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")
REPO = Path(__file__).resolve().parents[2]
DATASET = REPO / "demo_datasets" / "loranne"
STEPS = 12
BASE = ["--profile", "tiny-flux2", "--dataset", str(DATASET), "--devices", "cpu", "--sample-every", "0"]


def lora(out: Path, name: str = "ugpum_lora.safetensors") -> dict:
    return load_file(str(out / name))


def assert_same_lora(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), "the resumed LoRA differs"


def assert_one_sentence_no_traceback(text: str) -> None:
    assert "Traceback" not in text, text


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("reference")
    rc, text = train(*BASE, "--steps", str(STEPS), "--out", str(out))
    assert rc == 0, text
    return lora(out)


def resume_and_compare(out: Path, reference: dict, alone: bool = False) -> str:
    """Resume (with the run's flags, or `alone`: `--resume DIR` and nothing else) to a LoRA equal to the
    uninterrupted run's."""
    rc, text = train("--resume", str(out)) if alone else train(*BASE, "--steps", str(STEPS), "--resume", str(out))
    assert rc == 0, text
    assert_same_lora(lora(out), reference)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))                 # every step once, in order
    return text


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_training_keeps_every_step_and_resumes_exactly(tmp_path, reference, signum):
    out = tmp_path / "run"
    run = Run(*BASE, "--steps", str(STEPS), "--out", str(out))
    run.wait_for_metrics(out, 4)
    run.proc.send_signal(signum)
    rc, text = run.finish()
    assert rc == 128 + signum, text
    assert f"stopped by {signal.Signals(signum).name}" in text and "saved in" in text
    assert_one_sentence_no_traceback(text)
    done = len((out / "metrics.jsonl").read_text().splitlines())
    assert (out / "checkpoints" / f"step_{done:06d}").is_dir()            # the last completed step is kept
    assert (out / f"ugpum_lora_step{done}.safetensors").is_file()
    resume_and_compare(out, reference, alone=signum == signal.SIGTERM)     # as the stop line says, for SIGTERM


def test_ctrl_c_after_the_last_step_loses_nothing(tmp_path, reference):
    """Default settings (no periodic checkpoint falls due in a short run): Ctrl-C while validating
    after step N of N; the final LoRA and its checkpoint are already on disk."""
    out = tmp_path / "run"
    run = Run(*BASE, "--steps", str(STEPS), "--out", str(out))
    run.wait_for(f"saving checkpoint and LoRA at step {STEPS}")
    run.proc.send_signal(signal.SIGINT)
    rc, text = run.finish()
    assert rc in (0, 130), text                       # it may have finished before the signal landed
    assert_one_sentence_no_traceback(text)
    assert_same_lora(lora(out), reference)
    assert (out / "checkpoints" / f"step_{STEPS:06d}").is_dir()
    rc, text = train(*BASE, "--steps", str(STEPS), "--resume", str(out))    # a finished run: nothing to train
    assert rc == 0 and "nothing is left to train" in text and f"--steps {2 * STEPS}" in text, text
    assert_one_sentence_no_traceback(text)
    assert_same_lora(lora(out), reference)                                  # and nothing was redone or rewritten


def test_a_second_ctrl_c_during_the_save_cannot_cut_it(tmp_path, reference):
    out = tmp_path / "run"
    config = tmp_path / "every2.toml"
    config.write_text('save_every = 2\n')
    run = Run(*BASE, "--config", str(config), "--steps", str(STEPS), "--out", str(out))
    run.wait_for("saving checkpoint and LoRA at step 4")
    run.proc.send_signal(signal.SIGINT)
    time.sleep(0.01)
    run.proc.send_signal(signal.SIGINT)
    rc, text = run.finish()
    assert rc == 130, text
    assert_one_sentence_no_traceback(text)
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert not [c for c in checkpoints if c.startswith(".tmp")], checkpoints      # no half-written save
    rc, text = train(*BASE, "--config", str(config), "--steps", str(STEPS), "--resume", str(out))
    assert rc == 0, text
    assert_same_lora(lora(out), reference)


def test_resume_finds_the_newest_complete_checkpoint_without_its_pointer(tmp_path, reference):
    out = tmp_path / "run"
    run = Run(*BASE, "--steps", str(STEPS), "--out", str(out))
    run.wait_for_metrics(out, 5)
    run.proc.send_signal(signal.SIGINT)
    assert run.finish()[0] == 130
    (out / "checkpoints" / "latest.json").write_text("{not json")             # corrupt pointer
    leftover = out / "checkpoints" / ".tmp_step_000099"                       # an interrupted save's remains
    leftover.mkdir()
    (leftover / "lora.safetensors").write_bytes(b"half")
    stray = out / ".ugpum_lora.safetensors.0123456789ab.tmp"
    stray.write_bytes(b"half")
    text = resume_and_compare(out, reference)
    assert not leftover.exists() and not stray.exists() and "removed 2 temporary file(s)" in text


def test_a_new_run_never_overwrites_an_earlier_one(tmp_path):
    out = tmp_path / "run"
    assert train(*BASE, "--steps", "2", "--out", str(out))[0] == 0
    before = (out / "ugpum_lora.safetensors").read_bytes()
    rc, text = train(*BASE, "--steps", "3", "--out", str(out))
    assert rc == 2 and f"{out} holds an earlier run" in text and "--resume" in text and "--overwrite" in text
    assert_one_sentence_no_traceback(text)
    assert (out / "ugpum_lora.safetensors").read_bytes() == before
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    rc, text = train(*BASE, "--steps", "3", "--resume", str(out), "--out", str(tmp_path / "elsewhere"))
    assert rc == 2 and "drop --out" in text
    rc, text = train(*BASE, "--steps", "3", "--out", str(out), "--overwrite")
    assert rc == 0, text
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("change, named", [
    (["--grad-accum", "2"], "grad_accum (1 in the checkpoint, 2 now)"),
    (["--batch", "2"], "batch (1 in the checkpoint, 2 now)"),
    (["--dataset", "DATASET2"], "dataset (its images, clips or captions changed)"),
])
def test_resume_refuses_another_run(tmp_path, change, named):
    out = tmp_path / "run"
    assert train(*BASE, "--steps", "2", "--out", str(out))[0] == 0
    if "DATASET2" in change:
        other = tmp_path / "data"
        shutil.copytree(DATASET, other)
        caption = next(other.glob("*.txt"))
        caption.write_text(caption.read_text() + ", edited")
        change = ["--dataset", str(other)]
    args = [*BASE, "--steps", "4", "--resume", str(out)]
    for i in range(0, len(change), 2):
        if change[i] in args:
            args[args.index(change[i]) + 1] = change[i + 1]
        else:
            args += change[i:i + 2]
    rc, text = train(*args)
    assert rc == 2 and "cannot resume" in text and named in text, text
    assert_one_sentence_no_traceback(text)


def test_resume_refuses_state_that_disagrees_and_allows_more_steps(tmp_path):
    out = tmp_path / "run"
    assert train(*BASE, "--steps", "3", "--out", str(out))[0] == 0
    rc, text = train(*BASE, "--steps", "2", "--resume", str(out))                 # fewer steps than trained
    assert rc == 2 and "checkpoint is at step 3, outside this run's 1..2" in text
    metrics = out / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text(good.replace('"step": 2', '"step": 7'))                   # edited: steps out of order
    rc, text = train(*BASE, "--steps", "5", "--resume", str(out))
    assert rc == 2 and "metrics.jsonl is not as UGPUM writes it (its line 3 is not a record" in text, text
    metrics.write_text(good)
    rc, text = train(*BASE, "--steps", "5", "--resume", str(out))                 # more steps: allowed
    assert rc == 0 and "at step 3" in text, text
    assert len(metrics.read_text().splitlines()) == 5


def test_a_model_file_of_another_family_is_refused_by_name(tmp_path, comfy):
    import torch
    from safetensors.torch import save_file

    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    wan = tmp_path / "tiny-wan.safetensors"
    save_file({k: v.contiguous() for k, v in build_random(get_spec("tiny-wan"), torch.float32).state_dict().items()},
              str(wan))
    rc, text = train(*BASE, "--steps", "1", "--model", str(wan), "--out", str(tmp_path / "run"))
    assert rc == 2 and "holds tiny-wan, but profile tiny-flux2 trains tiny-flux2" in text, text
    assert not (tmp_path / "run").exists()


@pytest.fixture
def small_disk(tmpfs):
    """A real filesystem of 4 MiB (tests/conftest.py: tmpfs)."""
    return tmpfs("4m")


def test_a_full_disk_ends_with_a_sentence_and_keeps_the_last_checkpoint(tmp_path, small_disk, reference):
    out = small_disk / "run"
    config = tmp_path / "every2.toml"
    config.write_text(f'save_every = 2\ncache_dir = "{tmp_path / "cache"}"\n')
    run = Run(*BASE, "--config", str(config), "--steps", str(STEPS), "--out", str(out))
    run.wait_for("saving checkpoint and LoRA at step 2")
    while not (out / "checkpoints" / "latest.json").is_file():
        time.sleep(0.01)
    filler = small_disk / "filler"
    with open(filler, "wb") as f:                         # the disk fills up while the run goes on
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    rc, text = run.finish()
    assert rc == 2, text
    assert "no space left on the disk" in text and "are free" in text and "needs about" in text
    assert re.search(r"kept: the checkpoint step_0000\d\d, which --resume \S+ continues from", text), text
    assert "Errno" not in text and "0 MiB" not in text
    assert_one_sentence_no_traceback(text)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept and not any(p.name.startswith(".tmp") for p in (out / "checkpoints").iterdir())
    filler.unlink()
    rc, text = train(*BASE, "--config", str(config), "--steps", str(STEPS), "--resume", str(out))
    assert rc == 0, text
    assert_same_lora(lora(out), reference)

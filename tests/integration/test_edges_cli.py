"""Issue 26 through the real command line (`python -m ugpum train` in child processes, tiny FLUX.2 on the
CPU): two runs into one folder, SIGTERM before the first step, damaged checkpoints at resume, another
base model's weights, non-finite weights and losses, a disk that fills at the cache or has room only for
the LoRA, bad names, unusable folders. Issue 32: 16-bit pictures, UTF-16 captions, unreadable files
(as a process without root's right to read everything), dangling and too long --out, a read-only
--models, a sample in the way, stops just after a save and while importing, a writer killed during the
final save, optimizer states of another rank, checkpoints holding NaN, metrics missing, cut or edited,
one rule for names. Each ends in one sentence, the right exit code, no traceback, and nothing lost."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfy_bridge import find_comfyui
from support.cli_run import REPO, Run, one_sentence, train
from support.pictures import picture_sets
from ugpum.train.run.checkpoint import latest_checkpoint

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


# ---------------------------------------------------------------- issue 32

TINY = ["--profile", "tiny-flux2", "--devices", "cpu", "--sample-every", "0"]


def test_a_16_bit_picture_and_its_8_bit_twin_train_on_the_same_latents_and_utf16_captions_on_their_text(tmp_path):
    deep, twin = picture_sets(tmp_path)
    runs = {}
    for data in (deep, twin):
        rc, text = train(*TINY, "--dataset", str(data), "--steps", "1", "--out", str(tmp_path / f"run_{data.name}"))
        assert rc == 0, text
        runs[data.name] = text
    assert (f"note: {deep}: skipped 1 picture(s) of a kind UGPUM does not read (layers.psd); to train on them, "
            "convert them to PNG or JPEG") in runs["deep"]
    def latents(name: str) -> dict[tuple, torch.Tensor]:       # by shape: a landscape and a portrait picture
        tensors = [load_file(str(p))["value"] for p in (tmp_path / f"run_{name}" / "cache" / "latents").iterdir()]
        return {tuple(t.shape): t for t in tensors}
    cached = {name: latents(name) for name in runs}
    assert len(cached["deep"]) == 2 and cached["deep"].keys() == cached["twin"].keys()
    for shape, a in cached["deep"].items():
        b = cached["twin"][shape]
        assert torch.allclose(a, b, rtol=2**-8, atol=2**-8 * float(b.abs().max())), \
            float((a - b).abs().max())                      # equal within bf16 rounding (here: equal)
    text_keys = {name: sorted(p.name for p in (tmp_path / f"run_{name}" / "cache" / "text").iterdir()) for name in runs}
    assert text_keys["deep"] == text_keys["twin"]           # the same caption texts, whatever their encoding


SETPRIV = ("setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search")


def without_root_reads() -> tuple[str, ...]:
    """A command prefix that drops root's right to read and search any file whatever its mode (tests run as
    root here, whom chmod 000 does not stop): the child then meets permissions as any user does."""
    import shutil
    if shutil.which("setpriv") is None or subprocess.run([*SETPRIV, "true"]).returncode != 0:
        pytest.skip("setpriv cannot drop capabilities here")
    return SETPRIV


@pytest.mark.parametrize("unreadable, said", [
    ("0.txt", "cannot read caption file {path}: this user may not read it (permission denied); make it readable for "
              "the user running UGPUM (chmod a+r {path}), or remove it"),
    (".", "cannot read dataset folder {path}: this user may not read it (permission denied); make it readable for "
          "the user running UGPUM (chmod a+rx {path}), or remove it"),
    ("1.png", "cannot read image {path}: this user may not read it (permission denied); make it readable for the user "
              "running UGPUM (chmod a+r {path}), or remove it"),
], ids=["caption", "folder", "image"])
def test_an_unreadable_caption_folder_or_image_is_one_sentence(tmp_path, unreadable, said):
    prefix = without_root_reads()
    data = picture_sets(tmp_path)[1]
    path = (data / unreadable).resolve()
    path.chmod(0)
    try:
        rc, text = Run(*TINY, "--dataset", str(data), "--steps", "1", "--out", str(tmp_path / "run"),
                       prefix=prefix).finish()
    finally:
        path.chmod(0o755)
    assert rc == 2 and said.format(path=path if unreadable != "." else data) in text, text
    one_sentence(text)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_out_that_is_a_dangling_symlink_or_longer_than_the_system_takes_is_refused_before_any_work(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    for out in (link, link / "run"):
        rc, text = train(*BASE, "--steps", "1", "--out", str(out))
        assert rc == 2 and text.strip() == (f"error: --out {out}: {link} is a symlink to {tmp_path}/gone, which does "
                                            "not exist; make that folder, or give --out another folder"), text
    deep = tmp_path.joinpath(*["d" * 200] * 20)
    rc, text = train(*BASE, "--steps", "1", "--out", str(deep))
    assert rc == 2 and "bytes this system takes for a path; give --out a shorter path" in text and len(text) < 600, text
    one_sentence(text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


def test_download_into_a_read_only_models_folder_is_one_sentence_before_any_advice_into_it(tmp_path, monkeypatch,
                                                                                         tmpfs):
    from support.cli_run import main_here
    from support.comfyui_tree import comfyui_tree
    from ugpum.commands.download import planned_files
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("COMFYUI_PATH", str(comfyui_tree(tmp_path / "ComfyUI")))    # one that loads klein's encoder
    models = tmpfs("1m")
    files = [f["path"] for f in planned_files("klein-4b-1024")["files"]]
    for name in files[1:]:                                  # all but the diffusion model are there
        (models / name).parent.mkdir(parents=True, exist_ok=True)
        (models / name).write_bytes(b"x")
    assert subprocess.run(["mount", "-o", "remount,ro", str(models)]).returncode == 0
    done = main_here("download", "klein-4b-1024", "--models", str(models))
    assert done.returncode == 2 and done.stderr.strip() == (
        f"error: --models {models}: {models}/diffusion_models is on a read-only filesystem, so {files[0]} cannot be "
        "put there; give "
        "--models a ComfyUI models folder you can write in, or make this one writable"), done.stderr
    assert subprocess.run(["mount", "-o", "remount,rw", str(models)]).returncode == 0
    (models / files[0]).parent.mkdir(parents=True, exist_ok=True)
    (models / files[0]).write_bytes(b"x")
    assert subprocess.run(["mount", "-o", "remount,ro", str(models)]).returncode == 0
    done = main_here("download", "klein-4b-1024", "--models", str(models))   # nothing to write: read-only is fine
    assert done.returncode == 0 and f"all {len(files)} files are in {models}" in done.stdout, done.stderr


def test_a_sample_that_cannot_be_written_is_said_and_the_run_trains_on(tmp_path):
    out, config = tmp_path / "run", tmp_path / "every.toml"
    config.write_text("save_every = 1\n")
    common = ["--profile", "tiny-flux2", "--dataset", str(DATASET), "--devices", "cpu", "--config", str(config),
              "--sample-every", "1"]
    assert train(*common, "--steps", "1", "--out", str(out))[0] == 0
    (out / "samples" / "step_00002.png").mkdir()              # something in the way of the next sample
    rc, text = train(*common, "--steps", "3", "--resume", str(out))
    assert rc == 0, text
    assert (f"samples: the sample of step 2 failed (cannot write {out}/samples/step_00002.png: is a directory); the "
            "run trains on without samples (nothing trained is lost): move what is in the way in "
            f"{out}/samples, or make it writable, for samples in later runs") in text, text
    one_sentence(text)
    assert steps_logged(out) == [1, 2, 3] and (out / "ugpum_lora.safetensors").is_file()


def test_a_stop_after_the_last_save_says_the_run_is_complete_not_that_nothing_was_trained(tmp_path):
    out, config = tmp_path / "run", tmp_path / "sample.toml"
    assert train(*BASE, "--steps", "1", "--out", str(out))[0] == 0
    config.write_text("sample_steps = 50\nsample_every = 1000\n")      # a resume renders only the "after" sample
    run = Run(*BASE[:-2], "--config", str(config), "--steps", "2", "--resume", str(out))
    run.wait_for("validation loss after 2 steps")                        # the last save is done; the sample renders
    run.proc.send_signal(signal.SIGINT)
    rc, text = run.finish()
    assert rc == 130 and f"stopped after the last step (2), once its LoRA was saved: {out} keeps " \
        "ugpum_lora.safetensors and its checkpoint; the run is complete" in text, text
    assert "stopped before any new step was trained" not in text         # (what it said before: untrue)
    one_sentence(text)
    assert steps_logged(out) == [1, 2] and latest_checkpoint(out).name == "step_000002"
    rc, text = train(*BASE, "--steps", "2", "--resume", str(out))
    assert rc == 0 and "the run is finished (2 of 2 steps trained" in text, text


def test_a_stop_between_periodic_saves_says_what_is_kept_and_the_resume_goes_on(tmp_path):
    out, config = tmp_path / "run", tmp_path / "every.toml"
    config.write_text("save_every = 1\n")
    run = Run(*BASE, "--config", str(config), "--steps", "300", "--out", str(out))
    run.wait_for_metrics(out, 2)
    run.proc.send_signal(signal.SIGINT)
    rc, text = run.finish()
    step = steps_logged(out)[-1]
    assert rc == 130 and "stopped before any new step was trained" not in text, text
    assert f"stopped at step {step}, just after its save: {out} keeps the checkpoint and the LoRA of step {step}; " \
        f"continue with --resume {out}" in text or f"stopped at step {step}: checkpoint and LoRA saved in {out}" in text
    one_sentence(text)
    assert latest_checkpoint(out).name == f"step_{step:06d}"
    rc, text = train(*BASE, "--config", str(config), "--steps", str(step + 1), "--resume", str(out))
    assert rc == 0 and steps_logged(out) == list(range(1, step + 2)), text


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_while_the_command_line_imports_is_one_sentence(tmp_path, signum):
    run = Run(*BASE, "--steps", "1", "--out", str(tmp_path / "run"))
    maps = Path(f"/proc/{run.proc.pid}/maps")
    run.wait_until(lambda: "torch" in maps.read_text(), timeout=60, what="torch being imported")
    run.proc.send_signal(signum)
    rc, text = run.finish()
    assert rc == 128 + signum and text.strip() == f"stopped by {signal.Signals(signum).name} while starting: " \
        "nothing was done", text
    assert not (tmp_path / "run").exists()


def test_a_writer_killed_during_the_final_save_leaves_nothing_past_the_next_run(tmp_path):
    out = tmp_path / "run"
    run = Run(*BASE, "--steps", "2", "--out", str(out))
    run.wait_for("saving checkpoint and LoRA at step 2")
    run.proc.kill()                                          # SIGKILL, and not yet reaped: a zombie until wait()
    try:
        state = Path(f"/proc/{run.proc.pid}/stat")
        deadline = time.monotonic() + 60                     # (a process in a disk write dies when the write ends)
        while state.read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        left = [out / f".ugpum_lora.safetensors.{run.proc.pid}-0123456789ab.tmp",   # what its writes leave
                out / "cache" / "latents" / f".{'0' * 40}.safetensors.{run.proc.pid}-0123456789ab.tmp"]
        for path in left:
            path.write_bytes(b"half")
        rc, text = train(*BASE, "--steps", "1", "--out", str(out), "--overwrite")
        assert rc == 0, text
        assert not list(out.rglob("*.tmp")), (list(out.rglob("*.tmp")), text)
        assert "temporary file(s) an interrupted save left" in text, text
    finally:
        run.finish()


def two_checkpoints(out: Path, config: Path, rank: int = 4) -> None:
    config.write_text(f"save_every = 1\nrank = {rank}\nalpha = {float(rank)}\n")
    rc, text = train(*BASE, "--config", str(config), "--steps", "2", "--out", str(out))
    assert rc == 0, text


def test_an_optimizer_state_of_another_rank_falls_back_saying_so_instead_of_a_shape_error(tmp_path):
    two_checkpoints(tmp_path / "run", tmp_path / "run.toml", rank=4)
    two_checkpoints(tmp_path / "other", tmp_path / "other.toml", rank=8)
    victim = tmp_path / "run" / "checkpoints" / "step_000002" / "optimizer.safetensors"
    victim.write_bytes((tmp_path / "other" / "checkpoints" / "step_000002" / "optimizer.safetensors").read_bytes())
    rc, text = train(*BASE, "--config", str(tmp_path / "run.toml"), "--steps", "3", "--resume", str(tmp_path / "run"))
    assert rc == 0, text
    assert ("checkpoint step_000002 cannot be used (optimizer.safetensors does not fit the LoRA (exp_avg of ") in text
    assert "it is the state of a run of another rank or other targets)): continuing from the newest intact one, " \
        "step_000001, instead" in text and "at step 1" in text, text
    assert steps_logged(tmp_path / "run") == [1, 2, 3]


def test_a_checkpoint_holding_nan_is_skipped_for_the_one_before_it(tmp_path):
    out, config = tmp_path / "run", tmp_path / "run.toml"
    two_checkpoints(out, config)
    lora = out / "checkpoints" / "step_000002" / "lora.safetensors"
    tensors = load_file(str(lora))
    name = sorted(tensors)[0]
    save_file({**tensors, name: torch.full_like(tensors[name], float("nan"))}, str(lora))
    rc, text = train(*BASE, "--config", str(config), "--steps", "3", "--resume", str(out))
    assert rc == 0 and (f"checkpoint step_000002 cannot be used (lora.safetensors holds NaN or infinite values "
                        f"({name})): continuing from the newest intact one, step_000001, instead") in text, text
    assert steps_logged(out) == [1, 2, 3]
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "ugpum_lora.safetensors")).values())


def test_metrics_missing_or_cut_short_do_not_stop_a_resume_and_edited_ones_get_the_command_that_moves_them(tmp_path):
    out, config = tmp_path / "run", tmp_path / "run.toml"
    two_checkpoints(out, config)
    metrics = out / "metrics.jsonl"
    metrics.unlink()
    rc, text = train(*BASE, "--config", str(config), "--steps", "3", "--resume", str(out))
    assert rc == 0 and f"note: {metrics} is missing, so the losses of steps 1..2 are not recorded; the checkpoint " \
        "alone continues the run" in text, text
    assert steps_logged(out) == [3]
    metrics.write_text(metrics.read_text()[:20])            # cut in the middle of its only line
    rc, text = train(*BASE, "--config", str(config), "--steps", "4", "--resume", str(out))
    assert rc == 0 and "note: metrics.jsonl records 0 of the 3 steps of the checkpoint (cut short or partly lost)" \
        in text, text
    assert steps_logged(out) == [4]
    metrics.write_text(metrics.read_text() + "my notes\n")    # edited by hand
    before = metrics.read_bytes()
    rc, text = train(*BASE, "--config", str(config), "--steps", "5", "--resume", str(out))
    assert rc == 2 and text.strip().endswith(f"move it aside (mv {metrics} {metrics}.old) and resume again: the "
                                             "checkpoint alone continues the run"), text
    one_sentence(text)
    assert metrics.read_bytes() == before                    # never rewritten
    metrics.rename(f"{metrics}.old")
    rc, text = train(*BASE, "--config", str(config), "--steps", "5", "--resume", str(out))
    assert rc == 0 and steps_logged(out) == [5], text


def test_one_rule_for_lora_names_and_a_huge_name_is_quoted_cut(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('output_name = "mine.safetensors"\n')
    rc, text = train(*BASE, "--config", str(config), "--steps", "1", "--out", str(tmp_path / "run"))
    assert rc == 0 and sorted(p.name for p in (tmp_path / "run").glob("*.safetensors")) == ["mine.safetensors"], text
    config.write_text(f'output_name = "{"n" * (10 * 2**20)}"\n')
    rc, text = train(*BASE, "--config", str(config), "--steps", "1", "--out", str(tmp_path / "huge"))
    assert rc == 2 and "... (10,485,760 characters): is too long" in text and len(text) < 700, text[:700]
    config.write_text(f'output_name = "{"x" * 236}"\n')     # with '_step1.safetensors': all 255 bytes a name may take
    rc, text = train(*BASE, "--config", str(config), "--steps", "1", "--out", str(tmp_path / "long"))
    assert rc == 0 and (tmp_path / "long" / f"{'x' * 236}.safetensors").is_file(), text

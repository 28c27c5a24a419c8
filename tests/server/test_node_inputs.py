"""The LoRA Trainer node reads datasets only inside ComfyUI's input/ folder (issue 15), in a real
ComfyUI server: a musubi dataset TOML in input/ whose image_directory points outside (absolute, or
through ..), and a folder in input/ that is a symlink to one outside, are refused with a sentence that
says why, before anything is written; a TOML whose folder lies inside input/ trains. The Partition
Planner's settings are checked against the model as the command line's are. Issue 32: 16-bit pictures
with UTF-16 captions train on the latents of their 8-bit twins (picture kinds not read are named in the
log), a caption that is a folder is one sentence, names follow the command line's rule, huge names are
quoted cut, and a publish a killed ComfyUI left half-done is cleared by the next run."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from PIL import Image

from support.comfy_server import REPO, comfy_server_factory, execution_error  # noqa: F401  (fixture)
from support.pictures import picture_sets
from support.png_files import exif_orientation, transparent_sets, turned_sets

TINY_FILE = "tiny-flux2.safetensors"
LORANNE = REPO / "demo_datasets" / "loranne"


def write_tiny(path: Path) -> None:
    """A real-format tiny FLUX.2 file: ComfyUI's own module's state dict (q/k norm scales under the
    files' '.scale' names), seeded random values."""
    from safetensors.torch import save_file

    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    state = build_random(get_spec("tiny-flux2"), torch.float32).state_dict()
    save_file({k.removesuffix("norm.weight") + "norm.scale" if k.endswith(("query_norm.weight", "key_norm.weight"))
               else k: v.contiguous() for k, v in state.items()}, str(path))


def copy_images(dest: Path, count: int = 2) -> None:
    dest.mkdir(parents=True)
    for image in sorted(LORANNE.glob("*.jpg"))[:count]:
        shutil.copy(image, dest / image.name)
        shutil.copy(image.with_suffix(".txt"), dest / image.with_suffix(".txt").name)


def prepare(models: Path, input_dir: Path) -> None:
    write_tiny(models / "diffusion_models" / TINY_FILE)
    outside = input_dir.parent.parent / "outside"                  # next to ComfyUI's base folder
    copy_images(outside)
    (input_dir / "escape_absolute.toml").write_text(f'[[datasets]]\nimage_directory = "{outside}"\n')
    (input_dir / "escape_dotdot.toml").write_text('[[datasets]]\nimage_directory = "../../outside"\n')
    (input_dir / "linked").symlink_to(outside, target_is_directory=True)
    copy_images(input_dir / "inside_set")
    (input_dir / "inside_set" / "borrowed.jpg").symlink_to(outside / sorted(p.name for p in outside.glob("*.jpg"))[0])
    (input_dir / "inside_set" / "borrowed.txt").write_text("loranne")
    copy_images(input_dir / "own_set")
    picture_sets(input_dir)                                        # input/deep and input/twin (issue 32)
    copy_images(input_dir / "caption_folder", count=1)
    caption = next((input_dir / "caption_folder").glob("*.txt"))
    caption.unlink()
    caption.mkdir()
    (input_dir / "inside.toml").write_text('[[datasets]]\nimage_directory = "own_set"\nresolution = 64\n'
                                           "enable_bucket = true\n")
    turned_sets(input_dir)                                         # input/turned, upright, keyed, flat (issue 39)
    transparent_sets(input_dir)
    (input_dir / "musubi_own.toml").write_text('[general]\nresolution = 64\nenable_bucket = true\ncache_directory = '
                                               '"cache"\n\n[[datasets]]\nimage_directory = "own_set"\n'
                                               "debug_dataset = false\n")
    copy_images(input_dir / "damaged_meta", count=1)
    Image.new("RGB", (64, 48), (10, 200, 30)).save(input_dir / "damaged_meta" / "cut_exif.jpg",
                                                   exif=b"Exif\x00\x00" + exif_orientation(6)[:-12])
    (input_dir / "damaged_meta" / "cut_exif.txt").write_text("loranne")


@pytest.fixture(scope="module")
def server(comfy_server_factory):
    return comfy_server_factory(prepare=prepare)


def training(dataset: str, save_name: str, rank: int = 4) -> dict:
    """Loader -> Planner -> Trainer on the tiny FLUX.2 (CPU, 64 px, stand-in encoders), one step."""
    return {
        "1": {"class_type": "UGPUMLoader", "inputs": {"dit_name": TINY_FILE, "weight_dtype": "as stored",
                                                       "devices": "auto"}},
        "2": {"class_type": "UGPUMPartitionPlanner",
              "inputs": dict(model=["1", 0], resolution=64, batch=1, grad_accum=1, rank=rank, recompute="auto")},
        "3": {"class_type": "UGPUMLoRATrainer",
              "inputs": dict(model=["1", 0], plan=["2", 0], dataset=dataset, trigger_word="loranne", steps=1,
                             learning_rate=1e-3, alpha=4.0, seed=1, sample_prompt="loranne", sample_every=0,
                             save_name=save_name)},
    }


def refusal(server, prompt: dict, node: str) -> str:
    """The sentence of a node that refused while the graph ran."""
    entry = server.run(prompt, timeout=120)
    error = execution_error(entry)
    assert error is not None, json.dumps(entry["status"], indent=1) + server.log_tail()
    assert error["node_id"] == node and error["exception_type"].endswith("UGPUMError"), error
    return one_sentence(error["exception_message"])


def refusal_before_running(server, prompt: dict, node: str) -> str:
    """The sentence of a node that refused the prompt when it was queued, before any node ran
    (`validate_inputs`; ComfyUI repeats it at each input the check reads)."""
    refused = server.refused(prompt)
    assert list(refused) == [node], refused
    messages = {detail.split(" - ", 1)[1] for detail in refused[node]}
    assert len(messages) == 1, messages
    return one_sentence(messages.pop())


def one_sentence(message: str) -> str:
    message = message.strip()
    assert "\n" not in message and message.endswith(".") and "Traceback" not in message, message
    return message


@pytest.mark.parametrize("dataset, named, refused", [
    ("input/escape_absolute.toml", "image_directory '{outside}' resolves to {outside}", refusal),
    ("input/escape_dotdot.toml", "image_directory '../../outside' resolves to {outside}", refusal),
    ("input/linked", "dataset 'input/linked' is or passes through a symlink to {outside}", refusal_before_running),
    ("input/inside_set", "borrowed.jpg in dataset folder {input}/inside_set is or passes through a symlink", refusal),
], ids=["toml-absolute", "toml-dotdot", "symlinked-folder", "symlinked-image"])
def test_a_dataset_reaching_outside_input_is_refused_saying_why(server, dataset, named, refused):
    """(The dataset the node names is checked when the prompt is queued, what it holds as it is read.)"""
    save_name = "escape_" + dataset.split("/")[1].split(".")[0]
    message = refused(server, training(dataset, save_name), "3")
    input_dir = server.input_dir.resolve()
    assert message.startswith("LoRA Trainer: "), message
    assert named.format(outside=input_dir.parent.parent / "outside", input=input_dir) in message, message
    assert f"outside the allowed folder {input_dir}" in message and "not there any more" not in message, message
    assert not (server.output_dir / "ugpum" / save_name).exists()                 # nothing was written
    assert not (server.base / "models" / "loras" / "ugpum" / f"{save_name}.safetensors").exists()


def test_a_dataset_toml_inside_input_trains(server):
    entry = server.run(training("input/inside.toml", "inside_toml"), timeout=300)
    error = execution_error(entry)
    assert error is None and entry["status"]["status_str"] == "success", json.dumps(error, indent=1)
    assert (server.base / "models" / "loras" / "ugpum" / "inside_toml.safetensors").is_file()


def test_the_planners_rank_is_checked_against_the_model(server):
    message = refusal(server, training("input/inside.toml", "rank_too_high", rank=128), "2")
    assert "setting 'rank' = 128: must be at most 64, the smallest layer a LoRA on tiny-flux2 adapts" in message


@pytest.mark.parametrize("save_name, named", [
    ("a\0b", "holds a control character"),
    ("x" * 250, "is too long: with '_step100000.safetensors' it takes 273 bytes"),
    ("what?", "which Windows cannot store"),
], ids=["nul", "too-long", "windows"])
def test_a_bad_save_name_is_refused_by_name_before_any_work(server, save_name, named):
    message = refusal_before_running(server, training("input/inside.toml", save_name), "3")
    assert message.startswith(f"LoRA Trainer: save name {save_name!r} ") and named in message, message
    assert not (server.output_dir / "ugpum").exists() or not any(
        p.name.startswith(save_name[:20]) for p in (server.output_dir / "ugpum").iterdir())


def test_a_run_folder_another_run_holds_is_refused(server):
    from ugpum.train.run.lock import RunLock
    out = server.output_dir / "ugpum" / "held_run"
    lock = RunLock(out).acquire()                    # another run (this test's process) trains into it
    try:
        message = refusal(server, training("input/inside.toml", "held_run"), "3")
    finally:
        lock.release()
    assert f"{out} is in use by another run (process {os.getpid()} on " in message, message
    assert not (server.base / "models" / "loras" / "ugpum" / "held_run.safetensors").exists()


# ---------------------------------------------------------------- issue 32

def cached(server, save_name: str, kind: str) -> list[Path]:
    return sorted((server.output_dir / "ugpum" / save_name / "cache" / kind).iterdir())


def test_16_bit_pictures_with_utf16_captions_train_on_the_latents_of_their_8_bit_twins(server):
    from safetensors.torch import load_file
    for dataset in ("deep", "twin"):
        entry = server.run(training(f"input/{dataset}", f"pictures_{dataset}"), timeout=300)
        assert execution_error(entry) is None, json.dumps(execution_error(entry), indent=1)
    deep, twin = ({tuple(t.shape): t for t in (load_file(str(p))["value"] for p in cached(server, f"pictures_{name}",
                                                                                          "latents"))}
                  for name in ("deep", "twin"))            # by shape: a landscape and a portrait picture
    assert len(deep) == 2 and deep.keys() == twin.keys()
    for shape, a in deep.items():
        b = twin[shape]
        assert torch.allclose(a, b, rtol=2**-8, atol=2**-8 * float(b.abs().max())), float((a - b).abs().max())
    assert [p.name for p in cached(server, "pictures_deep", "text")] == [p.name for p in cached(server, "pictures_twin",
                                                                                                  "text")]
    assert "skipped 1 picture(s) of a kind UGPUM does not read (layers.psd); to train on them, convert them to PNG " \
        "or JPEG" in server.log()


def test_a_caption_that_is_a_folder_is_one_sentence(server):
    message = refusal(server, training("input/caption_folder", "caption_folder"), "3")
    assert message.startswith("LoRA Trainer: image ") and "its caption" in message, message
    assert "is a folder or other non-file, not a text file; replace it by a caption file (it may be empty)" in message
    assert not (server.base / "models" / "loras" / "ugpum" / "caption_folder.safetensors").exists()


def test_a_save_name_with_its_extension_follows_the_command_lines_rule(server):
    entry = server.run(training("input/inside.toml", "mine.safetensors"), timeout=300)
    assert execution_error(entry) is None, json.dumps(execution_error(entry), indent=1)
    loras = server.base / "models" / "loras" / "ugpum"
    assert (loras / "mine.safetensors").is_file() and not (loras / "mine.safetensors.safetensors").exists()
    assert (server.output_dir / "ugpum" / "mine" / "ugpum_lora.safetensors").exists() is False   # (named mine)
    assert (server.output_dir / "ugpum" / "mine" / "mine.safetensors").is_file()


@pytest.mark.parametrize("field", ["dataset", "save_name"])
def test_a_ten_megabyte_name_is_refused_quoting_it_cut(server, field):
    huge = "input/" + "n" * (10 * 2**20) if field == "dataset" else "n" * (10 * 2**20)
    prompt = training("input/inside.toml", "huge_name")
    prompt["3"]["inputs"][field] = huge
    message = refusal_before_running(server, prompt, "3")    # (ComfyUI leaves the dataset's check to the node)
    assert len(message) < 700 and "... (10,485,7" in message and "Errno" not in message, message[:1000]
    assert "pick one from the list" in message if field == "dataset" else "is too long" in message


def test_a_publish_a_killed_comfyui_left_half_done_is_cleared_by_the_next_run(server):
    import subprocess
    loras = server.base / "models" / "loras" / "ugpum"
    loras.mkdir(parents=True, exist_ok=True)
    killed = subprocess.Popen(["true"])
    killed.wait()
    half = loras / f".earlier.safetensors.{killed.pid}-0123456789ab.tmp"
    half.write_bytes(b"half a LoRA")
    entry = server.run(training("input/inside.toml", "after_a_kill"), timeout=300)
    assert execution_error(entry) is None, json.dumps(execution_error(entry), indent=1)
    assert (loras / "after_a_kill.safetensors").is_file() and not half.exists()


# ---------------------------------------------------------------- issue 39

def latents_of(server, save_name: str) -> list[torch.Tensor]:
    from safetensors.torch import load_file
    return [load_file(str(p))["value"] for p in cached(server, save_name, "latents")]


@pytest.mark.parametrize("stored, shown", [("turned", "upright"), ("keyed", "flat")],
                         ids=["orientation-anywhere", "transparent-colour"])
def test_pictures_train_on_the_latents_of_the_pictures_they_show(server, stored, shown):
    for dataset in (stored, shown):
        entry = server.run(training(f"input/{dataset}", f"shown_{dataset}"), timeout=300)
        assert execution_error(entry) is None, json.dumps(execution_error(entry), indent=1)
    left = latents_of(server, f"shown_{shown}")
    for tensor in latents_of(server, f"shown_{stored}"):
        match = next((i for i, t in enumerate(left) if t.shape == tensor.shape and torch.equal(t, tensor)), None)
        assert match is not None, (tuple(tensor.shape), [tuple(t.shape) for t in left])
        left.pop(match)
    assert not left


def test_damaged_metadata_and_musubi_tuners_own_keys_are_said_in_the_log(server):
    for dataset, save_name in (("input/damaged_meta", "damaged_meta"), ("input/musubi_own.toml", "musubi_own")):
        entry = server.run(training(dataset, save_name), timeout=300)
        assert execution_error(entry) is None, json.dumps(execution_error(entry), indent=1)
    log = server.log()
    damaged = server.input_dir.resolve() / "damaged_meta" / "cut_exif.jpg"
    assert f"note: image {damaged} has damaged metadata (Corrupt EXIF data." in log, server.log_tail()
    assert "UserWarning" not in log and "TiffImagePlugin" not in log, server.log_tail()
    assert "cache_directory, debug_dataset change nothing in UGPUM" in log, server.log_tail()


def test_a_save_the_system_refuses_is_one_sentence_saying_what_is_kept(server):
    import subprocess
    out = server.output_dir / "ugpum" / "read_only"
    (out / "checkpoints").mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(out / "checkpoints")],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        message = refusal(server, training("input/inside.toml", "read_only"), "3")
    finally:
        subprocess.run(["umount", "-l", str(out / "checkpoints")], capture_output=True)
    assert message.startswith(f"LoRA Trainer: cannot write the checkpoint at step 1 (step_000001) in {out}/checkpoints: "
                              "its disk is read-only now"), message
    assert "kept: the LoRA of step 1 (read_only.safetensors); no checkpoint of this run is on disk" in message, message
    assert (out / "read_only.safetensors").is_file() and not [p for p in out.rglob(".*") if p.name != ".ugpum_run.lock"]

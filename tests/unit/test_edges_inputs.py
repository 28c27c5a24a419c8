"""Issue 26, the inputs: names checked before any work, captions read as editors write them, unknown
config keys answered with the closest setting (issue 25), non-finite model weights named as they are
placed, a non-finite step stopped before it is applied, unusable folders in one sentence."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from ugpum.folders import FolderError, check_writable
from ugpum.stream_load import NonFiniteWeight, fill_from_file
from ugpum.train.cache import dataset_hash
from ugpum.train.config import ConfigError, TrainConfig, load_config
from ugpum.train.dataset import load_image_folder
from ugpum.train.divergence import NonFiniteStep, check_step

REPO = Path(__file__).resolve().parents[2]
LORANNE = REPO / "demo_datasets" / "loranne"


@pytest.mark.parametrize("name, problem", [
    ("a\0b", "holds a control character"),
    ("runs/mine", "holds a folder separator"),
    ("..\\up", "holds a folder separator"),
    (".hidden", "starts with a dot"),
    ("what?", "which Windows cannot store"),
    ("x" * 240, "is too long: with '_step50.safetensors' it takes 259 bytes and a file name may take 255"),
    ("é" * 120, "is too long"),
    ("   ", "is empty"),
])
def test_a_bad_output_name_is_refused_by_name_before_any_work(name, problem):
    with pytest.raises(ConfigError) as caught:
        load_config("tiny-flux2", overrides={"output_name": name})
    assert str(caught.value).startswith("setting 'output_name' = ") and problem in str(caught.value)


def test_a_name_that_fits_with_every_step_suffix_is_taken():
    load_config("tiny-flux2", overrides={"output_name": "x" * 200, "steps": 50})


def test_unknown_config_keys_are_answered_with_the_closest_setting(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("learning_rate = 1e-4\nnetwork_dim = 8\nstpes = 3\nfoo_bar_baz = 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config("tiny-flux2", toml)
    text = str(caught.value)
    assert text.startswith(f"{toml}: unknown settings ")
    for said in ("learning_rate (did you mean lr?)", "network_dim (did you mean rank?)",
                 "stpes (did you mean steps?)", "foo_bar_baz, "):
        assert said in text, text


def test_a_config_saved_with_a_byte_order_mark_loads(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_bytes("\ufeffsteps = 7\r\n".encode("utf-8"))
    assert load_config("tiny-flux2", toml).steps == 7


def test_captions_read_as_editors_write_them(tmp_path):
    plain, edited = tmp_path / "plain", tmp_path / "edited"
    shutil.copytree(LORANNE, plain)
    shutil.copytree(LORANNE, edited)
    captions = sorted(edited.glob("*.txt"))
    text = captions[0].read_text(encoding="utf-8").strip()
    captions[0].write_bytes(("\ufeff" + text + "  \r\n\r\n").encode("utf-8"))       # Notepad: BOM, CRLF
    captions[1].write_bytes(captions[1].read_text(encoding="utf-8").strip().encode("utf-16"))  # "Unicode"
    a = load_image_folder(plain, resolution=64)
    b = load_image_folder(edited, resolution=64)
    assert [i.caption for i in a] == [i.caption for i in b]
    assert not any("\ufeff" in i.caption or "\r" in i.caption for i in b)
    assert dataset_hash(a) == dataset_hash(b)                   # the same run, whatever the editor


class OneDevice:
    def device_of(self, _path: str) -> str:
        return "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_weight_is_named_as_the_model_is_placed(tmp_path, dtype):
    weights = {"0.weight": torch.ones(8, 8, dtype=dtype), "0.bias": torch.zeros(8, dtype=dtype),
               "1.weight": torch.ones(8, 8, dtype=dtype), "1.bias": torch.zeros(8, dtype=dtype)}
    weights["1.weight"][3, 5] = float("nan")
    path = tmp_path / "m.safetensors"
    save_file(weights, str(path))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(NonFiniteWeight, match=r"tensor 1\.weight holds NaN or infinite values"):
        fill_from_file(model, OneDevice(), path, dtype=dtype)


def test_a_non_finite_step_stops_naming_it_before_the_optimizer_applies_it():
    cfg = SimpleNamespace(max_grad_norm=0.0, lr=1e-2)
    p = nn.Parameter(torch.ones(3))
    (p * torch.tensor([1.0, float("inf"), 1.0])).sum().backward()          # a finite loss, an infinite gradient
    with pytest.raises(NonFiniteStep) as caught:
        check_step(7, 3.0, [p], cfg)
    assert str(caught.value).startswith("step 7: the gradients' norm is inf, so the run stopped before applying it "
                                        "(the LoRA stays as step 6 left it)")
    assert "turn gradient clipping on" in str(caught.value)
    with pytest.raises(NonFiniteStep, match="step 1: the loss is nan"):
        check_step(1, float("nan"), [], cfg)
    p.grad = torch.ones(3)
    check_step(2, 1.0, [p], cfg)                                  # finite: nothing said


def test_unusable_folders_are_one_sentence_with_the_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(FolderError, match=rf"cache_dir {blocker}/c: {blocker} is a file, so no folder can be made"):
        check_writable(blocker / "c", "cache_dir", "set cache_dir elsewhere")
    with pytest.raises(FolderError, match="is longer than the 255 bytes a file name may take"):
        check_writable(tmp_path / ("n" * 300), "cache_dir", "set cache_dir elsewhere")
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        with pytest.raises(FolderError, match="is on a read-only filesystem; set cache_dir elsewhere"):
            check_writable(ro / "cache", "cache_dir", "set cache_dir elsewhere")
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


def test_train_config_validation_is_the_one_every_front_end_calls():
    with pytest.raises(ConfigError, match=r"setting 'rank' = 5000: must be from 1 to 1,024"):
        TrainConfig(model="tiny-flux2", rank=5000).validate()

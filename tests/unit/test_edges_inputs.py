"""Issue 26, the inputs: names checked before any work, captions read as editors write them, unknown
config keys answered with the closest setting (issue 25), non-finite model weights named as they are
placed, a non-finite step stopped before it is applied, unusable folders in one sentence. Issue 32:
every picture mode read as the picture it shows (or refused by name), picture kinds not read listed,
captions in every Unicode encoding, unreadable captions, dangling and too long paths, one rule for names."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from torch import nn

from ugpum.folders import FolderError, check_writable
from ugpum.placement.stream_load import NonFiniteWeight, fill_from_file
from ugpum.train.cache import dataset_hash
from ugpum.train.config import ConfigError, TrainConfig, load_config
from ugpum.train.dataset import DatasetError, load_image_folder, read_caption
from ugpum.train.pictures import IMAGE_EXTENSIONS, image_size, open_rgb
from ugpum.train.divergence import NonFiniteStep, StepReading, clip_with_norm, skips_on_device

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
        StepReading(7, 3.0, [p], cfg)
    assert str(caught.value).startswith("step 7: the gradients' norm is inf, so the run stopped before applying it "
                                        "(the LoRA stays as step 6 left it)")
    assert "turn gradient clipping on" in str(caught.value)
    with pytest.raises(NonFiniteStep, match="step 1: the loss is nan"):
        StepReading(1, float("nan"), [], cfg)
    p.grad = torch.ones(3)
    assert StepReading(2, 1.0, [p], cfg).read() == 1.0                # finite: nothing said


def test_a_step_read_late_is_skipped_by_the_optimizer_where_it_is_not_finite():
    """Read while the next step runs, a step's values cannot stop the optimizer before it applies them: the fused
    AdamW is told on the device to skip a step that is not finite (its parameters, moments and step count stay),
    and reading the step later says so; a finite step is applied as ever."""
    cfg = SimpleNamespace(max_grad_norm=1.0, lr=1e-2)
    p = nn.Parameter(torch.ones(3))
    fused, plain = torch.optim.AdamW([p], lr=0.1, fused=True), torch.optim.AdamW([nn.Parameter(torch.ones(1))])
    assert skips_on_device(fused) and not skips_on_device(plain)
    p.grad = torch.full((3,), 2.0)
    good = StepReading(1, [torch.tensor(0.25), torch.tensor(0.5)], [p], cfg, skip_on_device=fused)
    fused.step()
    after_one = (p.detach().clone(), {k: v.clone() for k, v in fused.state[p].items()})
    assert good.read() == 0.75 and not torch.equal(after_one[0], torch.ones(3))
    p.grad = torch.tensor([1.0, float("nan"), 1.0])
    bad = StepReading(2, [torch.tensor(0.5)], [p], cfg, skip_on_device=fused)     # (nothing raised yet)
    fused.step()
    assert torch.equal(p.detach(), after_one[0])
    assert all(torch.equal(fused.state[p][k], v) for k, v in after_one[1].items())
    with pytest.raises(NonFiniteStep, match=r"step 2: the gradients' norm is nan, so the run stopped before"):
        bad.read()
    p.grad = torch.ones(3)
    with pytest.raises(NonFiniteStep, match="step 3: the loss is nan"):       # a loss read as a number already:
        StepReading(3, float("nan"), [p], cfg, skip_on_device=fused)        # checked at once, never deferred


def test_clipping_with_the_checked_norm_scales_as_clip_grad_norm_does():
    """The loop clips with the norm `StepReading` measured (`clip_with_norm`), not a second pass over the
    gradients: the same gradients as torch's clip_grad_norm_, bit for bit."""
    cfg = SimpleNamespace(max_grad_norm=1.0, lr=1e-2)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g) * 4, torch.randn(7, generator=g)]
    ours, torchs = ([nn.Parameter(torch.zeros_like(t)) for t in grads] for _ in range(2))
    for p, q, t in zip(ours, torchs, grads):
        p.grad, q.grad = t.clone(), t.clone()
    reading = StepReading(3, 2.0, ours, cfg)
    assert reading.read() == 2.0 and float(reading.norm) > 1.0        # (large enough to be clipped)
    clip_with_norm(ours, 1.0, reading.norm)
    torch.nn.utils.clip_grad_norm_(torchs, 1.0)
    for p, q in zip(ours, torchs):
        assert torch.equal(p.grad, q.grad)
    assert StepReading(4, 1.0, [], cfg).norm is None
    clip_with_norm([], 1.0, None)                                   # no gradients: nothing to do


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


# ---------------------------------------------------------------- issue 32: every picture read as it is

def grey_ramp(width: int = 64, height: int = 48) -> np.ndarray:
    """A 16-bit greyscale picture using the whole range (0 at the left, 65535 at the right)."""
    return np.tile(np.linspace(0, 65535, width).round().astype(np.uint16), (height, 1))


def twin_of(ramp) -> Image.Image:
    """The 8-bit twin of a 16-bit picture: each value scaled to 0..255 and rounded (v / 257)."""
    return Image.fromarray((ramp.astype(np.float64) / 257).round().astype(np.uint8)).convert("RGB")


def pixels(image: Image.Image) -> bytes:
    return image.tobytes()


def tiff_with_range(path: Path, values, low: float, high: float) -> None:
    from PIL import TiffImagePlugin
    info = TiffImagePlugin.ImageFileDirectory_v2()
    info[340], info[341] = low, high                        # SMinSampleValue, SMaxSampleValue
    Image.fromarray(values).save(path, tiffinfo=info)


@pytest.mark.parametrize("write", [
    lambda p, r: Image.fromarray(r).save(p.with_suffix(".png")),                     # I;16
    lambda p, r: Image.fromarray(r).save(p.with_suffix(".tif")),                     # I;16 in a TIFF
    lambda p, r: Image.frombytes("I;16B", (64, 48), r.astype(">u2").tobytes()).save(p.with_suffix(".tiff")),
    lambda p, r: Image.fromarray(r.astype("float32") / 65535).save(p.with_suffix(".tif")),   # F in 0..1
    lambda p, r: tiff_with_range(p.with_suffix(".tif"), r.astype("int32") * 7 - 1000, -1000, 65535 * 7 - 1000),
], ids=["png-16", "tiff-16", "tiff-16-big-endian", "tiff-float", "tiff-int32-stated-range"])
def test_a_deep_picture_decodes_to_the_pixels_of_its_8_bit_twin(tmp_path, write):
    ramp = grey_ramp()
    write(tmp_path / "deep", ramp)
    (path,) = tmp_path.glob("deep.*")
    got = open_rgb(path)
    assert got.mode == "RGB" and got.size == (64, 48)
    assert pixels(got) == pixels(twin_of(ramp))             # (convert("RGB") made every value over 255 white)


@pytest.mark.parametrize("values, refused", [
    (lambda r: r.astype("float32") / 65535 * 3, "holds floating-point values from 0 to 3, and the file does not say"),
    (lambda r: r.astype("int32") - 5, "holds 32-bit integer values from -5 to 65530, and the file does not say"),
    (lambda r: with_nan(r.astype("float32") / 65535), "holds NaN or infinite values"),
], ids=["float-outside-0-1", "signed-int32", "float-nan"])
def test_a_picture_whose_range_is_not_stated_is_refused_by_name(tmp_path, values, refused):
    path = tmp_path / "deep.tif"
    Image.fromarray(values(grey_ramp())).save(path)
    with pytest.raises(DatasetError) as caught:
        open_rgb(path)
    assert str(caught.value).startswith(f"image {path} ") and refused in str(caught.value), caught.value
    assert "save it as an 8- or 16-bit PNG" in str(caught.value)


def with_nan(values: np.ndarray) -> np.ndarray:
    values[3, 3] = float("nan")
    return values


def test_transparency_is_laid_over_white_in_every_mode_that_has_it(tmp_path):
    Image.new("RGBA", (32, 32), (0, 0, 0, 0)).save(tmp_path / "clear.png")           # black, fully transparent
    Image.new("RGBA", (32, 32), (255, 0, 0, 128)).save(tmp_path / "half.png")         # half-transparent red
    Image.new("LA", (32, 32), (0, 0)).save(tmp_path / "grey.png")
    palette = Image.new("P", (32, 32), 1)
    palette.putpalette([0, 0, 0, 0, 0, 0] + [0] * 762)
    palette.save(tmp_path / "palette.png", transparency=1)
    palette.save(tmp_path / "palette.gif", transparency=1)
    Image.new("RGB", (32, 32), (0, 0, 0)).save(tmp_path / "keyed.png", transparency=(0, 0, 0))   # tRNS colour
    shown = {p.name: open_rgb(p).getpixel((5, 5)) for p in sorted(tmp_path.iterdir())}
    assert shown == {"clear.png": (255, 255, 255), "grey.png": (255, 255, 255), "half.png": (255, 127, 127),
                     "keyed.png": (255, 255, 255), "palette.gif": (255, 255, 255), "palette.png": (255, 255, 255)}


def test_other_modes_become_the_picture_they_show(tmp_path):
    Image.new("CMYK", (32, 32), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")        # red, as print writes it
    Image.new("CMYK", (32, 32), (0, 255, 255, 0)).save(tmp_path / "cmyk.tif")
    broken = Image.new("CMYK", (32, 32), (0, 255, 255, 0))
    broken.save(tmp_path / "cmyk_bad_profile.jpg", icc_profile=b"not a profile")       # falls back, not refused
    Image.new("RGB", (32, 32), (10, 200, 30)).convert("LAB").save(tmp_path / "lab.tif")
    Image.new("1", (32, 32), 1).save(tmp_path / "one.png")
    Image.new("RGB", (32, 32), (10, 200, 30)).convert("YCbCr").save(tmp_path / "ycc.tif")
    got = {p.name: open_rgb(p).getpixel((5, 5)) for p in sorted(tmp_path.iterdir())}
    reds = (got["cmyk.jpg"], got["cmyk.tif"], got["cmyk_bad_profile.jpg"])
    assert all(r > 240 and g < 15 and b < 15 for r, g, b in reds), reds
    assert all(abs(a - b) <= 10 for a, b in zip(got["lab.tif"], (10, 200, 30))), got["lab.tif"]
    assert all(abs(a - b) <= 3 for a, b in zip(got["ycc.tif"], (10, 200, 30))), got["ycc.tif"]
    assert got["one.png"] == (255, 255, 255)


def test_an_exif_turned_16_bit_picture_is_turned_upright_like_its_8_bit_twin(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6                                        # rotate 90 degrees clockwise to view
    ramp = grey_ramp()
    Image.fromarray(ramp).save(tmp_path / "deep.png", exif=exif)
    twin_of(ramp).save(tmp_path / "twin.png", exif=exif)
    assert image_size(tmp_path / "deep.png") == image_size(tmp_path / "twin.png") == (48, 64)
    assert pixels(open_rgb(tmp_path / "deep.png")) == pixels(open_rgb(tmp_path / "twin.png"))
    assert open_rgb(tmp_path / "deep.png").size == (48, 64)


def test_pictures_of_kinds_not_read_are_listed_never_dropped_in_silence(tmp_path):
    from ugpum.arch import get_spec
    from ugpum.train.batches import load_items
    folder = tmp_path / "set"
    folder.mkdir()
    for name, kind in (("a.png", "PNG"), ("b.tif", "TIFF"), ("c.gif", "GIF"), ("d.jfif", "JPEG")):   # taken
        Image.new("RGB", (64, 48), (200, 30, 30)).save(folder / name, format=kind)
        (folder / name).with_suffix(".txt").write_text(name)
    (folder / "e.psd").write_bytes(b"8BPS")                 # a Photoshop file, a phone's HEIC: not read
    (folder / "f.heic").write_bytes(b"\0\0\0\x18ftypheic")
    said = []
    items = load_items(TrainConfig(model="tiny-flux2", dataset=str(folder), resolution=64), get_spec("tiny-flux2"),
                       said.append)
    assert sorted(i.path.name for i in items) == ["a.png", "b.tif", "c.gif", "d.jfif"]
    assert said == [f"note: {folder}: skipped 2 picture(s) of a kind UGPUM does not read (e.psd, f.heic); to train "
                    f"on them, convert them to PNG or JPEG (read: {', '.join(IMAGE_EXTENSIONS)})"]
    for name in ("a.png", "b.tif", "c.gif", "d.jfif"):
        (folder / name).unlink()
    with pytest.raises(DatasetError, match=r"holds no images .*; it skipped 2 picture\(s\) of a kind UGPUM does not "
                                           r"read \(e\.psd, f\.heic\)"):
        load_image_folder(folder)


# ---------------------------------------------------------------- issue 32: captions decoded as they are

@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32", "utf-16", "utf-8-sig"])
def test_a_caption_in_any_unicode_encoding_reads_as_its_text(tmp_path, encoding):
    text = "loranne, a woman in a red scarf — café"
    path = tmp_path / "a.txt"
    path.write_bytes(text.encode(encoding))                # utf-16-le/be: no byte-order mark, as some tools write
    assert read_caption(path) == text


def test_a_caption_holding_nul_bytes_that_are_no_text_is_refused_by_name(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"a cat\x00\x00\x01\x02 on a mat")
    with pytest.raises(DatasetError, match=rf"caption file {path} holds NUL characters, so it is not plain text"):
        read_caption(path)


# ---------------------------------------------------------------- issue 32: no raw error numbers

def test_a_caption_that_is_a_folder_or_unreadable_is_one_sentence(tmp_path):
    Image.new("RGB", (64, 48)).save(tmp_path / "a.png")
    (tmp_path / "a.txt").mkdir()
    with pytest.raises(DatasetError) as caught:
        load_image_folder(tmp_path, resolution=64)
    assert str(caught.value) == (f"image {tmp_path / 'a.png'}: its caption a.txt is a folder or other non-file, not "
                                 "a text file; replace it by a caption file (it may be empty)")
    with pytest.raises(DatasetError, match=r"cannot read caption file .*: it is a folder, not a file; move that "
                                           "folder out of the way, or remove it"):
        read_caption(tmp_path / "a.txt")


def test_a_dangling_symlink_or_a_path_past_the_systems_limit_is_one_sentence(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    for path in (link, link / "sub"):
        with pytest.raises(FolderError, match=rf"cache_dir {path}: {link} is a symlink to {tmp_path}/nowhere, which "
                                              "does not exist; set cache_dir elsewhere"):
            check_writable(path, "cache_dir", "set cache_dir elsewhere")
    deep = tmp_path.joinpath(*["d" * 200] * 20)             # every name allowed, the whole path too long
    with pytest.raises(FolderError) as caught:
        check_writable(deep, "cache_dir", "set cache_dir elsewhere")
    assert "bytes this system takes for a path; set cache_dir elsewhere" in str(caught.value)
    assert len(str(caught.value)) < 600                     # the path is quoted cut


# ---------------------------------------------------------------- issue 32: one rule for names

@pytest.mark.parametrize("given", ["mine.safetensors", " mine ", "mine.SafeTensors", "mine .safetensors"])
def test_a_lora_name_is_read_by_one_rule(given):
    assert load_config("tiny-flux2", overrides={"output_name": given}).output_name == "mine"


def test_a_huge_setting_is_quoted_cut_in_its_message():
    with pytest.raises(ConfigError) as caught:
        load_config("tiny-flux2", overrides={"output_name": "x" * (10 * 2**20)})
    text = str(caught.value)
    assert text.startswith("setting 'output_name' = 'xxxx") and "... (10,485,760 characters): is too long" in text
    assert len(text) < 600


def test_a_wan_frame_folder_of_16_bit_frames_reads_as_its_8_bit_twin(tmp_path):
    from ugpum.train.video import first_frame_size, read_frames
    ramp = grey_ramp()
    for name in ("deep", "twin"):
        (tmp_path / name).mkdir()
    for i in range(5):
        frame = np.roll(ramp, 3 * i, axis=1)
        Image.fromarray(frame).save(tmp_path / "deep" / f"{i + 1:04d}.png")
        twin_of(frame).save(tmp_path / "twin" / f"{i + 1:04d}.png")
    assert first_frame_size(tmp_path / "deep", 5) == first_frame_size(tmp_path / "twin", 5) == (64, 48)
    deep, twin = read_frames(tmp_path / "deep", 5), read_frames(tmp_path / "twin", 5)
    assert [pixels(f) for f in deep] == [pixels(f) for f in twin]

"""Dataset loading, buckets, pixels and the musubi-tuner TOML, on real files in tmp_path."""

import os
import random
from pathlib import Path

import pytest
import torch
from PIL import Image

from ugpum.train.dataset import (
    DatasetError,
    ImageItem,
    bucket_sizes,
    caption_dropout,
    choose_bucket,
    load_bucketed_image,
    load_image_folder,
    resolve_inside,
)
from ugpum.train.config import TrainConfig
from ugpum.train.musubi_toml import check_inside, load_musubi_toml


def make_image(path: Path, size=(64, 48), color=(200, 30, 30), caption: str | None = "a photo"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


# ---------------------------------------------------------------- folders


def test_folder_lists_every_image_kind_with_its_caption(tmp_path):
    make_image(tmp_path / "b.jpg", caption="  second  \n")
    make_image(tmp_path / "a.png", caption="first")
    make_image(tmp_path / "c.webp", caption="third")
    make_image(tmp_path / "d.bmp", caption="fourth")
    make_image(tmp_path / "e.JPEG", caption="fifth")
    (tmp_path / "notes.json").write_text("{}")
    make_image(tmp_path / "sub" / "nested.png")  # subfolders are not read

    items = load_image_folder(tmp_path, resolution=256)

    assert [i.path.name for i in items] == ["a.png", "b.jpg", "c.webp", "d.bmp", "e.JPEG"]
    assert [i.caption for i in items] == ["first", "second", "third", "fourth", "fifth"]
    assert all(isinstance(i, ImageItem) for i in items)


def test_trigger_is_prepended_once(tmp_path):
    make_image(tmp_path / "a.png", caption="a cat on a sofa")
    make_image(tmp_path / "b.png", caption="photo of ohwx cat")
    make_image(tmp_path / "c.png", caption="")
    items = load_image_folder(tmp_path, resolution=256, trigger="OHWX")
    assert [i.caption for i in items] == ["OHWX, a cat on a sofa", "photo of ohwx cat", "OHWX"]


def test_repeats_duplicate_items(tmp_path):
    make_image(tmp_path / "a.png")
    make_image(tmp_path / "b.png")
    items = load_image_folder(tmp_path, resolution=256, repeats=3)
    assert [i.path.name for i in items] == ["a.png"] * 3 + ["b.png"] * 3


def test_custom_caption_extension(tmp_path):
    make_image(tmp_path / "a.png", caption=None)
    (tmp_path / "a.caption").write_text("from caption file")
    assert load_image_folder(tmp_path, caption_ext=".caption", resolution=256)[0].caption == "from caption file"


def test_missing_folder_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DatasetError, match="nope.*does not exist"):
        load_image_folder(missing)


def test_folder_without_images_names_it(tmp_path):
    (tmp_path / "readme.txt").write_text("no images here")
    with pytest.raises(DatasetError, match=f"{tmp_path}.*holds no images"):
        load_image_folder(tmp_path)


def test_image_without_caption_names_the_image(tmp_path):
    make_image(tmp_path / "a.png")
    make_image(tmp_path / "lonely.png", caption=None)
    with pytest.raises(DatasetError, match=r"lonely\.png has no caption file lonely\.txt"):
        load_image_folder(tmp_path)


def test_corrupt_image_names_the_file(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"this is not a png at all")
    (tmp_path / "broken.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"cannot read image .*broken\.png"):
        load_image_folder(tmp_path)


def test_truncated_jpeg_names_the_file(tmp_path):
    good = make_image(tmp_path / "src" / "full.jpg", size=(256, 256))
    data = good.read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    (tmp_path / "cut.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"cut\.jpg"):
        load_image_folder(tmp_path)


def test_non_utf8_caption_names_the_file(tmp_path):
    make_image(tmp_path / "a.png", caption=None)
    (tmp_path / "a.txt").write_bytes(b"\xff\xfe\xfa bad")
    with pytest.raises(DatasetError, match=r"a\.txt is not UTF-8"):
        load_image_folder(tmp_path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"repeats": 0}, "repeats"),
        ({"repeats": 1.5}, "repeats"),
        ({"resolution": 32}, "too small"),
        ({"resolution": (512, 512, 3)}, "resolution"),
        ({"resolution": True}, "resolution"),
        ({"caption_ext": "txt"}, "caption_extension"),
        ({"enable_bucket": False, "resolution": 500}, "multiples of 16"),
    ],
)
def test_bad_settings_name_the_folder_and_setting(tmp_path, kwargs, message):
    make_image(tmp_path / "a.png")
    with pytest.raises(DatasetError, match=message) as caught:
        load_image_folder(tmp_path, **kwargs)
    assert str(tmp_path) in str(caught.value)


# ---------------------------------------------------------------- buckets


@pytest.mark.parametrize("resolution", [256, 512, 1024])
def test_buckets_are_multiples_of_16_with_area_near_target(resolution):
    target = resolution * resolution
    buckets = bucket_sizes(target)
    assert (resolution, resolution) in buckets
    for width, height in buckets:
        assert width % 16 == 0 and height % 16 == 0
        assert width * height <= target
        # each bucket loses less than one 16-pixel row of the longest side
        assert width * height > target - 16 * max(width, height)
        assert 1 / 4.01 <= width / height <= 4.01
    if resolution == 1024:
        assert min(w * h for w, h in buckets) >= 0.95 * target


def test_bucket_matches_aspect_ratio():
    assert choose_bucket((1000, 1000), 1024) == (1024, 1024)
    wide = choose_bucket((2000, 1000), 1024)
    tall = choose_bucket((1000, 2000), 1024)
    assert tall == (wide[1], wide[0])
    assert abs(wide[0] / wide[1] - 2.0) < 0.05
    # a 3:2 photo gets the bucket whose ratio is nearest 1.5 of all buckets
    best = choose_bucket((3000, 2000), 1024)
    all_errors = sorted(abs(w / h - 1.5) for w, h in bucket_sizes(1024 * 1024))
    assert abs(best[0] / best[1] - 1.5) == pytest.approx(all_errors[0], abs=0.01)


def test_bucket_for_non_square_resolution_uses_its_area():
    width, height = choose_bucket((1920, 1080), (960, 544))
    assert width * height <= 960 * 544
    assert abs(width / height - 16 / 9) < 0.1


@pytest.mark.parametrize("size", [(300, 200), (100, 700), (333, 333), (4000, 3000), (2048, 512)])
def test_no_upscale_bucket_never_bigger_than_image(size):
    width, height = choose_bucket(size, 1024, no_upscale=True)
    assert width <= size[0] and height <= size[1]
    assert width % 16 == 0 and height % 16 == 0
    assert width * height <= 1024 * 1024
    assert abs(width / height - size[0] / size[1]) / (size[0] / size[1]) < 0.2


def test_small_image_upscales_unless_told_not_to(tmp_path):
    make_image(tmp_path / "small.png", size=(200, 100))
    assert load_image_folder(tmp_path, resolution=512)[0].bucket[0] > 200
    assert load_image_folder(tmp_path, resolution=512, bucket_no_upscale=True)[0].bucket == (192, 96)


def test_tiny_image_with_no_upscale_names_the_file(tmp_path):
    make_image(tmp_path / "tiny.png", size=(10, 10))
    with pytest.raises(DatasetError, match=r"tiny\.png"):
        load_image_folder(tmp_path, bucket_no_upscale=True)


def test_without_bucketing_every_item_gets_the_resolution(tmp_path):
    make_image(tmp_path / "a.png", size=(300, 100))
    make_image(tmp_path / "b.png", size=(100, 300))
    items = load_image_folder(tmp_path, resolution=(320, 160), enable_bucket=False)
    assert {i.bucket for i in items} == {(320, 160)}


def test_exif_rotation_is_honoured(tmp_path):
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: stored landscape, shown portrait
    Image.new("RGB", (400, 200), (10, 10, 10)).save(path, exif=exif)
    path.with_suffix(".txt").write_text("x")
    (item,) = load_image_folder(tmp_path, resolution=256)
    assert item.bucket[1] > item.bucket[0]
    assert load_bucketed_image(item).shape == (3, item.bucket[1], item.bucket[0])


# ---------------------------------------------------------------- pixels


def test_bucketed_image_is_in_range_with_bucket_shape(tmp_path):
    make_image(tmp_path / "white.png", size=(90, 70), color=(255, 255, 255))
    item = ImageItem(tmp_path / "white.png", "x", (64, 48))
    pixels = load_bucketed_image(item)
    assert pixels.shape == (3, 48, 64)
    assert pixels.dtype == torch.float32
    assert torch.allclose(pixels, torch.ones_like(pixels))

    Image.new("RGB", (90, 70), (0, 0, 0)).save(tmp_path / "black.png")
    black = load_bucketed_image(ImageItem(tmp_path / "black.png", "x", (64, 48)))
    assert torch.allclose(black, -torch.ones_like(black))


def test_bucketed_image_is_centre_cropped_not_squashed(tmp_path):
    # 300x100: left third red, middle green, right blue. A 96x96 bucket sees only green.
    image = Image.new("RGB", (300, 100), (255, 0, 0))
    image.paste((0, 255, 0), (100, 0, 200, 100))
    image.paste((0, 0, 255), (200, 0, 300, 100))
    image.save(tmp_path / "stripes.png")
    pixels = load_bucketed_image(ImageItem(tmp_path / "stripes.png", "x", (96, 96)))
    assert pixels.shape == (3, 96, 96)
    centre = pixels[:, 10:86, 10:86]
    assert torch.allclose(centre[1], torch.ones_like(centre[1]), atol=0.02)
    assert torch.allclose(centre[0], -torch.ones_like(centre[0]), atol=0.02)
    assert torch.allclose(centre[2], -torch.ones_like(centre[2]), atol=0.02)


def test_bucketed_image_of_corrupt_file_names_it(tmp_path):
    (tmp_path / "gone.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(DatasetError, match=r"gone\.png"):
        load_bucketed_image(ImageItem(tmp_path / "gone.png", "x", (64, 64)))


def test_loaded_items_give_pixels_of_their_bucket(tmp_path):
    make_image(tmp_path / "a.png", size=(640, 360))
    make_image(tmp_path / "b.png", size=(300, 500))
    for item in load_image_folder(tmp_path, resolution=256):
        assert load_bucketed_image(item).shape == (3, item.bucket[1], item.bucket[0])


# ---------------------------------------------------------------- musubi TOML


def write_toml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_toml_general_defaults_and_dataset_overrides(tmp_path, monkeypatch):
    make_image(tmp_path / "cfg" / "images_a" / "a.png", size=(400, 200))
    make_image(tmp_path / "elsewhere" / "b.png", size=(200, 200), caption=None)
    (tmp_path / "elsewhere" / "b.caption").write_text("b caption")
    config = write_toml(
        tmp_path / "cfg" / "dataset.toml",
        f"""
[general]
resolution = [512, 256]
caption_extension = ".txt"
enable_bucket = true
bucket_no_upscale = false

[[datasets]]
image_directory = "images_a"
cache_directory = "cache"
num_repeats = 2

[[datasets]]
image_directory = "{(tmp_path / 'elsewhere').as_posix()}"
caption_extension = ".caption"
resolution = 256
batch_size = 1
enable_bucket = false
""",
    )
    monkeypatch.chdir(tmp_path / "elsewhere")  # relative paths follow the TOML, not the cwd
    items = load_musubi_toml(config)
    assert [(i.path.name, i.caption) for i in items] == [("a.png", "a photo"), ("a.png", "a photo"), ("b.png", "b caption")]
    assert items[0].path == (tmp_path / "cfg" / "images_a" / "a.png")
    width, height = items[0].bucket
    assert width * height <= 512 * 256 and width > height
    assert items[2].bucket == (256, 256)


def test_toml_buckets_larger_than_the_plan_are_refused(tmp_path):
    """musubi-tuner's default (960x544, no bucketing) on a run planned for 512²: more pixels per step
    than the memory forecast was made for."""
    make_image(tmp_path / "img" / "a.png", size=(300, 300))
    config = write_toml(tmp_path / "d.toml", '[[datasets]]\nimage_directory = "img"\n')
    with pytest.raises(DatasetError, match=r"d.toml \[\[datasets\]\] #1: a.png trains at 960x544, more pixels than "
                                           r"the 512x512 this run is planned for; lower this dataset's resolution"):
        load_musubi_toml(config, resolution=512)
    assert load_musubi_toml(config, resolution=1024)[0].bucket == (960, 544)


def test_toml_musubi_defaults_are_960x544_without_buckets(tmp_path):
    make_image(tmp_path / "img" / "a.png", size=(300, 300))
    config = write_toml(tmp_path / "d.toml", '[[datasets]]\nimage_directory = "img"\n')
    (item,) = load_musubi_toml(config)
    assert item.bucket == (960, 544)


@pytest.mark.parametrize(
    "text, message",
    [
        ('[general]\nresolution = "big"\n[[datasets]]\nimage_directory = "img"\n', "resolution"),
        ('[[datasets]]\nimage_directory = "img"\nnum_repeats = 0\n', "num_repeats"),
        ('[[datasets]]\nimage_directory = "img"\nbatch_size = -1\n', "batch_size"),
        ('[[datasets]]\nimage_directory = "img"\nbatch_size = 4\n', "batch_size = 4: UGPUM takes the batch from the run .* remove batch_size or set it to 1"),
        ('[general]\ntarget_frames = [17]\n[[datasets]]\nimage_directory = "img"\n', "'target_frames' belongs in each \\[\\[datasets\\]\\] table"),
        ('[[datasets]]\nimage_directory = "img"\nenable_bucket = "yes"\n', "enable_bucket"),
        ('[[datasets]]\nimage_directory = "img"\nbucket_no_upscale = 1\n', "bucket_no_upscale"),
        ('[[datasets]]\nimage_directory = "img"\ncaption_extension = 7\n', "caption_extension"),
        ('[[datasets]]\nimage_directory = "img"\nresolution = [512]\n', "resolution"),
        ('[[datasets]]\nimage_directory = "img"\nshuffle_captions = true\n', "unknown key 'shuffle_captions'"),
        ('[general]\nimage_directory = "img"\n[[datasets]]\nimage_directory = "img"\n', "'image_directory' belongs in each \\[\\[datasets\\]\\] table"),
        ('[[datasets]]\nvideo_directory = "vids"\n', "video_directory trains Wan 2.1 models only"),
        ('[[datasets]]\nimage_directory = "img"\nvideo_directory = "img"\n', "both image_directory and video_directory"),
        ('[[datasets]]\nimage_directory = "img"\ntarget_frames = [17]\n', "target_frames only apply to a video_directory"),
        ('[[datasets]]\nimage_jsonl_file = "m.jsonl"\n', "'image_jsonl_file': metadata JSONL files are not supported"),
        ('[[datasets]]\nimage_directory = 3\n', "image_directory must be the path of a folder"),
        ('[[datasets]]\nnum_repeats = 1\n', "image_directory or video_directory is missing"),
        ('[general]\nresolution = 512\n', "at least one \\[\\[datasets\\]\\]"),
        ('[extra]\nx = 1\n[[datasets]]\nimage_directory = "img"\n', "unknown section 'extra'"),
        ('[[datasets]\nimage_directory = "img"\n', "not valid TOML"),
    ],
)
def test_bad_toml_names_the_file_and_key(tmp_path, text, message):
    make_image(tmp_path / "img" / "a.png")
    config = write_toml(tmp_path / "bad.toml", text)
    with pytest.raises(DatasetError, match=message) as caught:
        load_musubi_toml(config)
    assert "bad.toml" in str(caught.value)


def test_missing_toml_names_it(tmp_path):
    with pytest.raises(DatasetError, match=r"missing\.toml does not exist"):
        load_musubi_toml(tmp_path / "missing.toml")


def test_toml_dataset_folder_missing_names_the_folder(tmp_path):
    config = write_toml(tmp_path / "d.toml", '[[datasets]]\nimage_directory = "not_there"\n')
    with pytest.raises(DatasetError, match="not_there"):
        load_musubi_toml(config)


# ---------------------------------------------------------------- confinement


def test_resolve_inside_accepts_paths_inside(tmp_path):
    (tmp_path / "data" / "set").mkdir(parents=True)
    assert resolve_inside(tmp_path, "data/set") == (tmp_path / "data" / "set").resolve()
    assert resolve_inside(tmp_path, "data/../data/set") == (tmp_path / "data" / "set").resolve()


@pytest.mark.parametrize("relative", ["..", "../outside", "data/../../outside", "/etc"])
def test_resolve_inside_rejects_escapes(tmp_path, relative):
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    with pytest.raises(DatasetError, match="outside the allowed folder"):
        resolve_inside(root, relative)


def test_resolve_inside_rejects_symlink_escape(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", root / "link")
    with pytest.raises(DatasetError, match="path 'link' is or passes through a symlink to .*secret, outside the "
                                           "allowed folder .*copy the files into that folder"):
        resolve_inside(root, "link")


def test_a_dataset_root_confines_every_path_the_dataset_names(tmp_path):
    """The command line reads any folder (no dataset_root); the nodes set one (ComfyUI's input/): then a
    TOML's directories, and every image and clip folder inside, must resolve inside it."""
    root, outside = tmp_path / "input", tmp_path / "outside"
    make_image(outside / "a.png")
    make_image(root / "own" / "a.png")
    toml = root / "set.toml"
    toml.write_text('[[datasets]]\nimage_directory = "../outside"\nresolution = 64\nenable_bucket = true\n')
    assert len(load_musubi_toml(toml)) == 1
    assert TrainConfig(dataset=str(toml), resolution=64).validate()               # the command line
    with pytest.raises(DatasetError, match=r"set.toml \[\[datasets\]\] #1: image_directory '../outside' resolves "
                                           r"to .*outside, outside the allowed folder"):
        TrainConfig(dataset=str(toml), resolution=64, dataset_root=str(root)).validate()
    toml.write_text('[[datasets]]\nimage_directory = "own"\n')
    assert TrainConfig(dataset=str(toml), resolution=64, dataset_root=str(root)).validate()
    os.symlink(outside / "a.png", root / "own" / "b.png")                           # a linked image inside
    with pytest.raises(DatasetError, match="b.png in dataset folder .*own is or passes through a symlink"):
        check_inside(root / "own", root)
    (root / "own" / "b.png").unlink()
    make_image(outside / "clip" / "0001.png")
    (root / "own" / "clip").mkdir()
    os.symlink(outside / "clip" / "0001.png", root / "own" / "clip" / "0001.png")  # a linked frame of a clip
    with pytest.raises(DatasetError, match="0001.png in clip folder .*clip is or passes through a symlink"):
        check_inside(toml, root)


# ---------------------------------------------------------------- caption dropout


def test_caption_dropout_rates():
    rng = random.Random(0)
    assert all(caption_dropout("c", 0.0, rng) == "c" for _ in range(1000))
    assert all(caption_dropout("c", 1.0, rng) == "" for _ in range(1000))
    dropped = sum(caption_dropout("c", 0.3, rng) == "" for _ in range(20000))
    assert 0.28 < dropped / 20000 < 0.32


def test_caption_dropout_is_reproducible_and_checks_rate():
    first_rng, again_rng = random.Random(7), random.Random(7)
    first = [caption_dropout("c", 0.5, first_rng) for _ in range(50)]
    again = [caption_dropout("c", 0.5, again_rng) for _ in range(50)]
    assert first == again and "" in first and "c" in first
    with pytest.raises(ValueError, match="between 0 and 1"):
        caption_dropout("c", 1.5, random.Random(0))

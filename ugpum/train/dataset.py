"""Training images and captions: the musubi-tuner convention, aspect-ratio buckets, pixels.

A dataset is a folder of images, each with a same-stem caption file (`cat.png` + `cat.txt`),
or a musubi-tuner dataset TOML listing such folders (musubi_toml.py). Every image is assigned a bucket: a
(width, height) of multiples of 16 (VAE 8x times 2x2 patchify) whose area is about the
training resolution squared, so batches of one bucket share a shape and nothing is squashed.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import random
import re
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
BUCKET_STEP = 16  # latent stride of FLUX.2 / Wan: VAE 8x, then 2x2 patches
MAX_BUCKET_ASPECT = 4.0  # buckets span aspect ratios 1:4 .. 4:1


class DatasetError(ValueError):
    """A dataset folder, file or setting is unusable; the message says which and what to do."""


@dataclass
class ImageItem:
    path: Path
    caption: str
    bucket: tuple[int, int]  # (width, height) in pixels, multiples of 16
    batch_size: int = 1  # what the dataset asked for (1: the run's batch setting decides)


Resolution = int | tuple[int, int]


# ---------------------------------------------------------------- folder confinement


def resolve_inside(root: Path | str, relative: Path | str, what: str = "") -> Path:
    """`root / relative` fully resolved; raises DatasetError if it lands outside `root`, naming `what`
    (default: the path) and why: the path itself, or a symlink on the way.

    Resolving first means `..` and symlinks are judged by where they really point.
    """
    root_resolved = Path(root).resolve()
    candidate = (root_resolved / relative).resolve()
    if not candidate.is_relative_to(root_resolved):
        label = what or f"path {str(relative)!r}"
        named = Path(os.path.normpath(root_resolved / relative))
        if named.is_relative_to(root_resolved):
            raise DatasetError(f"{label} is or passes through a symlink to {candidate}, outside the allowed folder "
                               f"{root_resolved}; copy the files into that folder rather than linking them")
        raise DatasetError(f"{label} resolves to {candidate}, outside the allowed folder {root_resolved}; use a "
                           "path inside that folder")
    return candidate


# ---------------------------------------------------------------- buckets


def _floor_to_step(value: float) -> int:
    return int(value // BUCKET_STEP) * BUCKET_STEP


def _resolution_area(resolution: Resolution) -> int:
    if isinstance(resolution, tuple):
        return resolution[0] * resolution[1]
    return resolution * resolution


def bucket_sizes(target_area: int) -> list[tuple[int, int]]:
    """All (width, height) buckets: multiples of 16, area <= target_area and close to it.

    For each width the height is the largest multiple of 16 that keeps the area under the
    target, so each bucket loses less than one 16-pixel row of area. The set is symmetric:
    a portrait image gets exactly the turned bucket of the same landscape image.
    """
    side = math.sqrt(target_area)
    shortest = max(BUCKET_STEP, _floor_to_step(side / math.sqrt(MAX_BUCKET_ASPECT)))
    longest = _floor_to_step(side * math.sqrt(MAX_BUCKET_ASPECT))
    buckets = set()
    for width in range(shortest, longest + 1, BUCKET_STEP):
        height = _floor_to_step(target_area / width)
        if shortest <= height <= longest:
            buckets.update({(width, height), (height, width)})  # mirrored: portrait = landscape turned
    return sorted(buckets)


def choose_bucket(
    image_size: tuple[int, int], resolution: Resolution, no_upscale: bool = False
) -> tuple[int, int]:
    """The bucket for an image of `image_size` (width, height) at `resolution`.

    Normally: the bucket whose aspect ratio is closest to the image's (compared as log
    ratios so 2:1 and 1:2 are equally far from 1:1; ties go to the larger area).
    With `no_upscale`: the image's own aspect, scaled down only if its area exceeds the
    target, rounded down to multiples of 16 — never bigger than the image on either side.
    """
    width, height = image_size
    target_area = _resolution_area(resolution)
    if no_upscale:
        scale = min(1.0, math.sqrt(target_area / (width * height)))
        bucket = (_floor_to_step(width * scale), _floor_to_step(height * scale))
        if min(bucket) < BUCKET_STEP:
            raise ValueError(f"image of {width}x{height} is smaller than {BUCKET_STEP} pixels on a side")
        return bucket
    image_log_aspect = math.log(width / height)
    return min(
        bucket_sizes(target_area),
        key=lambda b: (abs(math.log(b[0] / b[1]) - image_log_aspect), -b[0] * b[1]),
    )


# ---------------------------------------------------------------- reading files

# Bounds on a training picture, checked from its header before any pixel is decoded:
# - at most 64 megapixels (8192 x 8192): the largest training resolution (4096²) is a quarter of that, so
#   nothing larger adds detail, while decoding it needs 192 MB and more per copy; it is also below
#   Pillow's own decompression-bomb warning (89 MP), so a header claiming more is refused by name here
#   whatever Pillow's limit is set to (ComfyUI or another pack may raise or disable it).
# - at least 16 pixels a side: one latent patch (8x VAE, then 2x2 patches), the smallest bucket side.
#   Smaller, the picture holds not one token of its own at any resolution (a favicon, a spacer pixel);
#   larger small pictures stay allowed: the tiny test models train on 64x48 images.
MAX_IMAGE_PIXELS = 64 * 2**20
MIN_IMAGE_SIDE = 16
_TURNED = (5, 6, 7, 8)        # EXIF orientations that swap width and height
_EOI, _SOS = b"\xff\xd9", b"\xff\xda"


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[Image.Image]:
    """Image.open with its header checked: Pillow's decompression-bomb warning and error, and the size
    bounds above, become a DatasetError naming the file before any pixel is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(path)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        claimed = re.search(r"\((\d+) pixels\)", str(error))
        size = f" ({int(claimed[1]) / 1e6:.0f} megapixels)" if claimed else ""
        raise DatasetError(f"image {path} claims more pixels{size} than Pillow decodes safely (a possible "
                           f"decompression bomb); scale it down to at most {MAX_IMAGE_PIXELS // 2**20} megapixels "
                           "or remove it") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise DatasetError(
            f"cannot read image {path}: {error}; re-save it as PNG or JPEG, or remove it"
        ) from error
    with image:
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise DatasetError(f"image {path} is {width}x{height} ({width * height / 1e6:.0f} megapixels), more "
                               f"than the {MAX_IMAGE_PIXELS // 2**20} megapixels UGPUM decodes (training uses at "
                               "most 4096x4096); scale it down or remove it")
        if min(width, height) < MIN_IMAGE_SIDE:
            raise DatasetError(f"image {path} is {width}x{height}, under {MIN_IMAGE_SIDE} pixels on a side (less than "
                               "one latent patch: nothing to train on); use a larger image or remove it")
        yield image


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation a header gives (1: upright). A PNG's EXIF is read only when it precedes the
    pixels: Pillow would decode the whole image to look for one after them."""
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    try:
        return int(image.getexif().get(0x0112, 1))
    except Exception:  # noqa: BLE001 - a damaged EXIF block is ignored, as exif_transpose does
        return 1


def _complete(image: Image.Image, path: Path) -> bool | None:
    """Whether the file holds all its pixel data, judged without decoding it (None: cannot tell cheaply).
    PNG: every chunk's CRC up to IEND. JPEG: an end-of-image marker after the first scan (0xFF 0xD9
    cannot occur inside entropy-coded data). Uncompressed BMP: the file is as long as its rows."""
    try:
        if image.format == "PNG":
            image.verify()
            return True
        if image.format in ("JPEG", "MPO"):
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                scan = data.find(_SOS)
                return scan >= 0 and data.find(_EOI, scan) >= 0
        if image.format == "BMP" and len(image.tile) == 1 and image.tile[0][0] == "raw":
            tile = image.tile[0]
            row = tile[3][1] if isinstance(tile[3], tuple) and len(tile[3]) > 1 else 0
            return bool(row) and path.stat().st_size >= tile[2] + row * image.size[1]
        return True if image.format == "WEBP" else None      # libwebp refuses a cut file when it opens it
    except (OSError, SyntaxError, ValueError, struct.error) as error:
        raise DatasetError(f"cannot read image {path}: the file is cut short or damaged ({error}); re-save it as "
                           "PNG or JPEG, or remove it") from error


def image_size(path: Path) -> tuple[int, int]:
    """The upright (width, height) of an image file, from its header: no pixel is decoded (they are
    decoded once, when the latent is made), except for a rare format whose completeness cannot be told
    from the file's structure. A file that is cut short, a decompression bomb, or a picture outside the
    bounds above is a DatasetError naming it."""
    with _opened(path) as image:
        width, height = image.size
        turned = _orientation(image) in _TURNED
        complete = _complete(image, path)
    if complete is None:
        return _open_rgb(path).size
    if not complete:
        raise DatasetError(f"cannot read image {path}: the file is truncated (it ends before its image data "
                           "does); re-save it as PNG or JPEG, or remove it")
    return (height, width) if turned else (width, height)


def _open_rgb(path: Path) -> Image.Image:
    """Decode the whole image (so truncated files fail here), upright per EXIF, as RGB."""
    try:
        with _opened(path) as image:
            image.load()
            upright = ImageOps.exif_transpose(image)
            return upright.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        if isinstance(error, DatasetError):
            raise
        raise DatasetError(
            f"cannot read image {path}: {error}; re-save it as PNG or JPEG, or remove it"
        ) from error


_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def _read_caption(path: Path) -> str:
    """A caption as a user's editor wrote it: UTF-8 with or without a byte-order mark (Windows Notepad
    writes one), UTF-16 with its mark ("Unicode" in Notepad); Windows or old Mac line ends; spaces
    at line ends and blank lines around the text dropped (none of it is meant as caption)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-16") if raw[:2] in _UTF16_BOMS else raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise DatasetError(f"caption file {path} is not UTF-8 text; re-save it as UTF-8") from error
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).strip()


def _with_trigger(caption: str, trigger: str) -> str:
    trigger = trigger.strip()
    if not trigger or trigger.lower() in caption.lower():
        return caption
    return f"{trigger}, {caption}" if caption else trigger


def _list_images(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.iterdir()
        if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")
    )


# ---------------------------------------------------------------- settings checks


def _check_positive_int(value, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DatasetError(f"{where}: {name} must be a whole number >= 1, got {value!r}")
    return value


def _check_bool(value, name: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise DatasetError(f"{where}: {name} must be true or false, got {value!r}")
    return value


def _check_resolution(value, where: str) -> Resolution:
    """An int (square side) or a [width, height] pair, each at least 64 pixels."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise DatasetError(f"{where}: resolution must be one number or [width, height], got {value!r}")
        width, height = (_check_positive_int(v, "resolution", where) for v in value)
        parsed: Resolution = (width, height)
    else:
        parsed = _check_positive_int(value, "resolution", where)
    sides = parsed if isinstance(parsed, tuple) else (parsed,)
    if min(sides) < 64:
        raise DatasetError(f"{where}: resolution {value!r} is too small; use at least 64 pixels")
    return parsed


def _check_caption_ext(value, where: str) -> str:
    if not isinstance(value, str) or not value.startswith(".") or len(value) < 2:
        raise DatasetError(f"{where}: caption_extension must look like \".txt\", got {value!r}")
    return value


def fixed_bucket(resolution: Resolution, where: str) -> tuple[int, int]:
    """The one size every picture is cropped to without bucketing (musubi-tuner's enable_bucket = false)."""
    size = resolution if isinstance(resolution, tuple) else (resolution, resolution)
    if any(side % BUCKET_STEP for side in size):
        raise DatasetError(f"{where}: without bucketing, resolution {size} must be multiples of {BUCKET_STEP}")
    return size


def bucket_for(size: tuple[int, int], resolution: Resolution, no_upscale: bool, what: str) -> tuple[int, int]:
    """`choose_bucket` with the picture (`what`: "image PATH", "clip PATH") named when it is too small."""
    try:
        return choose_bucket(size, resolution, no_upscale=no_upscale)
    except ValueError as error:
        kind = what.split(" ", 1)[0]
        raise DatasetError(f"{what}: {error}; use a larger {kind}") from error


# ---------------------------------------------------------------- loading a folder


def checked_folder_settings(folder: Path, caption_ext, resolution, repeats, batch_size):
    """("dataset folder <folder>", and the settings every dataset folder takes, checked); DatasetError
    names the folder and the setting."""
    where = f"dataset folder {folder}"
    checked = (_check_caption_ext(caption_ext, where), _check_resolution(resolution, where),
               _check_positive_int(repeats, "repeats", where), _check_positive_int(batch_size, "batch_size", where))
    if not folder.is_dir():
        raise DatasetError(f"{where} does not exist or is not a folder; check the path")
    return (where, *checked)


def load_image_folder(
    folder: Path | str,
    caption_ext: str = ".txt",
    resolution: Resolution = 1024,
    repeats: int = 1,
    trigger: str = "",
    enable_bucket: bool = True,
    bucket_no_upscale: bool = False,
    batch_size: int = 1,
) -> list[ImageItem]:
    """Every image in `folder` (not its subfolders) with its caption and bucket.

    Each image appears `repeats` times. `trigger` is put in front of captions that do
    not already contain it. Without bucketing every image is cropped to `resolution`.
    """
    folder = Path(folder)
    where, caption_ext, resolution, repeats, batch_size = checked_folder_settings(
        folder, caption_ext, resolution, repeats, batch_size)
    image_paths = _list_images(folder)
    if not image_paths:
        raise DatasetError(
            f"{where} holds no images ({', '.join(IMAGE_EXTENSIONS)}); put the training images there"
        )

    fixed = None if enable_bucket else fixed_bucket(resolution, where)

    items = []
    for image_path in image_paths:
        caption_path = image_path.with_suffix(caption_ext)
        if not caption_path.is_file():
            raise DatasetError(
                f"image {image_path} has no caption file {caption_path.name}; "
                f"add one (it may be empty) or remove the image"
            )
        caption = _with_trigger(_read_caption(caption_path), trigger)
        size = image_size(image_path)                   # header only: the pixels are decoded once, for the latent
        bucket = fixed or bucket_for(size, resolution, bucket_no_upscale, f"image {image_path}")
        items.extend(ImageItem(image_path, caption, bucket, batch_size) for _ in range(repeats))
    return items


# ---------------------------------------------------------------- pixels and captions


def load_bucketed_image(item: ImageItem) -> torch.Tensor:
    """The image as a [3, H, W] float tensor in [-1, 1], H x W = the item's bucket.

    Scaled (aspect kept) until it covers the bucket, then centre-cropped: no stretching.
    """
    return fit_to_bucket(_open_rgb(item.path), item.bucket)


def fit_to_bucket(image: Image.Image, bucket: tuple[int, int]) -> torch.Tensor:
    """An RGB picture scaled (aspect kept) to cover `bucket`, centre-cropped to it, as [3, H, W] in [-1, 1]."""
    bucket_width, bucket_height = bucket
    scale = max(bucket_width / image.width, bucket_height / image.height)
    resized_size = (
        max(bucket_width, round(image.width * scale)),
        max(bucket_height, round(image.height * scale)),
    )
    if resized_size != image.size:
        image = image.resize(resized_size, Image.Resampling.LANCZOS)
    left = (image.width - bucket_width) // 2
    top = (image.height - bucket_height) // 2
    image = image.crop((left, top, left + bucket_width, top + bucket_height))
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(bucket_height, bucket_width, 3).permute(2, 0, 1)
    return pixels.float() / 127.5 - 1.0


def caption_dropout(caption: str, rate: float, rng: random.Random) -> str:
    """"" with probability `rate` (trains the unconditional case for CFG), else `caption`."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"caption dropout rate must be between 0 and 1, got {rate}")
    return "" if rng.random() < rate else caption

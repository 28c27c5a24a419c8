"""Training images and captions: the musubi-tuner convention, aspect-ratio buckets, pixels.

A dataset is a folder of images, each with a same-stem caption file (`cat.png` + `cat.txt`),
or a musubi-tuner dataset TOML listing such folders (musubi_toml.py). Every image is assigned a bucket: a
(width, height) of multiples of 16 (VAE 8x times 2x2 patchify) whose area is about the
training resolution squared, so batches of one bucket share a shape and nothing is squashed.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from ..folders import read_fix, read_reason, shown_path
from ..wording import quoted
from .errors import DatasetError
from .pictures import (IMAGE_EXTENSIONS, MAX_IMAGE_PIXELS, MIN_IMAGE_SIDE, image_size, is_picture,  # noqa: F401
                       open_rgb, skipped_note, skipped_pictures)

BUCKET_STEP = 16  # latent stride of FLUX.2 / Wan: VAE 8x, then 2x2 patches
MAX_BUCKET_ASPECT = 4.0  # buckets span aspect ratios 1:4 .. 4:1


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
    try:
        candidate = (root_resolved / relative).resolve()
    except (OSError, RuntimeError) as error:            # a name too long, a symlink loop (RuntimeError before 3.13)
        why = read_reason(error) if isinstance(error, OSError) else "it is a symlink that loops back on itself"
        raise DatasetError(f"{what or f'path {quoted(str(relative))}'} cannot be looked up: {why}; use a path "
                           f"inside {root_resolved}") from None
    if not candidate.is_relative_to(root_resolved):
        label = what or f"path {quoted(str(relative))}"
        named = Path(os.path.normpath(root_resolved / relative))
        if named.is_relative_to(root_resolved):
            raise DatasetError(f"{label} is or passes through a symlink to {shown_path(candidate)}, outside the "
                               f"allowed folder {root_resolved}; copy the files into that folder rather than linking "
                               "them")
        raise DatasetError(f"{label} resolves to {shown_path(candidate)}, outside the allowed folder {root_resolved}; "
                           "use a path inside that folder")
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
# (pictures: pictures.py; re-exported here for the callers that read a dataset)

_BOMS = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"), (b"\xff\xfe", "utf-16"),
         (b"\xfe\xff", "utf-16"), (b"\xef\xbb\xbf", "utf-8-sig"))


def _bomless_utf16(raw: bytes) -> str | None:
    """"utf-16-le" or "utf-16-be" when `raw` reads as UTF-16 written without a byte-order mark (every
    Latin character then has a NUL byte beside it: after it little-endian, before it big-endian)."""
    if len(raw) < 2 or len(raw) % 2:
        return None
    odd, even = raw[1::2].count(0), raw[0::2].count(0)
    if odd > len(raw) // 4 and even == 0:
        return "utf-16-le"
    if even > len(raw) // 4 and odd == 0:
        return "utf-16-be"
    return None


def decode_caption(raw: bytes, path: Path) -> str:
    """A caption file's bytes as text, as a user's editor wrote them: UTF-8 with or without a byte-order
    mark (Windows Notepad writes one), UTF-16 or UTF-32 with their mark ("Unicode" in Notepad), UTF-16
    without one (told by the NUL byte beside each Latin character); anything else holding NUL bytes, or
    not UTF-8, is refused by name."""
    encoding = next((name for bom, name in _BOMS if raw.startswith(bom)), None) or _bomless_utf16(raw) or "utf-8"
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as error:
        raise DatasetError(f"caption file {path} is not UTF-8 text; re-save it as UTF-8") from error
    if "\x00" in text:
        raise DatasetError(f"caption file {path} holds NUL characters, so it is not plain text (nor UTF-16 text); "
                           "re-save it as UTF-8")
    return text.removeprefix("\ufeff")


def read_caption(path: Path) -> str:
    """A caption file's text (`decode_caption`), Windows or old Mac line ends made plain; spaces at line
    ends and blank lines around the text dropped (none of it is meant as caption). A file that cannot
    be read is a DatasetError saying why and what to do."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise DatasetError(f"cannot read caption file {path}: {read_reason(error)}; {read_fix(error, path)}") \
            from None
    text = decode_caption(raw, path)
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).strip()


def caption_for(picture: Path, caption_path: Path, what: str = "image") -> str:
    """The caption beside `picture` (an image, or a clip), read; DatasetError naming both when it is
    missing, or is no file."""
    if not caption_path.is_file():
        if caption_path.exists():
            raise DatasetError(f"{what} {picture}: its caption {caption_path.name} is a folder or other "
                               f"non-file, not a text file; replace it by a caption file (it may be empty)")
        raise DatasetError(f"{what} {picture} has no caption file {caption_path.name}; "
                           f"add one (it may be empty) or remove the {what}")
    return read_caption(caption_path)


def _with_trigger(caption: str, trigger: str) -> str:
    trigger = trigger.strip()
    if not trigger or trigger.lower() in caption.lower():
        return caption
    return f"{trigger}, {caption}" if caption else trigger


def list_pictures(folder: Path) -> list[Path]:
    """The pictures directly inside `folder` UGPUM trains on, by name; DatasetError when the folder
    cannot be read."""
    try:
        return sorted(p for p in folder.iterdir() if is_picture(p))
    except OSError as error:
        raise DatasetError(f"cannot read dataset folder {folder}: {read_reason(error)}; "
                           f"{read_fix(error, folder, 'folder')}") from None


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
    log=print,
) -> list[ImageItem]:
    """Every image in `folder` (not its subfolders) with its caption and bucket.

    Each image appears `repeats` times. `trigger` is put in front of captions that do
    not already contain it. Without bucketing every image is cropped to `resolution`.
    `log` hears of an image with damaged metadata.
    """
    folder = Path(folder)
    where, caption_ext, resolution, repeats, batch_size = checked_folder_settings(
        folder, caption_ext, resolution, repeats, batch_size)
    image_paths = list_pictures(folder)
    if not image_paths:
        skipped = skipped_pictures(folder)
        held = f"; it {skipped_note(skipped)}" if skipped else ""
        raise DatasetError(f"{where} holds no images ({', '.join(IMAGE_EXTENSIONS)}); put the training images "
                           f"there{held}")

    fixed = None if enable_bucket else fixed_bucket(resolution, where)

    items = []
    for image_path in image_paths:
        caption = _with_trigger(caption_for(image_path, image_path.with_suffix(caption_ext)), trigger)
        size = image_size(image_path, log)              # header only: the pixels are decoded once, for the latent
        bucket = fixed or bucket_for(size, resolution, bucket_no_upscale, f"image {image_path}")
        items.extend(ImageItem(image_path, caption, bucket, batch_size) for _ in range(repeats))
    return items


# ---------------------------------------------------------------- pixels and captions


def load_bucketed_image(item: ImageItem) -> torch.Tensor:
    """The image as a [3, H, W] float tensor in [-1, 1], H x W = the item's bucket.

    Scaled (aspect kept) until it covers the bucket, then centre-cropped: no stretching.
    """
    return fit_to_bucket(open_rgb(item.path), item.bucket)


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

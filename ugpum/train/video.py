"""Training clips for a family that takes them (Wan 2.1): video files or folders of numbered frames, each
with a caption.

A clip dataset is a folder holding video files (`walk.mp4` + `walk.txt`) and/or sub-folders of
numbered frame images (`wave/0001.png ...` + `wave.txt`); loose images beside them train as single
frames. Each clip gives its first `frames` frames (every `stride`-th one from the start), resized and
centre-cropped to the clip's bucket exactly like an image. Which frame counts a model takes is its
family's (`ArchSpec.frames_error`; Wan's VAE compresses time 4x after the first frame, so 4k+1). Videos
are decoded with PyAV (`av`, which ComfyUI itself requires).
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from PIL import Image

from ..arch import FAMILIES, family_of
from ..arch.base import ArchSpec
from ..folders import read_fix, read_reason
from .dataset import (DatasetError, ImageItem, Resolution, _check_positive_int, _with_trigger, bucket_for,
                      caption_for, checked_folder_settings, fit_to_bucket, fixed_bucket, image_size, list_pictures,
                      load_image_folder, open_rgb)

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov")


@dataclass
class ClipItem(ImageItem):
    """One training clip: `path` is a video file or a folder of numbered frames."""
    frames: int = 17             # frames taken from the start of the clip (as many as the model takes)
    stride: int = 1              # take every stride-th frame


def check_frames(frames, where: str, spec: ArchSpec) -> int:
    """`frames` when `spec`'s model takes that many frames of a clip, else a DatasetError saying why."""
    whole = not isinstance(frames, bool) and isinstance(frames, int)
    problem = spec.frames_error(frames if whole else 0)
    if problem:
        raise DatasetError(f"{where}: frames = {frames!r}, but {problem}")
    return frames


# ---------------------------------------------------------------- finding clips


def _is_video(p: Path) -> bool:
    return p.is_file() and p.suffix.lower() in VIDEO_EXTENSIONS and not p.name.startswith(".")


def _is_frame_folder(p: Path) -> bool:
    """A sub-folder of images with a caption beside it (`wave/` + `wave.txt`): an uncaptioned
    sub-folder (raw photos, rejects) is not a clip and is ignored as before (even one this user cannot
    read); a captioned one that cannot be read is a DatasetError naming it."""
    return (p.is_dir() and not p.name.startswith(".")
            and any(q.is_file() for q in p.parent.glob(glob.escape(p.name) + ".*")) and bool(list_pictures(p)))


def list_clips(folder: Path) -> list[Path]:
    """Video files and frame folders directly inside `folder`, sorted by name."""
    try:
        entries = sorted(folder.iterdir())
    except OSError as error:
        raise DatasetError(f"cannot read dataset folder {folder}: {read_reason(error)}; "
                           f"{read_fix(error, folder, 'folder')}") from None
    return [p for p in entries if _is_video(p) or _is_frame_folder(p)]


def numbered_frames(folder: Path) -> list[Path]:
    """A frame folder's images in frame order: by the last number in each name (frame_2 before frame_10)."""
    numbered = []
    for p in list_pictures(folder):
        found = re.findall(r"\d+", p.stem)
        if not found:
            raise DatasetError(f"frame folder {folder}: {p.name} has no frame number in its name; name the "
                               "frames 0001.png, 0002.png, ... (any image type) or move the file out")
        numbered.append((int(found[-1]), p))
    numbered.sort()
    for (a, pa), (b, pb) in zip(numbered, numbered[1:]):
        if a == b:
            raise DatasetError(f"frame folder {folder}: {pa.name} and {pb.name} are both frame {a}; "
                               "give every frame its own number")
    return [p for _, p in numbered]


# ---------------------------------------------------------------- decoding


def _av():
    try:
        import av
    except ImportError:
        raise DatasetError("video clips need PyAV: pip install av (ComfyUI installs it)") from None
    return av


def _video_frames(path: Path) -> Iterator[Image.Image]:
    """Every frame of a video file's first video stream, decoded in order, as RGB."""
    av = _av()
    undecodable = (av.FFmpegError, UnicodeDecodeError, ValueError, OSError)
    advice = "re-encode it (e.g. ffmpeg -i IN -c:v libx264 -pix_fmt yuv420p OUT.mp4) or remove it"
    try:
        container = av.open(str(path))
    except undecodable as error:
        raise DatasetError(f"cannot open video {path}: {error}; {advice}") from error
    with container:
        if not container.streams.video:
            raise DatasetError(f"video {path} holds no video stream; {advice}")
        try:
            for frame in container.decode(video=0):
                yield frame.to_image().convert("RGB")
        except undecodable as error:
            raise DatasetError(f"cannot decode video {path}: {error}; {advice}") from error


def _folder_frames(folder: Path) -> Iterator[Image.Image]:
    size = None
    for p in numbered_frames(folder):
        image = open_rgb(p)
        if size is not None and image.size != size:
            raise DatasetError(f"frame folder {folder}: {p.name} is {image.width}x{image.height}, the frames "
                               f"before it {size[0]}x{size[1]}; give every frame one size")
        size = image.size
        yield image


def _all_frames(source: Path) -> Iterator[Image.Image]:
    return _folder_frames(source) if source.is_dir() else _video_frames(source)


def read_frames(source: Path, frames: int, stride: int = 1, settings: tuple[str, str] = ("frames", "the frame stride"),
                spec: ArchSpec | None = None) -> list[Image.Image]:
    """`frames` frames from the start of a clip (frame 0, stride, 2 stride, ...); DatasetError when the
    clip is shorter, naming how many frames it has and what to change (`settings`: where the frames and
    the stride are set; `spec`: the model, whose frame counts it names)."""
    needed = 1 + (frames - 1) * stride
    taken, count = [], 0
    with contextlib.closing(_all_frames(source)) as decoded:      # stop decoding (and close the file) early
        for index, image in enumerate(decoded):
            count = index + 1
            if index % stride == 0:
                taken.append(image)
            if count == needed:
                return taken
    raise _too_short(source, count, frames, stride, settings, spec)


def _too_short(source: Path, count: int, frames: int, stride: int, settings: tuple[str, str],
               spec: ArchSpec | None) -> DatasetError:
    needed = 1 + (frames - 1) * stride
    kind = "frame folder" if source.is_dir() else "video"
    per_clip = f"{frames} frames" + (f" at stride {stride} ({needed} frames)" if stride > 1 else "")
    fits = spec.frames_within(1 + max(count - 1, 0) // stride) if spec else 1     # the most frames it gives
    hint = f"set {settings[0]} to {fits} or fewer" if fits > 1 else "use a longer clip"
    return DatasetError(f"{kind} {source} has {count} frame(s), but training takes {per_clip} from its start; "
                        f"{hint}{f', lower {settings[1]}' if stride > 1 else ''}, or remove the clip")


def first_frame_size(source: Path, frames: int, stride: int = 1,
                     settings: tuple[str, str] = ("frames", "the frame stride"),
                     spec: ArchSpec | None = None, log=print) -> tuple[int, int]:
    """The (width, height) of a clip's first frame, once the clip is known to hold the frames training
    takes. A frame folder is judged from its file names and its frames' headers (every frame taken must
    have the first one's size): its pixels are decoded once, for the latent. A video is decoded up to
    those frames (its frame count is known only by decoding)."""
    if not source.is_dir():
        return read_frames(source, frames, stride, settings, spec)[0].size
    paths = numbered_frames(source)
    needed = 1 + (frames - 1) * stride
    if len(paths) < needed:
        raise _too_short(source, len(paths), frames, stride, settings, spec)
    size = image_size(paths[0], log)
    for p in paths[1:needed]:
        other = image_size(p, log)
        if other != size:
            raise DatasetError(f"frame folder {source}: {p.name} is {other[0]}x{other[1]}, the frames "
                               f"before it {size[0]}x{size[1]}; give every frame one size")
    return size


def load_bucketed_clip(item: ClipItem) -> torch.Tensor:
    """The clip's frames as [T, 3, H, W] in [-1, 1], each scaled and centre-cropped to the bucket."""
    return torch.stack([fit_to_bucket(f, item.bucket) for f in read_frames(item.path, item.frames, item.stride)])


def content_digest(path: Path) -> bytes:
    """What a picture or clip holds: sha256 over a file's bytes' sha256, or over a frame folder's frame
    names and their bytes' sha256 in frame order."""
    h = hashlib.sha256()
    files = numbered_frames(path) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(f.name.encode() + b"\0")
        with open(f, "rb") as stream:
            h.update(hashlib.file_digest(stream, "sha256").digest())
    return h.digest()


# ---------------------------------------------------------------- loading a folder


def folder_has_clips(folder: Path) -> bool:
    return folder.is_dir() and bool(list_clips(folder))


def load_clip_folder(
    folder: Path | str,
    spec: ArchSpec,
    frames: int,
    stride: int = 1,
    caption_ext: str = ".txt",
    resolution: Resolution = 640,
    repeats: int = 1,
    trigger: str = "",
    batch_size: int = 1,
    log=print,
) -> list[ImageItem]:
    """Every clip (video file or frame folder) in `folder`, plus its loose images as single frames."""
    folder = Path(folder)
    where = f"dataset folder {folder}"
    frames = check_frames(frames, where, spec)
    if frames == 1 and folder_has_clips(folder):
        raise DatasetError(f"{where} holds clips ({list_clips(folder)[0].name}, ...) but frames is 1; set frames "
                           f"to {_clip_examples(spec)} to train on clips, or remove the clips to train on images")
    items = clip_items(folder, spec, frames, stride, caption_ext=caption_ext, resolution=resolution, repeats=repeats,
                       trigger=trigger, batch_size=batch_size, log=log)
    if list_pictures(folder):
        items += load_image_folder(folder, caption_ext, resolution, repeats, trigger, batch_size=batch_size, log=log)
    return items


# What a dataset folder of clips takes beside its frames: load_image_folder's settings, with their defaults
FOLDER_SETTINGS = dict(caption_ext=".txt", resolution=640, repeats=1, trigger="", batch_size=1, enable_bucket=True,
                       bucket_no_upscale=False, log=print)


def clip_items(folder: Path, spec: ArchSpec, frames: int, stride: int = 1,
               settings: tuple[str, str] = ("frames", "the frame stride"), **folder_settings) -> list[ClipItem]:
    """The clips (video files and frame folders) in `folder`, each giving its first `frames` frames;
    `folder_settings`: any of FOLDER_SETTINGS (caption_ext, resolution, ... as load_image_folder takes them).

    A clip's caption is the same-stem caption file beside it (`walk.mp4` / `walk/` -> `walk.txt`).
    Each clip is read up to the frames it needs now, so a short or broken clip is reported before
    any training work starts. Its bucket is chosen from its first frame like an image's (or, without
    bucketing, `resolution` exactly). `settings` names the frames and stride settings in messages.
    """
    unknown = set(folder_settings) - set(FOLDER_SETTINGS)
    if unknown:
        raise TypeError(f"clip_items: no setting {', '.join(sorted(unknown))}")
    f = {**FOLDER_SETTINGS, **folder_settings}
    trigger, bucket_no_upscale, log = f["trigger"], f["bucket_no_upscale"], f["log"]
    where, caption_ext, resolution, repeats, batch_size = checked_folder_settings(
        folder, f["caption_ext"], f["resolution"], f["repeats"], f["batch_size"])
    frames = check_frames(frames, where, spec)
    stride = _check_positive_int(stride, "frame stride", where)
    clips = list_clips(folder)
    if not clips:
        raise DatasetError(f"{where} holds no clips ({', '.join(VIDEO_EXTENSIONS)} files or folders of "
                           "numbered frames); put the training clips there")
    fixed = None if f["enable_bucket"] else fixed_bucket(resolution, where)
    items: list[ClipItem] = []
    for clip in clips:
        caption_path = clip.with_name(clip.stem + caption_ext) if clip.is_file() else clip.with_name(clip.name + caption_ext)
        caption = _with_trigger(caption_for(clip, caption_path, "clip"), trigger)
        first = first_frame_size(clip, frames, stride, settings, spec, log)
        bucket = fixed or bucket_for(first, resolution, bucket_no_upscale, f"clip {clip}")
        items.extend(ClipItem(clip, caption, bucket, batch_size, frames, stride) for _ in range(repeats))
    return items


def load_folder(folder: Path | str, spec: ArchSpec, frames: int = 1, stride: int = 1, resolution: Resolution = 1024,
                repeats: int = 1, trigger: str = "", log=print) -> list[ImageItem]:
    """A dataset folder for `spec`'s model: clips (a family that takes them) when it holds any, else images."""
    folder = Path(folder)
    if folder_has_clips(folder):
        if not spec.takes_clips:
            clip, takers = list_clips(folder)[0], " or ".join(f"{f.title} model" for f in FAMILIES if f.takes_clips)
            raise DatasetError(f"dataset folder {folder} holds video clips ({clip.name}, ...), but "
                               f"{family_of(spec).title} models train on images only; train clips on a {takers}, "
                               "or use a folder of images")
        return load_clip_folder(folder, spec, frames, stride, resolution=resolution, repeats=repeats, trigger=trigger,
                                log=log)
    return load_image_folder(folder, resolution=resolution, repeats=repeats, trigger=trigger, log=log)


def _clip_examples(spec: ArchSpec) -> str:
    """Frame counts of a clip `spec`'s model takes, as an example (Wan: 17 or 33)."""
    small, large = spec.frames_within(17), spec.frames_within(33)
    return f"a count the model takes (e.g. {small} or {large})"

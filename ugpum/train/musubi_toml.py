"""musubi-tuner dataset TOMLs: a [general] table of defaults and [[datasets]] tables, each an image
folder (image_directory) or, for Wan 2.1, a clip folder (video_directory).

Defaults follow musubi-tuner (docs/dataset_config.md in kohya-ss/musubi-tuner): resolution
[960, 544], no bucketing, clips cut with frame_extraction "head" (each clip's first frames); captions
are ".txt" files unless caption_extension says otherwise. Where UGPUM differs it says so instead of
guessing:
- target_frames defaults to the run's frames (musubi-tuner: [1]). Every value must be 4k+1 (musubi-
  tuner rounds down) and at most the run's frames, the clip length the memory plan was made for. A
  clip shorter than a value is an error naming it (musubi-tuner skips that clip for that value).
- Buckets may not exceed the area the run is planned for (resolution²); batch_size must be 1 (the
  batch is the run's setting, which the memory plan is made for).
- Of the frame extractions only "head"; the keys of the others (frame_stride, frame_sample,
  max_frames) are refused.
- source_fps must be a whole multiple of Wan's 16 fps (16.0, 32.0, 48.0 ...): it becomes the frame
  stride. musubi-tuner drops frames to reach any rate.
- Metadata JSONL files and control images are refused.
"""
from __future__ import annotations

import math
import tomllib
from pathlib import Path

from ..arch import FAMILIES, family_of
from ..arch.base import ArchSpec
from ..folders import read_fix, read_reason
from ..wording import setting
from .dataset import (DatasetError, ImageItem, Resolution, _check_bool, _check_caption_ext, _check_positive_int,
                      _check_resolution, load_image_folder, resolve_inside)

_COMMON_KEYS = {"caption_extension", "resolution", "batch_size", "num_repeats", "enable_bucket", "bucket_no_upscale"}
_IMAGE_KEYS = {"image_directory"}
_VIDEO_KEYS = {"video_directory", "target_frames", "frame_extraction", "source_fps"}
# musubi-tuner's own cache and debug view: read, and said to have no effect here (`_said_ignored`)
_IGNORED_KEYS = {"cache_directory": "musubi-tuner's latent cache (UGPUM caches features in the run's cache_dir)",
                 "debug_dataset": "musubi-tuner's dataset viewer"}
_REFUSED_KEYS = {
    "image_jsonl_file": "metadata JSONL files are not supported; use image_directory with caption files",
    "video_jsonl_file": "metadata JSONL files are not supported; use video_directory with caption files",
    "control_directory": "control images are not supported (UGPUM trains text-to-image and text-to-video LoRAs)",
    "multiple_target": "layered (multiple-target) training is not supported",
    **{key: "it belongs to a frame_extraction other than \"head\", which UGPUM does not support (it takes each "
            "clip's first frames); remove it" for key in ("frame_stride", "frame_sample", "max_frames")},
}
_DEFAULTS = {
    "caption_extension": ".txt", "resolution": (960, 544), "batch_size": 1, "num_repeats": 1,
    "enable_bucket": False, "bucket_no_upscale": False,
}


def _check_table_keys(table: dict, allowed: set[str], where: str) -> None:
    """Refuse a key that `where` may not hold, naming it and why (musubi-tuner's own keys pass)."""
    for key in table:
        if key in _REFUSED_KEYS:
            raise DatasetError(f"{where}: {key!r}: {_REFUSED_KEYS[key]}")
        if key in _VIDEO_KEYS | _IMAGE_KEYS and key not in allowed:
            raise DatasetError(f"{where}: {key!r} belongs in each [[datasets]] table, not in [general]")
        if key not in allowed | _IGNORED_KEYS.keys():
            raise DatasetError(f"{where}: unknown key {key!r}; allowed keys are {', '.join(sorted(allowed))}")


def _said_ignored(path: Path, general: dict, datasets: list[dict], log) -> None:
    """musubi-tuner's own keys in the file: read, and said to change nothing here (never dropped unsaid)."""
    found = sorted({key for table in (general, *datasets) for key in table if key in _IGNORED_KEYS})
    if found:
        what = "; ".join(f"{key}: {_IGNORED_KEYS[key]}" for key in found)
        log(f"note: dataset config {path}: {', '.join(found)} {'change' if len(found) > 1 else 'changes'} nothing "
            f"in UGPUM ({what}); the run trains as without {'them' if len(found) > 1 else 'it'}")


def load_musubi_toml(path: Path | str, trigger: str = "", spec: ArchSpec | None = None, frames: int = 1,
                     stride: int = 1, resolution: Resolution | None = None, log=print) -> list[ImageItem]:
    """Items of every [[datasets]] entry, in order. `spec`, `frames`, `stride` and `resolution` are
    the run's: clips need a model that takes them (None: images only); `frames` is the longest clip
    length allowed and target_frames' default; `stride` applies to video datasets without source_fps;
    no bucket may exceed `resolution`'s area (None: no limit). A relative directory is taken from the
    TOML's folder. `log` hears of musubi-tuner's own keys, which change nothing here."""
    path = Path(path)
    general, datasets = _read(path)
    _said_ignored(path, general, datasets, log)
    items: list[ImageItem] = []
    for index, dataset in enumerate(datasets):
        where = f"dataset config {path} [[datasets]] #{index + 1}"
        _check_table_keys(dataset, _COMMON_KEYS | _IMAGE_KEYS | _VIDEO_KEYS, where)
        settings = {**_DEFAULTS, **general, **dataset}
        common = dict(
            caption_ext=_check_caption_ext(settings["caption_extension"], where),
            resolution=_check_resolution(settings["resolution"], where),
            repeats=_check_positive_int(settings["num_repeats"], "num_repeats", where),
            trigger=trigger,
            enable_bucket=_check_bool(settings["enable_bucket"], "enable_bucket", where),
            bucket_no_upscale=_check_bool(settings["bucket_no_upscale"], "bucket_no_upscale", where),
            batch_size=_check_positive_int(settings["batch_size"], "batch_size", where),
            log=log,
        )
        if common["batch_size"] != 1:
            raise DatasetError(f"{where}: batch_size = {common['batch_size']}: UGPUM takes the batch from the run "
                               f"({setting('batch')}), which its memory plan is made for; remove batch_size or "
                               "set it to 1")
        has_images, has_clips = "image_directory" in dataset, "video_directory" in dataset
        if has_images == has_clips:
            raise DatasetError(f"{where}: has both image_directory and video_directory; give each its own "
                               "[[datasets]] table" if has_images else
                               f"{where}: image_directory or video_directory is missing; set one to the folder "
                               "of images or clips")
        if has_clips:
            found = _video_dataset(path, settings, where, common, spec, frames, stride)
        else:
            video_only = sorted(_VIDEO_KEYS & dataset.keys())
            if video_only:
                raise DatasetError(f"{where}: {', '.join(video_only)} only apply to a video_directory dataset")
            found = load_image_folder(path.parent / _directory(settings, "image_directory", where), **common)
        _check_area(found, resolution, where)
        items += found
    return items


def _read(path: Path) -> tuple[dict, list[dict]]:
    """([general], [[datasets]]) of a dataset TOML, its sections and [general]'s keys checked."""
    try:
        config = tomllib.loads(path.read_text(encoding="utf-8-sig"))   # (a BOM, as Notepad writes one, is no TOML)
    except FileNotFoundError as error:
        raise DatasetError(f"dataset config {path} does not exist; check the path") from error
    except OSError as error:
        raise DatasetError(f"cannot read dataset config {path}: {read_reason(error)}; {read_fix(error, path)}") \
            from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise DatasetError(f"dataset config {path} is not valid TOML: {error}") from error

    for key in config:
        if key not in ("general", "datasets"):
            raise DatasetError(f"dataset config {path}: unknown section {key!r}; use [general] and [[datasets]]")
    general = config.get("general", {})
    datasets = config.get("datasets", [])
    if not isinstance(general, dict):
        raise DatasetError(f"dataset config {path}: [general] must be a table")
    if not isinstance(datasets, list) or not datasets or not all(isinstance(d, dict) for d in datasets):
        raise DatasetError(f"dataset config {path}: needs at least one [[datasets]] table with image_directory "
                           "or video_directory")
    _check_table_keys(general, _COMMON_KEYS, f"dataset config {path} [general]")
    return general, datasets


def check_inside(dataset: Path | str, root: Path | str) -> None:
    """Where a dataset may only be read inside `root` (the nodes: ComfyUI's input/ folder), every path it
    names resolves there: the dataset folder or TOML, each image_directory and video_directory of a TOML,
    and every file and clip folder in those folders (a symlink counts where it points). DatasetError
    names the path and why otherwise. The command line reads any folder its user names."""
    path = resolve_inside(root, dataset, f"dataset {dataset}")
    folders = [path]
    if path.suffix == ".toml" and path.is_file():
        for index, table in enumerate(_read(path)[1]):
            where = f"dataset config {path} [[datasets]] #{index + 1}"
            for key in ("image_directory", "video_directory"):
                if key in table:
                    named = _directory(table, key, where)
                    folders.append(resolve_inside(root, path.parent / named, f"{where}: {key} {named!r}"))
    def entries(folder: Path) -> list[Path]:
        return sorted(folder.iterdir()) if folder.is_dir() else []
    for folder in folders:
        for entry in entries(folder):
            inside = resolve_inside(root, entry, f"{entry.name} in dataset folder {folder}")
            for frame in entries(inside):                     # a clip's folder of frames
                resolve_inside(root, frame, f"{frame.name} in clip folder {inside}")


def _check_area(items: list[ImageItem], resolution: Resolution | None, where: str) -> None:
    """The memory plan holds for buckets up to the run's resolution²; a larger one could run out."""
    if resolution is None or not items:
        return
    planned = resolution if isinstance(resolution, tuple) else (resolution, resolution)
    largest = max(items, key=lambda i: i.bucket[0] * i.bucket[1])
    width, height = largest.bucket
    if width * height > planned[0] * planned[1]:
        raise DatasetError(f"{where}: {largest.path.name} trains at {width}x{height}, more pixels than the "
                           f"{planned[0]}x{planned[1]} this run is planned for; lower this dataset's resolution "
                           "(or set enable_bucket = true), or plan for a larger resolution")


def _directory(settings: dict, key: str, where: str) -> str:
    directory = settings[key]
    if not isinstance(directory, str) or not directory:
        raise DatasetError(f"{where}: {key} must be the path of a folder, got {directory!r}")
    return directory


def _video_dataset(path: Path, settings: dict, where: str, common: dict, spec: ArchSpec | None, frames: int,
                   stride: int) -> list[ImageItem]:
    from .video import check_frames, clip_items
    if spec is None or not spec.takes_clips:
        titles = " or ".join(f.title for f in FAMILIES if f.takes_clips)
        model = f"this run's model is {spec.family}" if spec else "this run's model takes images only"
        raise DatasetError(f"{where}: video_directory trains {titles} models only; {model}: use a {titles} model, "
                           "or an image_directory")
    folder = path.parent / _directory(settings, "video_directory", where)
    extraction = settings.get("frame_extraction", "head")
    if extraction != "head":
        raise DatasetError(f"{where}: frame_extraction = {extraction!r}: UGPUM takes each clip's first frames "
                           "(\"head\") only; set frame_extraction = \"head\" or remove it")
    if "source_fps" in settings:
        stride, stride_setting = _stride_from_fps(settings["source_fps"], where, spec), f"{where}'s source_fps"
    else:
        stride_setting = "the frame stride"
    if "target_frames" not in settings and frames == 1:
        raise DatasetError(f"{where}: a video_directory, but this run's frames is 1; set frames to a count the model "
                           f"takes (e.g. {spec.frames_within(17)}) to train on clips, or target_frames = [1] to train "
                           "on their first frames")
    targets = settings.get("target_frames", [frames])
    if not isinstance(targets, list) or not targets:
        raise DatasetError(f"{where}: target_frames must be a list of frame counts such as [1, 17], got {targets!r}")
    items: list[ImageItem] = []
    checked = [check_frames(target, f"{where} target_frames", spec) for target in targets]
    for target in dict.fromkeys(checked):                   # each value once, as musubi-tuner takes them
        if target > frames:
            raise DatasetError(f"{where}: target_frames holds {target}, more than the {frames} frames this run "
                               f"is planned for; set frames to {target} ({setting('frames', target)}), or "
                               "lower target_frames")
        items += clip_items(folder, spec, target, stride, **common,
                            settings=(f"{where}'s target_frames", stride_setting))
    return items


def _stride_from_fps(source_fps, where: str, spec: ArchSpec) -> int:
    """Every n-th frame brings a `source_fps` clip to the model's frame rate (Wan: 16 fps); only whole n are taken."""
    fps = spec.frame_rate
    if (isinstance(source_fps, bool) or not isinstance(source_fps, (int, float)) or not math.isfinite(source_fps)
            or source_fps < fps):
        raise DatasetError(f"{where}: source_fps must be a frame rate of at least {fps:g}, got {source_fps!r}")
    stride = round(source_fps / fps)
    if abs(source_fps / fps - stride) > 0.01:
        raise DatasetError(f"{where}: source_fps = {source_fps:g} is not a whole multiple of "
                           f"{family_of(spec).title}'s {fps:g} fps, so UGPUM cannot drop frames evenly; convert the "
                           f"clips (e.g. ffmpeg -i IN -r {fps} OUT.mp4) and remove source_fps, or use "
                           f"{fps}/{2 * fps}/{3 * fps} fps clips")
    return stride

#!/usr/bin/env python3
"""Make the demo clip dataset for Wan 2.1 clip LoRAs from the demo images: camera moves over each picture.

    python scripts/make_demo_clips.py                  # demo_datasets/loranne/*.jpg -> demo_datasets/loranne_clips/
    python scripts/make_demo_clips.py --out DIR

Each clip is 33 frames of 832x480 (Wan's 480p) at 16 fps, H.264 in MP4, made with PyAV from one
1024x1024 drawing of scripts/make_demo_datasets.py: a window of the clip's aspect ratio pans down or
up over the picture, or zooms in on it. The same-stem .txt caption is the picture's caption plus the
camera move. Enough to train (and test) the clip path end to end without downloading any video.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import av
import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "demo_datasets" / "loranne"
DEFAULT_OUT = REPO / "demo_datasets" / "loranne_clips"
WIDTH, HEIGHT, FRAMES, FPS = 832, 480, 33, 16
MOVES = ("pans down", "zooms in", "pans up")


def window(move: str, t: float, size: int) -> tuple[float, float, float, float]:
    """The (left, top, right, bottom) crop of a size x size picture at time t in [0, 1]."""
    w = size
    h = w * HEIGHT / WIDTH
    if move == "zooms in":
        scale = 1.0 - 0.35 * t                      # the window shrinks around the picture's centre
        w, h = w * scale, h * scale
        left, top = (size - w) / 2, (size - h) * 0.4
    else:
        travel = (size - h) * (t if move == "pans down" else 1 - t)
        left, top = 0.0, travel
    return left, top, left + w, top + h


def make_clip(picture: Image.Image, move: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with av.open(str(tmp), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.options = {"crf": "26"}            # (x264's bytes may differ slightly from run to run)
        for i in range(FRAMES):
            box = window(move, i / (FRAMES - 1), picture.width)
            frame = picture.resize((WIDTH, HEIGHT), Image.Resampling.LANCZOS, box=box)
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    tmp.replace(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for index, image_path in enumerate(sorted(SOURCE.glob("*.jpg"))):
        move = MOVES[index % len(MOVES)]
        stem = image_path.stem.replace("loranne_", "loranne_clip_")
        with Image.open(image_path) as picture:
            make_clip(picture.convert("RGB"), move, args.out / f"{stem}.mp4")
        caption = image_path.with_suffix(".txt").read_text(encoding="utf-8").strip()
        (args.out / f"{stem}.txt").write_text(f"{caption}, the camera slowly {move}\n", encoding="utf-8")
        print(args.out / f"{stem}.mp4", f"{(args.out / f'{stem}.mp4').stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

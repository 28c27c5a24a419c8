"""PNG files written chunk by chunk, as tools write what Pillow does not (an eXIf chunk after the pixels,
ImageMagick's raw EXIF profile, XMP, a transparent colour at 2 or 16 bits), each with its twin: a plain
8-bit RGB PNG of the picture it shows (turned upright, transparency laid over white), for the tests of
issue 39."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

SIGNATURE = b"\x89PNG\r\n\x1a\n"
ORIENTATION_6 = 6                         # stored turned: 90 degrees clockwise makes it upright


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(samples: np.ndarray, depth: int, colour: int, before=(), after=(), trns: bytes | None = None) -> bytes:
    """A PNG of `samples` ([H, W] or [H, W, C] unsigned, at bit depth `depth`, colour type `colour`), with
    the chunks `before` and `after` its pixels."""
    height, width = samples.shape[:2]
    flat = samples.reshape(height, -1)
    if depth == 16:
        rows = [row.astype(">u2").tobytes() for row in flat]
    elif depth == 8:
        rows = [row.astype(np.uint8).tobytes() for row in flat]
    else:                                                  # packed, most significant bits first
        rows = [np.packbits(np.unpackbits(row.astype(np.uint8)[:, None], axis=1)[:, 8 - depth:].ravel()).tobytes()
                for row in flat]
    raw = b"".join(b"\0" + row for row in rows)
    out = SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0))
    out += b"".join(before) + (chunk(b"tRNS", trns) if trns is not None else b"")
    return out + chunk(b"IDAT", zlib.compress(raw)) + b"".join(after) + chunk(b"IEND", b"")


def exif_orientation(value: int) -> bytes:
    """A little-endian TIFF header with one IFD entry: Orientation = `value`."""
    return b"II*\x00" + struct.pack("<IHHHIHHI", 8, 1, 0x0112, 3, 1, value, 0, 0)


def _gradient(width: int = 64, height: int = 48) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // (width - 1), y * 255 // (height - 1), (x + y) * 255 // (width + height)], -1)


def _save_pair(folders: tuple[Path, Path], name: str, data: bytes, shown: np.ndarray) -> None:
    for folder in folders:
        folder.mkdir(exist_ok=True)
        (folder / f"{name}.txt").write_text(f"loranne, picture {name}")
    (folders[0] / f"{name}.png").write_bytes(data)
    Image.fromarray(shown.astype(np.uint8), "RGB").save(folders[1] / f"{name}.png")


def turned_sets(root: Path) -> tuple[Path, Path]:
    """Landscape pictures stored with orientation 6 where Pillow's header does not show it (an eXIf chunk
    after the pixels, a raw EXIF profile, XMP), and their upright (portrait) twins."""
    turned, upright = root / "turned", root / "upright"
    raw_profile = (b"Exif\x00\x00" + exif_orientation(ORIENTATION_6)).hex().encode()
    places = {
        "exif_after_pixels": dict(after=[chunk(b"eXIf", exif_orientation(ORIENTATION_6))]),
        "raw_exif_profile": dict(before=[chunk(b"tEXt", b"Raw profile type exif\x00\nexif\n%8d\n"
                                               % (len(raw_profile) // 2) + raw_profile + b"\n")]),
        "xmp": dict(before=[chunk(b"iTXt", b"XML:com.adobe.xmp\x00\x00\x00\x00\x00<x:xmpmeta><rdf:Description "
                                           b'tiff:Orientation="6"/></x:xmpmeta>')]),
    }
    for i, (name, where) in enumerate(places.items()):
        stored = (_gradient() + 60 * i) % 256                 # (a picture of its own each)
        shown = np.rot90(stored, k=-1)                         # 90 degrees clockwise: as orientation 6 asks
        _save_pair((turned, upright), name, png(stored, 8, 2, **where), shown)
    return turned, upright


def transparent_sets(root: Path) -> tuple[Path, Path]:
    """Pictures with a transparent colour (tRNS) at 2 bits (grey), 16 bits (grey) and 16 bits (RGB, with
    an opaque colour sharing the transparent one's high byte), and their twins laid over white."""
    keyed, flat = root / "keyed", root / "flat"
    left = np.arange(64)[None, :].repeat(48, 0) < 32        # the left half transparent
    right = np.array([0, 2, 3])[np.arange(64) % 3][None, :].repeat(48, 0)     # (1: the transparent grey)
    _save_pair((keyed, flat), "grey2", png(np.where(left, 1, right), 2, 0, trns=struct.pack(">H", 1)),
               np.where(left[..., None], 255, (right * 85)[..., None].repeat(3, -1)))
    grey16 = np.where(left, 1000, 40000 + np.arange(64)[None, :].repeat(48, 0) * 300)
    _save_pair((keyed, flat), "grey16", png(grey16, 16, 0, trns=struct.pack(">H", 1000)),
               np.where(left[..., None], 255, np.round(grey16 / 257)[..., None].repeat(3, -1)))
    colour = np.array([1000, 2000, 3000])
    near = colour + np.array([5, 0, 0])                      # the same high bytes, another colour: stays
    rgb16 = np.where(left[..., None], colour, near)
    _save_pair((keyed, flat), "rgb16", png(rgb16, 16, 2, trns=struct.pack(">HHH", *colour)),
               np.where(left[..., None], 255, near >> 8))
    return keyed, flat

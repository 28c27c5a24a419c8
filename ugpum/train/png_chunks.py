"""A PNG file read where Pillow reads too little without decoding it: its header (bit depth and colour
type), the metadata that may turn it (an eXIf chunk, ImageMagick's raw EXIF profile, XMP) wherever it
sits, also after the pixels, where Pillow looks only once it has decoded them; and 16-bit RGB samples at
their full depth (Pillow keeps their high byte), for a transparent colour its tRNS chunk states at 16 bits.
"""
from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from PIL import Image

SIGNATURE = b"\x89PNG\r\n\x1a\n"
# text keys that carry orientation (as Pillow's own getexif reads them)
ORIENTING_TEXT = ("Raw profile type exif", "XML:com.adobe.xmp")
_MAX_TEXT = 16 * 2**20              # a metadata chunk is never decompressed past this


def _chunks(path: Path, wanted: set[bytes]) -> Iterator[tuple[bytes, bytes]]:
    """(type, data) of each chunk of a `wanted` type, in file order; the others are skipped unread.
    A file cut short ends the walk (the pixels' own check says so)."""
    with open(path, "rb") as f:
        if f.read(8) != SIGNATURE:
            return
        while True:
            head = f.read(8)
            if len(head) < 8:
                return
            length, kind = struct.unpack(">I4s", head)
            if kind in wanted:
                data = f.read(length)
                if len(data) < length:
                    return
                yield kind, data
                f.seek(4, 1)                                  # (its CRC)
            else:
                f.seek(length + 4, 1)
            if kind == b"IEND":
                return


def header(path: Path) -> tuple[int, int] | None:
    """(bit depth, colour type) from IHDR, or None for a file that is not a PNG."""
    for _, data in _chunks(path, {b"IHDR"}):
        return data[8], data[9]
    return None


def _text(kind: bytes, data: bytes) -> tuple[str, str] | None:
    """(key, text) of a tEXt, zTXt or iTXt chunk; None when it cannot be read."""
    key, _, rest = data.partition(b"\0")
    try:
        if kind == b"tEXt":
            return key.decode("latin-1"), rest.decode("latin-1")
        if kind == b"zTXt":
            return key.decode("latin-1"), zlib.decompressobj().decompress(rest[1:], _MAX_TEXT).decode("latin-1")
        compressed, rest = rest[0], rest[2:]                 # iTXt: flag, method, language, translated key
        text = rest.split(b"\0", 2)[2]
        text = zlib.decompressobj().decompress(text, _MAX_TEXT) if compressed else text
        return key.decode("latin-1"), text.decode("utf-8")
    except (IndexError, zlib.error, UnicodeDecodeError):
        return None


def orienting_metadata(path: Path) -> dict:
    """What in the file may turn the picture, wherever it sits, as Pillow's `info` names it: "exif" (the
    first eXIf chunk) and the text keys of ORIENTING_TEXT."""
    found: dict = {}
    for kind, data in _chunks(path, {b"eXIf", b"tEXt", b"zTXt", b"iTXt"}):
        if kind == b"eXIf":
            found.setdefault("exif", b"Exif\x00\x00" + data)
            continue
        text = _text(kind, data)
        if text and text[0] in ORIENTING_TEXT:
            found.setdefault(text[0], text[1])
    return found


def rgb16_samples(path: Path) -> torch.Tensor:
    """A 16-bit RGB PNG's samples at full depth, [H, W, 3] int32. Pillow decodes the pixels (its own
    unfiltering and interlacing) twice: once keeping each sample's high byte (as it opens such a file),
    once reading the same bytes as little-endian, which keeps the low byte."""
    halves = []
    for rawmode in ("RGB;16B", "RGB;16L"):
        with Image.open(path) as image:
            image.tile = [t._replace(args=rawmode) if t.args == "RGB;16B" else t for t in image.tile]
            image.load()
            halves.append(torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
                          .view(image.height, image.width, 3).to(torch.int32))
    return halves[0] * 256 + halves[1]

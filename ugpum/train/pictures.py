"""A picture file as the 8-bit RGB picture it shows, or a sentence naming the file and why not.

Pillow opens pictures in many modes; `convert("RGB")` alone is right for only some of them. Here:
- 16-bit greyscale (PNG, TIFF): scaled from 0..65535 (or the TIFF's own bit depth) to 0..255, rounded,
  so a 16-bit picture and its 8-bit twin decode to the same pixels (convert("RGB") clips every value
  over 255 to white);
- 32-bit integer and floating-point greyscale (TIFF): scaled by the range the file states (the TIFF's
  bit depth, or its SMinSampleValue/SMaxSampleValue); floats without stated range by the 0..1 every
  float picture convention uses, when the values lie there; refused by name otherwise;
- transparency (RGBA, LA, PA, a palette or a single colour marked transparent, at any bit depth: a PNG's
  tRNS colour is matched at the file's own depth, where Pillow matches 2- and 4-bit greys against rescaled
  pixels, drops it for 16-bit grey and matches 16-bit RGB at 8 bits): laid over white, as a viewer shows it
  on a white page (the colour under a transparent pixel is whatever the editor left);
- CMYK: through its embedded ICC profile when it has one (Pillow's own conversion otherwise);
- EXIF orientation: turned upright, in every mode, by the one orientation both the bucket (from the
  header) and the pixels use, wherever the file holds it (a PNG's eXIf, raw EXIF profile or XMP after its
  pixels counts: png_chunks.py reads it without decoding them);
- damaged metadata: one note naming the file (`image_size`'s log), never a library's raw warning;
- anything else Pillow opens (1-bit, palette, LAB, YCbCr, ...): Pillow's conversion; a mode without
  one is refused by name.
Animated pictures (GIF, WebP) train on their first frame. Files with a picture extension UGPUM does not
read (PSD, HEIC, camera raw, ...) are listed, never dropped in silence (`skipped_pictures`).
"""
from __future__ import annotations

import contextlib
import io
import mmap
import re
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError, features

from ..folders import read_fix, read_reason
from . import png_chunks
from .errors import DatasetError


def _taken() -> tuple[str, ...]:
    taken = (".png", ".jpg", ".jpeg", ".jpe", ".jfif", ".webp", ".bmp", ".tif", ".tiff", ".gif")
    with contextlib.suppress(Exception):          # AVIF: Pillow 11.3+ built with libavif
        if features.check("avif"):
            taken += (".avif",)
    return taken


IMAGE_EXTENSIONS = _taken()
# Picture files a dataset may hold that UGPUM does not read: listed as skipped, with the fix.
OTHER_PICTURES = frozenset({
    ".avif", ".heic", ".heif", ".jxl", ".jp2", ".j2k", ".jpx", ".psd", ".psb", ".xcf", ".kra", ".tga", ".ico",
    ".icns", ".dds", ".ppm", ".pgm", ".pbm", ".pnm", ".pcx", ".sgi", ".qoi", ".exr", ".hdr", ".svg", ".dng",
    ".cr2", ".cr3", ".nef", ".arw", ".raf", ".orf", ".rw2", ".pef", ".srw", ".dib", ".xbm", ".xpm", ".eps",
}) - set(IMAGE_EXTENSIONS)

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
RESAVE = "re-save it as PNG or JPEG, or remove it"


def is_picture(p: Path) -> bool:
    """A file UGPUM trains on: a taken extension, not hidden."""
    return p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".") and p.is_file()


def skipped_pictures(folder: Path) -> list[Path]:
    """The picture files in `folder` whose kind UGPUM does not read (PSD, HEIC, camera raw, ...)."""
    with contextlib.suppress(OSError):
        return sorted(p for p in Path(folder).iterdir()
                      if p.suffix.lower() in OTHER_PICTURES and not p.name.startswith("."))
    return []


def skipped_note(skipped: list[Path]) -> str:
    """What a sentence says of pictures that are not trained on, and the fix."""
    names = ", ".join(p.name for p in skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
    return (f"skipped {len(skipped)} picture(s) of a kind UGPUM does not read ({names}); to train on them, "
            f"convert them to PNG or JPEG (read: {', '.join(IMAGE_EXTENSIONS)})")


def _unreadable(path: Path, error: BaseException) -> DatasetError:
    if isinstance(error, OSError) and error.errno is not None:        # the file system's error, not the format's
        return DatasetError(f"cannot read image {path}: {read_reason(error)}; {read_fix(error, path)}")
    return DatasetError(f"cannot read image {path}: {error}; {RESAVE}")


@contextlib.contextmanager
def opened(path: Path) -> Iterator[Image.Image]:
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
        raise _unreadable(path, error) from error
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


ORIENTATION = 0x0112


def _orientation(image: Image.Image, path: Path) -> int:
    """The EXIF orientation of an opened picture (1: upright), from its header before any pixel is decoded,
    the same for its bucket and its pixels; for a PNG wherever the file holds it. Metadata that cannot be
    read counts as upright (Pillow's warnings about it are the caller's: `_watched`)."""
    try:
        if image.format == "PNG":
            probe = Image.new("L", (1, 1))               # Pillow's own reading of what the file holds
            probe.info.update(png_chunks.orienting_metadata(path))
            found = probe.getexif().get(ORIENTATION, 1)
        else:
            found = image.getexif().get(ORIENTATION, 1)
    except Exception as error:  # noqa: BLE001 - a damaged EXIF block: said as such, read as upright
        warnings.warn(f"its EXIF block cannot be read ({error})", stacklevel=2)
        return 1
    if found not in range(1, 9):
        warnings.warn(f"its EXIF orientation {found!r} is none of the eight EXIF defines", stacklevel=2)
        return 1
    return int(found)


@contextlib.contextmanager
def _watched(path: Path, log=None) -> Iterator[None]:
    """Pillow's warnings while the block reads `path` (damaged EXIF, a malformed MPO, ...) become one note
    naming the file for `log` (nothing where `log` is None: said when its size was read), never a
    library's raw warning; a decompression bomb stays an error (`opened`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        yield
    said = list(dict.fromkeys(" ".join(str(w.message).split()) for w in caught))
    if said and log is not None:
        log(f"note: image {path} has damaged metadata ({'; '.join(said)}); it is read as far as it can be: "
            "re-save it to silence this")


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
        raise DatasetError(f"cannot read image {path}: the file is cut short or damaged ({error}); {RESAVE}") \
            from error


def image_size(path: Path, log=None) -> tuple[int, int]:
    """The upright (width, height) of an image file, from its header: no pixel is decoded (they are
    decoded once, when the latent is made), except for a format whose completeness cannot be told from
    the file's structure (TIFF, GIF, AVIF). A file that is cut short, a decompression bomb, or a picture
    outside the bounds above is a DatasetError naming it; damaged metadata is a note for `log`."""
    with _watched(path, log), opened(path) as image:
        width, height = image.size
        turned = _orientation(image, path) in _TURNED
        complete = _complete(image, path)
    if complete is None:
        return open_rgb(path).size
    if not complete:
        raise DatasetError(f"cannot read image {path}: the file is truncated (it ends before its image data "
                           f"does); {RESAVE}")
    return (height, width) if turned else (width, height)


# EXIF orientation -> the turn that makes the picture upright (as ImageOps.exif_transpose turns it)
_UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
            5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
            8: Image.Transpose.ROTATE_90}


def open_rgb(path: Path) -> Image.Image:
    """Decode the whole image (so truncated files fail here) as the 8-bit RGB picture it shows
    (`as_rgb`, which reads the file's own tags), then upright by the orientation its bucket was chosen by."""
    try:
        with _watched(path), opened(path) as image:
            turn = _UPRIGHT.get(_orientation(image, path))
            image.load()
            if image.format != "PNG" and _turned_by_decoder(image):
                turn = None
            rgb = as_rgb(image, path)
            rgb = rgb.copy() if rgb is image else rgb              # (closing the file lets go of its pixels)
            return rgb.transpose(turn) if turn is not None else rgb
    except DatasetError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise _unreadable(path, error) from error


def _turned_by_decoder(image: Image.Image) -> bool:
    """Whether decoding turned the picture upright itself and cleared its orientation (Pillow's TIFF
    reader does), so that it is not turned twice."""
    try:
        return image.getexif().get(ORIENTATION, 1) == 1
    except Exception:  # noqa: BLE001 - unreadable now: the orientation read before decoding stands
        return False


# ---------------------------------------------------------------- modes


_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_ALPHA = ("RGBA", "LA", "PA", "RGBa", "La")


def as_rgb(image: Image.Image, path: Path) -> Image.Image:
    """`image` (any mode Pillow opens) as the 8-bit RGB picture it shows; DatasetError naming `path`
    for a mode whose brightness range the file does not state, or that Pillow cannot convert."""
    mode = image.mode
    if mode == "RGB" and "transparency" not in image.info:
        return image
    mask = _png_transparency_mask(image, path)
    if mask is not None:
        shown = _to_eight_bits(image, path) if mode in _SIXTEEN_BIT else image
        return Image.composite(shown.convert("RGB"), Image.new("RGB", image.size, (255, 255, 255)), mask)
    if mode in _SIXTEEN_BIT or mode in ("I", "F"):
        return _to_eight_bits(image, path).convert("RGB")
    if mode == "CMYK":
        return _cmyk_to_rgb(image)
    try:
        if mode in _ALPHA or "transparency" in image.info:
            rgba = image.convert("RGBA")
            return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), rgba).convert("RGB")
        return image.convert("RGB")
    except ValueError as error:                    # a mode without a conversion (Pillow: "conversion from ...")
        raise DatasetError(f"image {path} is in Pillow's mode {mode!r}, which UGPUM cannot turn into RGB "
                           f"({error}); re-save it as an 8-bit PNG or JPEG") from error


def _png_transparency_mask(image: Image.Image, path: Path) -> Image.Image | None:
    """For a PNG whose tRNS colour Pillow's conversion misses, an "L" mask (0 where that colour is, 255
    elsewhere) matched at the file's own bit depth: 2- and 4-bit grey (Pillow scales the pixels to 8 bits,
    not the colour), 16-bit grey (left out of its conversion) and 16-bit RGB (compared at 8 bits, where
    other colours share the transparent one's high byte). None for every other picture."""
    key = image.info.get("transparency")
    if image.format != "PNG" or key is None or isinstance(key, bytes):
        return None
    depth, colour = png_chunks.header(path) or (8, -1)
    if colour == 0 and depth in (2, 4):
        values = torch.frombuffer(bytearray(image.convert("L").tobytes()), dtype=torch.uint8).to(torch.int32)
        key = key * (255 // (2 ** depth - 1))                     # as Pillow scales the pixels (x85, x17)
    elif colour == 0 and depth == 16:
        values = torch.frombuffer(bytearray(image.convert("I").tobytes()), dtype=torch.int32)
    elif colour == 2 and depth == 16:
        values, key = png_chunks.rgb16_samples(path).view(-1, 3), torch.tensor(key, dtype=torch.int32)
    else:
        return None
    opaque = values != key if values.dim() == 1 else (values != key).any(dim=1)
    return Image.frombytes("L", image.size, (opaque.to(torch.uint8) * 255).numpy().tobytes())


def _tiff_tag(image: Image.Image, tag: int):
    value = getattr(image, "tag_v2", {}).get(tag) if image.format == "TIFF" else None
    return value[0] if isinstance(value, tuple) and value else value


def _stated_range(image: Image.Image, values: torch.Tensor, path: Path) -> tuple[float, float]:
    """(black, white) of a 16-bit, 32-bit integer or floating-point greyscale picture, as its file states
    it; DatasetError when it does not."""
    smin, smax = _tiff_tag(image, 340), _tiff_tag(image, 341)      # SMinSampleValue, SMaxSampleValue
    if smin is not None and smax is not None and float(smax) > float(smin):
        return float(smin), float(smax)
    bits, sample_format = _tiff_tag(image, 258), _tiff_tag(image, 339)   # BitsPerSample, SampleFormat
    if image.mode in _SIXTEEN_BIT:
        return 0.0, float(2 ** min(int(bits or 16), 16) - 1)
    if image.mode == "I" and (image.format == "PNG" or (bits and sample_format in (None, 1))):
        return 0.0, float(2 ** int(bits or 16) - 1)          # (older Pillow opened 16-bit PNGs as "I")
    low, high = float(values.min()), float(values.max())
    if image.mode == "F" and 0.0 <= low and high <= 1.0:
        return 0.0, 1.0                                        # the range every float picture convention uses
    kind, scale = ("floating-point", " (or scale its values to 0..1)") if image.mode == "F" else ("32-bit integer", "")
    raise DatasetError(f"image {path} holds {kind} values from {low:g} to {high:g}, and the file does not say which "
                       f"of them is black and which white; save it as an 8- or 16-bit PNG{scale}")


def _to_eight_bits(image: Image.Image, path: Path) -> Image.Image:
    """A 16-bit, 32-bit integer or floating-point greyscale picture as 8-bit greyscale ("L"), its stated
    range scaled to 0..255 and rounded: a 16-bit value v becomes round(v / 257), so its 8-bit twin's
    pixels come back exactly."""
    wide = image.convert("I") if image.mode in _SIXTEEN_BIT else image
    dtype = torch.float32 if wide.mode == "F" else torch.int32
    values = torch.frombuffer(bytearray(wide.tobytes()), dtype=dtype).to(torch.float64)
    if not torch.isfinite(values).all():
        raise DatasetError(f"image {path} holds NaN or infinite values; save it as an 8- or 16-bit PNG")
    black, white = _stated_range(image, values, path)
    scaled = ((values - black) * (255.0 / (white - black))).round().clamp(0, 255).to(torch.uint8)
    return Image.frombytes("L", image.size, scaled.numpy().tobytes())


def _cmyk_to_rgb(image: Image.Image) -> Image.Image:
    """CMYK through the picture's embedded ICC profile to sRGB when it has one (and Pillow's colour
    management is built in); Pillow's plain conversion otherwise."""
    profile = image.info.get("icc_profile")
    if profile:
        with contextlib.suppress(Exception):               # no littlecms, a damaged profile: the plain way
            from PIL import ImageCms
            return ImageCms.profileToProfile(image, ImageCms.ImageCmsProfile(io.BytesIO(profile)),
                                             ImageCms.createProfile("sRGB"), outputMode="RGB")
    return image.convert("RGB")

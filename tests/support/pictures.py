"""Pictures and captions as real tools write them, for the tests of issue 32 (Pillow writes the pictures)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def picture_sets(root: Path) -> tuple[Path, Path]:
    """Two datasets of the same pictures and captions: 16-bit PNGs with UTF-16 captions written without a
    byte-order mark (and a Photoshop file beside them), and their 8-bit twins with UTF-8 captions."""
    deep, twin = root / "deep", root / "twin"
    deep.mkdir()
    twin.mkdir()
    for i, (width, height) in enumerate(((64, 48), (48, 64))):    # landscape and portrait: two bucket shapes
        ramp = np.tile(np.linspace(0, 65535, width).round().astype(np.uint16), (height, 1))
        Image.fromarray(ramp).save(deep / f"{i}.png")                                    # mode I;16
        Image.fromarray((ramp / 257).round().astype(np.uint8)).convert("RGB").save(twin / f"{i}.png")
        caption = f"loranne, a grey ramp number {i}"
        (deep / f"{i}.txt").write_bytes(caption.encode("utf-16-le"))
        (twin / f"{i}.txt").write_text(caption, encoding="utf-8")
    (deep / "layers.psd").write_bytes(b"8BPS")
    return deep, twin

"""A fingerprint of a safetensors file's weights that is cheap to compute: which weights the file
holds, not only which names and shapes.

Two files with the same header (a fine-tune of a model and the model itself, fp8 files made with other
scales) differ in their bytes. Hashing every byte of a 20-60 GB file would cost minutes, so this reads
a few fixed slices instead: the start and the middle of up to `TENSORS` tensors spread evenly over the
file's tensors in name order (every tensor of a small file). A fine-tune changes nearly every weight,
so the slices tell it apart; the cost is a few hundred small reads.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from .safetensors_header import read_header

TENSORS = 256            # tensors sampled
SLICE = 4096             # bytes read at each place


def _spread(names: list[str], limit: int) -> list[str]:
    if len(names) <= limit:
        return names
    return [names[round(i * (len(names) - 1) / (limit - 1))] for i in range(limit)]


def weights_fingerprint(path: str | Path) -> str:
    """sha256 hex digest of fixed slices of the file's tensor data (and their names and places)."""
    header = read_header(path)
    digest = hashlib.sha256()
    with open(header.path, "rb") as f:
        for name in _spread(sorted(header.tensors), TENSORS):
            begin, end = header.tensors[name].offsets
            digest.update(f"{name}:{begin}:{end}\n".encode())
            for start in sorted({begin, begin + (end - begin) // 2}):
                f.seek(header.data_start + start)
                digest.update(f.read(min(SLICE, end - start)))
    return digest.hexdigest()

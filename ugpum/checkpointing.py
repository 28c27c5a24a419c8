"""Per-block gradient checkpointing: keep only each block's input, recompute inside in backward."""
from __future__ import annotations

import functools

from torch import nn

from .inplace_guard import checkpoint_block


def checkpoint_blocks(model: nn.Module, block_paths: list[str]) -> callable:
    """Wrap each block's forward in `checkpoint_block`; returns a function that undoes it.

    Placement hooks run in `Module.__call__`, outside the wrapped forward, so routing happens once
    and is not repeated during recomputation. FLUX.2 blocks also need `guard_inplace_residuals`.
    """
    originals = {}
    for path in block_paths:
        block = model.get_submodule(path)
        originals[path] = inner = block.forward

        @functools.wraps(inner)
        def wrapped(*args, _inner=inner, **kwargs):
            return checkpoint_block(_inner, *args, **kwargs)

        block.forward = wrapped

    def undo():
        for path, fwd in originals.items():
            model.get_submodule(path).forward = fwd
    return undo

"""Per-block recompute: keep only each block's input, and run the block's forward again in backward
(torch's activation checkpointing, `torch.utils.checkpoint`, one block at a time)."""
from __future__ import annotations

import functools

import torch.utils.checkpoint
from torch import nn

from .inplace_guard import recompute_block


def recompute_blocks(model: nn.Module, block_paths: list[str]) -> callable:
    """Wrap each block's forward in `recompute_block`; returns a function that undoes it.

    Placement hooks run in `Module.__call__`, outside the wrapped forward, so routing happens once
    and is not repeated during recomputation. FLUX.2 blocks also need `guard_inplace_residuals`.
    A forward compiled by `ugpum.compute.compile` copies its inputs inside its graph and so never writes into
    them: it is recomputed as it is, without `recompute_block`'s eager copies (two per tensor
    argument and block, forward and recomputation).
    """
    originals = {}
    for path in block_paths:
        block = model.get_submodule(path)
        originals[path] = inner = block.forward
        run = _recompute_as_is if getattr(inner, "_ugpum_compiled", False) else recompute_block

        @functools.wraps(inner)
        def wrapped(*args, _inner=inner, _run=run, **kwargs):
            return _run(_inner, *args, **kwargs)

        block.forward = wrapped

    def undo():
        for path, fwd in originals.items():
            model.get_submodule(path).forward = fwd
    return undo


def _recompute_as_is(forward, *args, **kwargs):
    # kwargs stay in the closure so that block keywords never collide with checkpoint()'s own
    return torch.utils.checkpoint.checkpoint(lambda *a: forward(*a, **kwargs), *args, use_reentrant=False)

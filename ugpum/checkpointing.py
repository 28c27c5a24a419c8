"""Per-block gradient checkpointing: keep only each block's input, recompute inside in backward."""
from __future__ import annotations

import functools

import torch.utils.checkpoint
from torch import nn

from .inplace_guard import checkpoint_block


def checkpoint_blocks(model: nn.Module, block_paths: list[str]) -> callable:
    """Wrap each block's forward in `checkpoint_block`; returns a function that undoes it.

    Placement hooks run in `Module.__call__`, outside the wrapped forward, so routing happens once
    and is not repeated during recomputation. FLUX.2 blocks also need `guard_inplace_residuals`.
    A forward compiled by `ugpum.compile` copies its inputs inside its graph and so never writes into
    them: it is checkpointed as it is, without `checkpoint_block`'s eager copies (two per tensor
    argument and block, forward and recomputation).
    """
    originals = {}
    for path in block_paths:
        block = model.get_submodule(path)
        originals[path] = inner = block.forward
        run = _checkpoint_as_is if getattr(inner, "_ugpum_compiled", False) else checkpoint_block

        @functools.wraps(inner)
        def wrapped(*args, _inner=inner, _run=run, **kwargs):
            return _run(_inner, *args, **kwargs)

        block.forward = wrapped

    def undo():
        for path, fwd in originals.items():
            model.get_submodule(path).forward = fwd
    return undo


def _checkpoint_as_is(forward, *args, **kwargs):
    # kwargs stay in the closure so that block keywords never collide with checkpoint()'s own
    return torch.utils.checkpoint.checkpoint(lambda *a: forward(*a, **kwargs), *args, use_reentrant=False)

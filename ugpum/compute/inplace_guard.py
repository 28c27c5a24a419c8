"""Make blocks that add residuals in place safe for autograd, from the outside.

Why
---
ComfyUI's FLUX.2 blocks update the residual stream in place (``img += ...``, ``txt += ...``,
``x += ...``) right after a normalisation layer has read that same tensor. A LayerNorm/RMSNorm
keeps a reference to its input for backward; the in-place add then bumps the input's version and
``backward()`` fails with "one of the variables needed for gradient computation has been modified
by an inplace operation" as soon as anything inside the block is trainable (LoRA on the Linears).
Casts that happen to copy the input before the norm (autocast to another dtype, a norm computed
in fp32 on bf16 activations) hide this, which is why it looks dtype-dependent.

The fix here, ``guard_inplace_residuals``, is a forward pre-hook on every normalisation module
that hands the norm a private copy of its input while gradients are being recorded. The norm saves
the copy; the block's ``+=`` then changes only the original. Costs: one copy of the norm's input
per call (bandwidth), and the saved copy is exactly the tensor an out-of-place residual
(``x = x + f(x)``) would have kept alive anyway, so activation memory is what non-in-place code
needs. Under ``torch.no_grad()``/inference, or when neither the input nor the norm's own
parameters require grad, the hook does nothing.

Which modules: ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` subclasses and any class whose name
ends in ``LayerNorm`` or ``RMSNorm`` (custom implementations, e.g. ComfyUI 0.3.75's
``flux.layers.RMSNorm``). Every normalisation's gradient depends on its input, and every
implementation met (``F.layer_norm``, ``F.rms_norm``, ``x * rsqrt(mean(x**2))``) saves the input
or an alias of it. Only the innermost such module is hooked when one wraps another. With
``include_rms=False`` RMSNorms are skipped: in FLUX.2 and Wan they only see fresh q/k projections
that nothing modifies afterwards, and cloning q and k costs memory without need (they are not
shared with the residual stream). Affine weights, if present, are untouched: we only clone.

Recomputing a block in backward needs one more step, ``recompute_block``: non-reentrant
``torch.utils.checkpoint`` re-runs the block on its *original input tensors* during backward.
A block that modifies its input in place has by then overwritten that input (and, run plainly
in a chain, the whole single stream is one storage), so recomputation must start from private
copies made *inside* the recomputed function. Measured on ComfyUI's FLUX.2 blocks (fp64,
against central differences):
  * plain, no guard: RuntimeError (in-place modification);
  * plain + guard: exact gradients;
  * checkpoint of the bare block, with or without guard: RuntimeError;
  * checkpoint with private input copies but no guard: NO error and wrong gradients (relative
    error ~60): recomputation runs the in-place add after a norm saved the same tensor, and
    checkpoint's recomputed tensors carry no version check. The double block is the one that
    trips it (norm2 saves ``img`` after the first in-place add);
  * ``recompute_block`` + guard: exact gradients;
  * the whole model under one non-reentrant checkpoint (ComfyUI 0.33's TrainLoraNode at its
    default checkpoint_depth=1 does this): no error and ~2 % wrong gradients without the guard,
    exact with it.
Wan's blocks add residuals out of place; they need neither, and are unaffected by both.

Blocks compiled by ``ugpum.compute.compile`` need the guard as well (the compiler traces with autograd's version
checks), and take their private input copies inside the compiled graph, recomputed or not (see that
module: without the copies, FLUX.2's compiled blocks failed in backward when not recomputed).

Pure torch; nothing here imports ComfyUI.
"""
from __future__ import annotations

import weakref

import torch
import torch.utils.checkpoint
from torch.utils.hooks import RemovableHandle

__all__ = ["guard_inplace_residuals", "recompute_block"]

_LAYER_NORM_TYPES: tuple[type, ...] = (torch.nn.LayerNorm,)
_RMS_NORM_TYPES: tuple[type, ...] = (torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()

# module -> handle of the guard installed on it (so a second call does not clone twice)
_installed: "weakref.WeakKeyDictionary[torch.nn.Module, RemovableHandle]" = weakref.WeakKeyDictionary()


def _is_norm(m: torch.nn.Module, include_rms: bool) -> bool:
    name = type(m).__name__
    if isinstance(m, _LAYER_NORM_TYPES) or name.endswith("LayerNorm"):
        return True
    if include_rms and (isinstance(m, _RMS_NORM_TYPES) or name.endswith("RMSNorm")):
        return True
    return False


def _needs_copy(m: torch.nn.Module, x) -> bool:
    if not (torch.is_tensor(x) and torch.is_grad_enabled()):
        return False
    if x.requires_grad:
        return True
    return any(p.requires_grad for p in m.parameters(recurse=False))


def _clone_input_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    if args:
        if _needs_copy(module, args[0]):
            return (args[0].clone(),) + tuple(args[1:]), kwargs
        return None
    for key, value in kwargs.items():  # called as norm(input=x) / norm(x=x) / norm(hidden_states=x)
        if torch.is_tensor(value):
            if _needs_copy(module, value):
                kwargs = dict(kwargs)
                kwargs[key] = value.clone()
                return args, kwargs
            return None
    return None


def _is_guarded(m: torch.nn.Module) -> bool:
    h = _installed.get(m)
    return h is not None and h.id in m._forward_pre_hooks


def guard_inplace_residuals(module: torch.nn.Module, *, include_rms: bool = True) -> list[RemovableHandle]:
    """Install input-copying pre-hooks on the normalisation layers inside ``module``.

    Pass a whole model or just its blocks. Returns the new hook handles (``h.remove()`` undoes
    each); norms already guarded by an earlier call are skipped. See the module docstring.
    """
    handles = []
    norms = [m for m in module.modules() if _is_norm(m, include_rms)]
    for m in norms:
        # hook only the innermost norm: an outer wrapper's copy would be copied again
        if any(c is not m and _is_norm(c, include_rms) for c in m.modules()):
            continue
        if _is_guarded(m):
            continue
        h = m.register_forward_pre_hook(_clone_input_hook, with_kwargs=True)
        _installed[m] = h
        handles.append(h)
    return handles


def _private(v):
    return v.clone() if torch.is_tensor(v) and v.is_floating_point() else v


def recompute_block(block, *args, context_fn=None, **kwargs):
    """``block(*args, **kwargs)`` recomputed in backward (non-reentrant ``torch.utils.checkpoint``), for
    in-place blocks.

    Floating-point tensor arguments are copied *inside* the recomputed function, so the block
    never writes into a tensor that recomputation will read again; the copies are not kept
    between forward and backward. Use together with ``guard_inplace_residuals`` for blocks that
    modify their input in place (ComfyUI FLUX.2); harmless for out-of-place blocks (Wan).
    Tuples/lists of tensors (e.g. modulation tuples) are passed through untouched: blocks read them.
    `context_fn`: torch's selective checkpoint contexts (what the recompute keeps instead of recomputing).
    """
    def run(*a):
        # kwargs stay in the closure (non-reentrant checkpoint tracks them through autograd
        # anyway), so block keywords can never collide with checkpoint()'s own keywords.
        a = tuple(_private(v) for v in a)
        k = {key: _private(v) for key, v in kwargs.items()}
        return block(*a, **k)

    selective = {"context_fn": context_fn} if context_fn is not None else {}
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **selective)

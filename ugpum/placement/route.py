"""Move activations to the device of the block about to run.

A forward pre-hook on every placed module moves the tensors it is called with (also inside tuples,
lists, dicts and dataclasses such as FLUX.2's shared modulation) to that module's device. Tensors
that need no gradient (RoPE tables, modulation, text context) are the same for every block of a step:
they are copied once per device per step and reused. The hidden state is copied at each boundary;
copy is differentiable (`copy.move`), so its gradient flows back to the previous device. GPU-to-GPU
copies run on side streams (see `copy.py`), so the devices never wait on each other's queues; with
UGPUM_STAGED_COPIES=1 they go through pinned host memory, as between GPUs without peer access.

The cached copies belong to the thread that made them: the pipeline runs each micro-batch's forward
in a thread of its own, and micro-batches in flight at the same time must neither share nor clear
each other's copies (each has its own timestep, so its own modulation).
"""
from __future__ import annotations

import dataclasses
import threading

import torch
from torch import nn

from .copy import as_device, move as move_tensor


class SharedInputCache:
    """Copies of gradient-free inputs per (tensor, device), kept for one forward pass of the calling
    thread (each thread has its own; `reset` clears the calling thread's)."""

    def __init__(self):
        self._local = threading.local()
        self._lock = threading.Lock()
        self.copied_bytes = 0    # everything moved across devices (all threads)

    @property
    def _copies(self) -> dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]]:
        copies = getattr(self._local, "copies", None)
        if copies is None:
            copies = self._local.copies = {}
        return copies

    def reset(self) -> None:
        self._copies.clear()

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.copied_bytes += nbytes

    def move(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if t.device == device:
            return t
        nbytes = t.numel() * t.element_size()
        if t.requires_grad:
            self._count(nbytes)
            return move_tensor(t, device)
        copies = self._copies
        key = (id(t), device)
        hit = copies.get(key)
        if hit is not None and hit[0] is t:    # holding the source keeps its id from being reused
            return hit[1]
        moved = move_tensor(t, device)
        copies[key] = (t, moved)
        self._count(nbytes)
        return moved


def map_tensors(obj, fn):
    """`obj` with `fn(t)` in place of every tensor `t` in it (inside tuples, namedtuples, lists, dicts
    and dataclasses); everything else is kept as is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):        # namedtuple
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def move_tree(obj, device: torch.device, cache: SharedInputCache):
    """`obj` with every tensor in it on `device`."""
    return map_tensors(obj, lambda t: cache.move(t, device))


class Router:
    """Installs and removes the moving hooks; one per placed model."""

    def __init__(self):
        self.cache = SharedInputCache()
        self._handles: list = []

    def route_into(self, module: nn.Module, device: torch.device | str) -> None:
        device = as_device(device)

        def pre_hook(_module, args, kwargs):
            return move_tree(args, device, self.cache), move_tree(kwargs, device, self.cache)

        self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))

    def reset_each_call(self, root: nn.Module) -> None:
        """Forget cached copies at the start of every forward of the whole model."""
        self._handles.append(root.register_forward_pre_hook(lambda *_: self.cache.reset()))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.cache.reset()

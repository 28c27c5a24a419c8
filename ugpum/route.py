"""Move activations to the device of the block about to run.

A forward pre-hook on every placed module moves the tensors it is called with (also inside tuples,
lists, dicts and dataclasses such as FLUX.2's shared modulation) to that module's device. Tensors
that need no gradient (RoPE tables, modulation, text context) are the same for every block of a step:
they are copied once per device per step and reused. The hidden state is copied at each boundary;
`Tensor.to` is differentiable, so its gradient flows back to the previous device.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn


class SharedInputCache:
    """Copies of gradient-free inputs per (tensor, device), kept for one forward pass."""

    def __init__(self):
        self._copies: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.copied_bytes = 0    # everything moved across devices since the last reset

    def reset(self) -> None:
        self._copies.clear()

    def move(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if t.device == device:
            return t
        nbytes = t.numel() * t.element_size()
        if t.requires_grad:
            self.copied_bytes += nbytes
            return t.to(device, non_blocking=True)
        key = (id(t), device)
        hit = self._copies.get(key)
        if hit is not None and hit[0] is t:    # holding the source keeps its id from being reused
            return hit[1]
        moved = t.to(device, non_blocking=True)
        self._copies[key] = (t, moved)
        self.copied_bytes += nbytes
        return moved


def move_tree(obj, device: torch.device, cache: SharedInputCache):
    """`obj` with every tensor in it on `device`."""
    if isinstance(obj, torch.Tensor):
        return cache.move(obj, device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):        # namedtuple
        return type(obj)(*(move_tree(x, device, cache) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_tree(x, device, cache) for x in obj)
    if isinstance(obj, dict):
        return {k: move_tree(v, device, cache) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: move_tree(getattr(obj, f.name), device, cache)
                   for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


class Router:
    """Installs and removes the moving hooks; one per placed model."""

    def __init__(self):
        self.cache = SharedInputCache()
        self._handles: list = []

    def route_into(self, module: nn.Module, device: torch.device | str) -> None:
        device = torch.device(device)

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

"""Apply a plan to a model: every block on its stage's device, activations routed between them.

`place` either moves an already-built model, or fills a model built on the meta device straight from
its safetensors file, one module at a time, so neither host RAM nor any one GPU ever holds the whole
model. `Placement.undo` puts everything back where it was and removes the hooks.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .route import Router
from .swap import SwapHandle, install_swap, shared_blocks


@dataclass
class Layout:
    """Which device each part of the model runs on."""
    blocks: dict[str, str]                 # block module path -> device
    first: str                             # everything that is neither a block nor a tail module
    last: str
    tail_modules: tuple[str, ...] = ()     # run after the blocks (FLUX.2 final_layer, Wan head)
    # Block paths of each pipeline stage, in run order. Empty: a stage is each run of consecutive
    # blocks on one device. Needed when two stages share a device (tests, the one-GPU benchmark).
    stages: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def from_plan(cls, plan, devices: list[str], tail_modules: tuple[str, ...] = ()) -> "Layout":
        """Devices are the torch devices of the plan's stages, in stage order."""
        blocks, stages = {}, []
        for stage, dev in zip(plan.stages, devices):
            paths = tuple(plan.block_paths[i] for i in range(*stage.blocks))
            blocks.update({p: dev for p in paths})
            if paths:
                stages.append(paths)
        busy = [d for s, d in zip(plan.stages, devices) if s.blocks[1] > s.blocks[0]] or devices
        return cls(blocks, busy[0], busy[-1], tail_modules, tuple(stages))

    def stage_blocks(self) -> list[tuple[str, ...]]:
        """Block paths of each stage, in run order (see `stages`)."""
        if self.stages:
            return [tuple(s) for s in self.stages if s]
        runs: list[list[str]] = []
        previous = None
        for path, dev in self.blocks.items():
            if not runs or dev != previous:
                runs.append([])
            runs[-1].append(path)
            previous = dev
        return [tuple(r) for r in runs]

    def device_of(self, path: str) -> str:
        """Device of the module at `path` or of the placed unit that contains it."""
        parts = path.split(".")
        for i in range(len(parts), 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in self.blocks:
                return self.blocks[prefix]
            if prefix in self.tail_modules:
                return self.last
        return self.first


@dataclass
class Placement:
    model: nn.Module
    layout: Layout
    router: Router
    original_devices: dict[str, torch.device] = field(default_factory=dict)

    def undo(self, device: str | None = None) -> None:
        """Remove the hooks; move every module back (or to `device`). A module built on the meta
        device stays where it was placed, unless `device="meta"`, which drops its weights at once
        (the callers that stream a model built on meta do so: without it 14 GiB stayed on the GPU after
        the Trainer node in ComfyUI 0.33 until a garbage collection, and Sample Preview stacked a
        second DiT on it; found on the H200)."""
        self.router.remove()
        for path, dev in self.original_devices.items():
            module = self.model.get_submodule(path) if path else self.model
            target = torch.device(device) if device else dev
            if target.type != "meta" or device == "meta":
                _move_own(module, target)


def _units(model: nn.Module, layout: Layout) -> list[str]:
    """Module paths placed as one piece: each block, each tail module, and the rest of the root."""
    return list(layout.blocks) + list(layout.tail_modules)


def _own_tensors(module: nn.Module, skip: set[str]):
    """Parameters and buffers of `module` that do not belong to a placed sub-unit in `skip`."""
    for name, t in list(module.named_parameters(recurse=True)) + list(module.named_buffers(recurse=True)):
        if not any(name == s or name.startswith(s + ".") for s in skip):
            yield name, t


def _move_own(module: nn.Module, device: torch.device, skip: set[str] = frozenset()) -> None:
    """Move `module`'s tensors except those under `skip` (paths relative to module)."""
    if not skip:
        module.to(device)
        return
    for name, t in _own_tensors(module, skip):
        owner_path, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        moved = t.data.to(device)
        if isinstance(t, nn.Parameter):
            owner._parameters[attr] = nn.Parameter(moved, requires_grad=t.requires_grad)
        else:
            owner._buffers[attr] = moved


def _device_of_module(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


def place(model: nn.Module, layout: Layout, checkpoint: str | Path | None = None, key_prefix: str = "",
          dtype: torch.dtype | None = None, weights_on: dict[str, str] | None = None,
          on_weight=None) -> Placement:
    """Put each unit on its device and install the router.

    With `checkpoint`, the model must have been built on the meta device: each unit is allocated on
    its device and filled tensor by tensor from the file (safetensors reads only the bytes asked for).
    `weights_on` (unit path -> device) stores those units' weights elsewhere than they run: block
    swap keeps offloaded blocks in host memory (`ugpum.placement.swap`); the router still moves their inputs
    to the layout's device. `on_weight(module_path, module)` runs as each weight arrives from the file
    (`ugpum.compute.base_compute.QuantiseAsLoaded` quantises the frozen Linears one by one).
    """
    storage = dataclasses.replace(layout, blocks={**layout.blocks, **weights_on}) if weights_on else layout
    units = _units(model, layout)
    router = Router()
    placement = Placement(model, layout, router)
    rest_skip = set(units)
    placement.original_devices[""] = _device_of_module(model)
    for path in units:
        placement.original_devices[path] = _device_of_module(model.get_submodule(path))
    try:
        if checkpoint is not None:
            from .stream_load import fill_from_file
            fill_from_file(model, storage, Path(checkpoint), key_prefix, dtype, on_weight)
        else:
            _move_own(model, torch.device(layout.first), rest_skip)
            for path in units:
                model.get_submodule(path).to(torch.device(storage.device_of(path)))
    except BaseException:             # e.g. out of memory half-way: what moved goes back
        placement.undo()
        raise
    router.reset_each_call(model)
    router.route_into(model, layout.first)
    for path in units:
        router.route_into(model.get_submodule(path), layout.device_of(path))
    return placement


# ---------------------------------------------------------------------------------------------
# applying a plan: placement plus the swap tier

def swap_plan(plan, devices: list[str], tail_modules: tuple[str, ...] = ()):
    """(Layout, offloaded block paths in execution order) for a plan and its stages' torch devices."""
    layout = Layout.from_plan(plan, devices, tail_modules)
    return layout, [plan.block_paths[i] for i in sorted(plan.offloaded_blocks)]


@dataclass
class SwapPlacement:
    placement: Placement
    swaps: list[SwapHandle]

    @property
    def model(self):
        return self.placement.model

    @property
    def layout(self):
        return self.placement.layout

    @property
    def router(self):
        return self.placement.router

    def undo(self, device: str | None = None) -> None:
        """Remove swap and placement; `device="meta"` discards the weights (no host copy back)."""
        for s in self.swaps:
            s.remove(restore=device != "meta")
        self.swaps = []
        self.placement.undo(device)


def _unit_of(path: str, units: Sequence[str]) -> str | None:
    """The unit among `units` that holds the module at `path`, or None."""
    for unit in units:
        if path == unit or path.startswith(unit + "."):
            return unit
    return None


def on_compute_device(on_weight, layout: Layout, offloaded: Sequence[str]):
    """`on_weight` for a swapped block's layer, whose weight arrives in host memory: it runs on the device
    the block computes on (8-bit quantisation there uses the same kernels as for a resident block, so
    the swapped block's 8-bit weights are bit for bit a resident one's, and a GPU quantises far faster),
    then what it made goes back to host memory for the swap to pack. An emptied weight stays on the
    device, so the LoRA attached to the layer is created there."""
    def hook(path: str, module: nn.Module) -> None:
        unit = _unit_of(path, offloaded)
        home = module.weight.device
        device = torch.device(layout.blocks[unit]) if unit is not None else home
        if device == home:
            on_weight(path, module)
            return
        module.weight.data = module.weight.data.to(device)
        on_weight(path, module)
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if t.device == device and t.numel():
                t.data = t.data.to(home)
    return hook


def place_with_swap(model: nn.Module, layout, offloaded: Sequence[str], checkpoint=None, key_prefix: str = "",
                    dtype: torch.dtype | None = None, slots: int = 2, pin: bool = True,
                    timing: bool = False, on_weight=None, share: Sequence[SwapHandle] = ()) -> SwapPlacement:
    """`place()`, with the `offloaded` blocks' weights loaded into host memory (never onto their
    device) and swapped in for compute on the device the layout gives them (one ring per device).
    `on_weight` (see `place`; a model streamed from its file only) runs for a swapped block's layer on
    its compute device: an 8-bit base streams its 8-bit weights and scales, half bf16's bytes. `share`:
    another replica's swaps, whose host copies the blocks they also swap stream from (`share_swapped_blocks`)."""
    if on_weight is not None:
        if checkpoint is None:
            raise ValueError("place_with_swap: on_weight needs a model built on the meta device and streamed "
                             "from its file (the 8-bit base with block swap quantises each layer as it arrives)")
        on_weight = on_compute_device(on_weight, layout, offloaded)
    placement = place(model, layout, checkpoint=checkpoint, key_prefix=key_prefix, dtype=dtype,
                      weights_on={p: "cpu" for p in offloaded}, on_weight=on_weight)
    by_device: dict[str, list[str]] = {}
    for p in offloaded:
        by_device.setdefault(layout.blocks[p], []).append(p)
    swaps = []
    try:
        for dev, paths in by_device.items():
            swaps.append(install_swap(model, paths, dev, slots=slots, pin=pin, timing=timing, share=share))
    except BaseException:
        for s in swaps:
            s.remove()
        placement.undo()
        raise
    return SwapPlacement(placement, swaps)


def place_by_plan(model: nn.Module, plan, tail_modules: tuple[str, ...], model_file: str = "",
                  key_prefix: str = "", dtype: torch.dtype | None = None, on_weight=None,
                  share: Sequence[SwapHandle] = ()):
    """Apply a plan: blocks on their stages' devices, the swap tier (if any) streamed from host memory,
    weights read from `model_file` when the model was built on the meta device (`on_weight`: see
    `place`; with a swap tier, see `place_with_swap`, and `share_swapped_blocks` for `share`). Returns the
    placement; `.undo()` releases it."""
    layout, offloaded = swap_plan(plan, [s.torch_device for s in plan.stages], tail_modules)
    checkpoint = model_file if any(p.is_meta for p in model.parameters()) else None
    if offloaded:
        share_swapped_blocks(model, offloaded, share)
        return place_with_swap(model, layout, offloaded, checkpoint=checkpoint, key_prefix=key_prefix, dtype=dtype,
                               on_weight=on_weight, share=share)
    return place(model, layout, checkpoint=checkpoint, key_prefix=key_prefix, dtype=dtype, on_weight=on_weight)


def share_swapped_blocks(model: nn.Module, offloaded: Sequence[str], share: Sequence[SwapHandle]) -> None:
    """Put into `model` (another replica of the model `share` swaps blocks of, before it is placed) a
    `block_copy` of each block both swap, so that its swap streams them from `share`'s host copies and
    nothing loads them again (`place_with_swap(..., share=share)` then mirrors them)."""
    owners = shared_blocks(share)
    for path in offloaded:
        if path in owners:
            parent, _, name = path.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            owner.register_module(name, owners[path][0].block_copy(path))

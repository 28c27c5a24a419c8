"""Block swap: offloaded blocks' frozen weights live in host memory and stream into a ring of slots.

The one-GPU path, and the overflow tier of a plan (`Stage.offloaded`). For each offloaded block the
frozen parameters and buffers are packed, each at an aligned offset, into one host buffer (pinned on
CUDA, so copies are asynchronous DMA). The device holds `slots` buffers (2 by default), each the size
of the largest offloaded block: that is all the device memory swapped blocks ever take. A block is
*materialised* while its tensors point into a slot; otherwise they are empty placeholders on the
device, so using a block that is not loaded fails loudly instead of computing with stale weights.
Frozen weights are never copied back: the host copy stays valid. Trainable parameters inside a
block (and LoRA adapters, which live outside the blocks) stay resident on the device.

Schedule (one copy stream, events; nothing waits on the host in the hot path)
----------------------------------------------------------------------------
  * forward, entering block i: make i resident (the compute stream waits for its copy event) and
    prefetch the next offloaded blocks into free slots;
  * forward, leaving block i: record a "free" event on the compute stream; the slot may be refilled
    once the compute stream passes that event (the copy stream waits on it), and the next blocks are
    prefetched into it at once;
  * backward: a gradient hook on each block's outputs fires before the block's backward (and, with
    per-block recompute, before its recomputation, which needs the weights again): make i
    resident and prefetch the previous offloaded blocks (reverse order). A hook on the block's inputs
    fires once its backward is done and frees its slot early;
  * without recompute, autograd would keep references to slot memory (e.g. ``weight.t()``) until
    backward, by which time the slot may hold another block. A saved-tensor hook around each
    offloaded block's forward replaces such tensors by (block, offset, shape, stride) and rebuilds
    them from wherever the block is resident in backward (reloading it if needed).

The blocks left in the slots at the end of forward are the first needed in backward, and those left
at the end of backward the first needed in the next forward, so a step moves 2 x (N - slots) blocks,
not 2 x N.

Replicas in one process (`ugpum.train.replicas`) share the host copy: a replica's swap installed with
`share=` another replica's handles streams the blocks those swap from their host buffers.
Its model holds, at those paths, `SwapHandle.block_copy`s (the block as packed: placeholders, no bytes,
with what loading made of it: a quantised class, ComfyUI's weight functions), so the packed layouts match.

Autograd's backward for CUDA runs on the stream the forward ran on; events are recorded on the
current stream in both. With a CPU device the same bookkeeping runs with plain copies and no events
(that is what the CPU tests exercise). One forward/backward at a time per model: micro-batches run
concurrently from several threads (a pipelined schedule) must not share a swapped stage.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 512        # byte alignment of every tensor inside a host buffer and a slot


# ---------------------------------------------------------------------------------------------
# host memory

CUDA_HOST_REGISTER_PORTABLE = 1   # pinned for every GPU of the process, not only the current one (replicas)


def _cuda_host_register(t: torch.Tensor) -> bool:
    """Page-lock `t`'s memory in place (exact size; `pin_memory=True` rounds up to a power of two,
    wasting up to half of it), for every GPU. False where this torch or driver cannot."""
    try:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), CUDA_HOST_REGISTER_PORTABLE)
        return int(rc) == 0
    except Exception:       # noqa: BLE001 - any failure falls back to pin_memory
        return False


def _cuda_host_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:       # noqa: BLE001
        pass


class _HostBuffer:
    """One block's packed bytes in host memory: page-locked on CUDA, plain otherwise."""

    def __init__(self, nbytes: int, pin: bool):
        self.pinned = False
        if pin and nbytes:
            t = torch.empty(nbytes, dtype=torch.uint8)
            if _cuda_host_register(t):
                self.pinned = True
                # unregister before the memory is freed, also if remove() is never called
                self._finalizer = weakref.finalize(self, _unregister_then_drop, t, t.data_ptr())
            else:
                t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.pinned = True
        else:
            t = torch.empty(nbytes, dtype=torch.uint8)
        self.tensor = t

    def release(self) -> None:
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        self.tensor = None


def _unregister_then_drop(t: torch.Tensor, ptr: int) -> None:
    _cuda_host_unregister(ptr)
    del t


# ---------------------------------------------------------------------------------------------
# bookkeeping

@dataclass
class _Entry:
    """One swapped tensor: a frozen parameter or a buffer of an offloaded block."""
    tensor: torch.Tensor           # the Parameter / buffer object itself (its identity is kept)
    name: str                      # its name in the block
    offset: int                    # bytes into the block's packed layout
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    home: torch.device             # where it was before install (restored by remove)


@dataclass
class _Block:
    pos: int                       # position in execution order among the offloaded blocks
    path: str
    module: nn.Module
    entries: list[_Entry]
    nbytes: int
    host: _HostBuffer | None = None
    slot: "_Slot | None" = None
    owns_host: bool = True         # False: another handle's host buffer (`share`), released by that handle


@dataclass
class _Slot:
    buf: torch.Tensor              # uint8 [slot_bytes] on the device
    occupant: _Block | None = None
    in_use: bool = False           # acquired by compute and not yet released
    ready: object = None           # event: the copy into this slot is done (copy stream)
    free: object = None            # event: compute is done with the previous occupant
    stamp: int = 0                 # last acquire/release, for least-recently-used eviction


@dataclass(frozen=True)
class _SavedWeight:
    """What autograd keeps instead of a tensor that points into a slot (the path without recompute)."""
    block: _Block
    offset: int                    # in elements of dtype, from the slot's start
    size: tuple
    stride: tuple
    dtype: torch.dtype


def _tensors(obj):
    """Every tensor in nested tuples, lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---------------------------------------------------------------------------------------------
# the handle

def shared_blocks(share: Sequence["SwapHandle"]) -> dict[str, tuple["SwapHandle", _Block]]:
    """Each block path the handles of `share` swap, with the handle (and its block) whose host copy another
    replica streams it from: the first handle that swaps it."""
    found: dict[str, tuple[SwapHandle, _Block]] = {}
    for h in share:
        for b in h.blocks:
            found.setdefault(b.path, (h, b))
    return found


class SwapHandle:
    """Block swap installed on a model; `remove()` puts every tensor back where it was."""

    def __init__(self, model: nn.Module, paths: Sequence[str], device: torch.device | str, slots: int = 2,
                 pin: bool = True, timing: bool = False, freeze: bool = True, share: Sequence["SwapHandle"] = ()):
        self.model = model
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if len(set(paths)) != len(paths):
            raise ValueError("an offloaded block is listed twice")
        self.timing = timing and self.cuda
        self.stats = {"loads": 0, "bytes": 0, "hits": 0, "misses": 0, "forced": 0}
        self._clock = 0
        self._handles: list = []
        self._saved_ctx: list = []
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._copy_times: list = []
        if freeze:
            for path in paths:
                model.get_submodule(path).requires_grad_(False)
        shared = {path: block for path, (_, block) in shared_blocks(share).items()}
        self.blocks = self._pack(paths, pin and self.cuda, shared)
        self.slot_bytes = _align(max((b.nbytes for b in self.blocks), default=0))
        n_slots = min(slots, len(self.blocks))
        self.slots = [_Slot(torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device))
                      for _ in range(n_slots)]
        self._slot_by_ptr = {s.buf.untyped_storage().data_ptr(): s for s in self.slots}
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            for s in self.slots:
                s.ready, s.free = torch.cuda.Event(), torch.cuda.Event()
        self._install_hooks()

    # --- install / remove --------------------------------------------------------------------
    def _pack(self, paths: Sequence[str], pin: bool, shared: dict[str, _Block]) -> list[_Block]:
        """Copy each block's frozen tensors into its host buffer and leave placeholders behind; a block in
        `shared` (another handle's, by path) takes that block's host buffer instead."""
        swapped: set[int] = set()
        blocks = []
        for pos, path in enumerate(paths):
            module = self.model.get_submodule(path)
            if path in shared:
                blocks.append(self._mirror(pos, module, shared[path]))
                swapped.update(id(e.tensor) for e in blocks[-1].entries)
                continue
            entries, offset = [], 0
            named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
            for name, t in named:
                if id(t) in swapped and not any(e.tensor is t for e in entries):
                    raise ValueError(f"{path}.{name} is shared with another offloaded block")
                if t.is_meta:
                    raise ValueError(f"{path}.{name} is on the meta device: load the weights before installing swap")
                if isinstance(t, nn.Parameter) and t.requires_grad:
                    self._make_resident(t)          # trained inside the block: stays on the device
                    continue
                if any(e.tensor is t for e in entries) or t.numel() == 0:
                    continue
                nbytes = t.numel() * t.element_size()
                entries.append(_Entry(t, name, offset, nbytes, t.dtype, t.shape, t.device))
                offset = _align(offset + nbytes)
                swapped.add(id(t))
            blocks.append(_Block(pos, path, module, entries, offset))
        self._check_not_shared(paths, swapped)
        for block in blocks:
            if block.host is not None:              # (mirrored: filled by the handle it shares)
                continue
            block.host = _HostBuffer(block.nbytes, pin)
            for e in block.entries:
                self._host_view(block, e).copy_(e.tensor.detach().reshape(e.shape))
                e.tensor.data = self._placeholder(e.dtype)      # frees the original storage
        return blocks

    def _mirror(self, pos: int, module: nn.Module, source: _Block) -> _Block:
        """A block packed as `source` was (the same tensors by name, a `block_copy` of it), streaming from
        `source`'s host buffer; its tensors become placeholders on this handle's device."""
        own = dict(module.named_parameters(remove_duplicate=False))
        own.update(module.named_buffers(remove_duplicate=False))
        missing = [e.name for e in source.entries if e.name not in own or own[e.name].dtype != e.dtype]
        if missing:
            raise ValueError(f"{source.path}: cannot share the host copy of a block packed otherwise "
                             f"({', '.join(missing[:3])}); place a SwapHandle.block_copy of it there")
        entries = [_Entry(own[e.name], e.name, e.offset, e.nbytes, e.dtype, e.shape, torch.device("cpu"))
                   for e in source.entries]
        for e in entries:
            e.tensor.data = self._placeholder(e.dtype)
        return _Block(pos, source.path, module, entries, source.nbytes, source.host, owns_host=False)

    def block_copy(self, path: str) -> nn.Module:
        """A copy of offloaded block `path` as packed (placeholders: no bytes; its classes and attributes as
        loading left them), without hooks: what another replica's model holds at `path` to `share` this
        handle's host copy. Take it before the block first runs (its weights are then in no slot)."""
        import copy
        block = next(b for b in self.blocks if b.path == path)
        if block.slot is not None:
            raise RuntimeError(f"{path} is in a slot: copy it before the model runs")
        duplicate = copy.deepcopy(block.module)
        for m in duplicate.modules():
            for hooks in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks, m._backward_pre_hooks,
                          m._forward_hooks_with_kwargs, m._forward_pre_hooks_with_kwargs,
                          m._forward_hooks_always_called):
                hooks.clear()
        return duplicate

    def _check_not_shared(self, paths: Sequence[str], swapped: set[int]) -> None:
        for name, t in list(self.model.named_parameters(remove_duplicate=False)) + \
                list(self.model.named_buffers(remove_duplicate=False)):
            if id(t) in swapped and not any(name == p or name.startswith(p + ".") for p in paths):
                raise ValueError(f"{name} is shared between an offloaded block and the rest of the model")

    def _make_resident(self, p: nn.Parameter) -> None:
        if p.device != self.device:
            self._moved_trainable = getattr(self, "_moved_trainable", [])
            self._moved_trainable.append((p, p.device))
            p.data = p.data.to(self.device)
            if p.grad is not None:
                p.grad = p.grad.to(self.device)

    def _install_hooks(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._step_begins))
        for block in self.blocks:
            m = block.module
            self._handles.append(m.register_forward_pre_hook(
                lambda _m, args, kwargs, b=block: self._forward_enter(b, args, kwargs), with_kwargs=True))
            self._handles.append(m.register_forward_hook(
                lambda _m, _args, out, b=block: self._forward_leave(b, out), always_call=True))

    def remove(self, restore: bool = True) -> None:
        """Remove the hooks and give every swapped tensor its values back, on its original device
        (`restore=False` leaves them empty: for a model about to be discarded)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        while self._saved_ctx:
            self._saved_ctx.pop()[1].__exit__(None, None, None)
        for block in self.blocks:
            for e in block.entries:
                if restore:
                    host = self._host_view(block, e)
                    e.tensor.data = host.clone() if e.home.type == "cpu" else host.to(e.home)
                else:
                    e.tensor.data = self._placeholder(e.dtype)
            block.slot = None
            if block.owns_host:
                block.host.release()
        for p, dev in getattr(self, "_moved_trainable", []):
            p.data = p.data.to(dev)
            if p.grad is not None:
                p.grad = p.grad.to(dev)
        self.blocks, self.slots, self._slot_by_ptr = [], [], {}

    # --- views -------------------------------------------------------------------------------
    @staticmethod
    def _host_view(block: _Block, e: _Entry) -> torch.Tensor:
        return block.host.tensor[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        p = self._placeholders.get(dtype)
        if p is None:
            p = self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return p

    def materialised(self) -> list[str]:
        """Paths of the offloaded blocks whose weights are in a slot now."""
        return [b.path for b in self.blocks if b.slot is not None]

    # --- streams and events ------------------------------------------------------------------
    def _compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # --- the slot ring -----------------------------------------------------------------------
    def _victim(self, protect: set[int]) -> _Slot | None:
        """A slot to load into: empty first, else the least recently released one not protected."""
        free = [s for s in self.slots if not s.in_use and (s.occupant is None or s.occupant.pos not in protect)]
        if not free:
            return None
        empty = [s for s in free if s.occupant is None]
        return empty[0] if empty else min(free, key=lambda s: s.stamp)

    def _evict(self, slot: _Slot) -> None:
        block = slot.occupant
        if block is None:
            return
        if slot.in_use:             # only when a block is needed out of the expected order
            self._release_slot(slot)
            self.stats["forced"] += 1
        for e in block.entries:
            e.tensor.data = self._placeholder(e.dtype)
        block.slot, slot.occupant = None, None

    def _load(self, block: _Block, slot: _Slot) -> None:
        self._evict(slot)
        n = block.nbytes
        dst, src = slot.buf[:n], block.host.tensor
        if self.cuda:
            stream = self.copy_stream
            stream.wait_event(slot.free)            # compute is done with what the slot held
            with torch.cuda.stream(stream):
                if self.timing:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                dst.copy_(src, non_blocking=True)
                slot.ready.record(stream)
                if self.timing:
                    end.record(stream)
                    self._copy_times.append((start, end))
        else:
            dst.copy_(src)
        for e in block.entries:
            e.tensor.data = slot.buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
        block.slot, slot.occupant = slot, block
        slot.stamp = self._tick()
        self.stats["loads"] += 1
        self.stats["bytes"] += n

    def _acquire(self, block: _Block) -> None:
        """Block's weights usable by work enqueued from now on, on the current stream."""
        if block.slot is None:
            slot = self._victim({block.pos})
            if slot is None:                        # every slot busy: take the oldest one
                slot = min((s for s in self.slots), key=lambda s: s.stamp)
            self._load(block, slot)
            self.stats["misses"] += 1
        else:
            self.stats["hits"] += 1
        slot = block.slot
        if self.cuda:
            self._compute_stream().wait_event(slot.ready)
        slot.in_use = True
        slot.stamp = self._tick()

    def _release_slot(self, slot: _Slot) -> None:
        if not slot.in_use:
            return
        slot.in_use = False
        if self.cuda:
            slot.free.record(self._compute_stream())
        slot.stamp = self._tick()

    def _release(self, block: _Block) -> None:
        if block.slot is not None:
            self._release_slot(block.slot)

    def _prefetch(self, positions: list[int]) -> None:
        protect = set(positions) | {s.occupant.pos for s in self.slots if s.in_use and s.occupant}
        for pos in positions:
            block = self.blocks[pos]
            if block.slot is not None:
                continue
            slot = self._victim(protect)
            if slot is None:
                return
            self._load(block, slot)

    def _ahead(self, pos: int, n: int) -> list[int]:
        return [p for p in range(pos + 1, pos + 1 + n) if p < len(self.blocks)]

    def _behind(self, pos: int, n: int) -> list[int]:
        return [p for p in range(pos - 1, pos - 1 - n, -1) if p >= 0]

    # --- hooks -------------------------------------------------------------------------------
    def _step_begins(self, *_):
        # Work enqueued before a new forward is all the previous step's: nothing is in use any more.
        for s in self.slots:
            self._release_slot(s)
        self._prefetch(list(range(min(len(self.slots), len(self.blocks)))))

    def _forward_enter(self, block: _Block, args, kwargs):
        self._acquire(block)
        self._prefetch(self._ahead(block.pos, len(self.slots) - 1))
        if torch.is_grad_enabled():
            inputs = list({id(t): t for t in _tensors((args, kwargs)) if t.requires_grad}.values())
            if inputs:
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, lambda _grads, b=block: self._backward_leave(b), mode="all")
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack_saved, self._unpack_saved)
            ctx.__enter__()
            self._saved_ctx.append((block, ctx))
        return None

    def _forward_leave(self, block: _Block, out):
        if self._saved_ctx and self._saved_ctx[-1][0] is block:
            self._saved_ctx.pop()[1].__exit__(None, None, None)
        self._release(block)
        self._prefetch(self._ahead(block.pos, len(self.slots)))
        if torch.is_grad_enabled() and out is not None:
            outs = list({id(t): t for t in _tensors(out) if t.requires_grad}.values())
            if outs:
                torch.autograd.graph.register_multi_grad_hook(
                    outs, lambda _grad, b=block: self._backward_enter(b), mode="any")
        return None

    def _backward_enter(self, block: _Block) -> None:
        # Autograd runs the nodes of blocks later in forward order first: by now their backward is
        # enqueued, so every slot but this block's can be refilled once the stream passes here.
        for s in self.slots:
            if s.occupant is not block:
                self._release_slot(s)
        self._acquire(block)
        self._prefetch(self._behind(block.pos, len(self.slots) - 1))

    def _backward_leave(self, block: _Block) -> None:
        self._release(block)
        self._prefetch(self._behind(block.pos, len(self.slots)))

    # --- saved tensors (no recompute) --------------------------------------------------------
    # Autograd skips its in-place modification check for tensors that pass through saved-tensor
    # hooks, so other tensors keep their version here and are checked the same way on unpack.
    def _pack_saved(self, t: torch.Tensor):
        slot = None
        if t.device == self.device and t.layout == torch.strided:
            slot = self._slot_by_ptr.get(t.untyped_storage().data_ptr())
        if slot is None or slot.occupant is None:
            return t.detach(), t._version           # detached: holding `t` itself would make a cycle
        return _SavedWeight(slot.occupant, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def _unpack_saved(self, saved):
        if not isinstance(saved, _SavedWeight):
            t, version = saved
            if t._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
                    f"{version} instead (inside a block swapped by ugpum.placement.swap).")
            return t
        block = saved.block
        if block.slot is None or not block.slot.in_use:
            self._acquire(block)
        base = block.slot.buf.view(saved.dtype)
        return base.as_strided(saved.size, saved.stride, saved.offset)

    # --- measurement -------------------------------------------------------------------------
    def copy_seconds(self) -> float:
        """Seconds the copy stream spent copying since the last call (needs timing=True; waits for
        the copies to finish, so call it between steps, not inside one)."""
        if not self._copy_times:
            return 0.0
        self.copy_stream.synchronize()
        total = sum(s.elapsed_time(e) for s, e in self._copy_times) / 1000
        self._copy_times.clear()
        return total

    @property
    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    @property
    def device_bytes(self) -> int:
        return self.slot_bytes * len(self.slots)


def install_swap(model: nn.Module, offloaded: Sequence[str], device: torch.device | str, slots: int = 2,
                 pin: bool = True, timing: bool = False, freeze: bool = True,
                 share: Sequence[SwapHandle] = ()) -> SwapHandle:
    """Swap the blocks at `offloaded` (module paths, in the order the model runs them) between host
    memory and `slots` buffers on `device`, where they compute. The blocks' weights may be anywhere
    (host or device) when called; afterwards only the slots hold any on the device.

    `freeze` (default) first sets requires_grad=False on the blocks' parameters: a frozen base, as
    LoRA training has. With `freeze=False` parameters that require grad stay resident on `device`
    (trained tensors inside a block must not be swapped: updates would not reach the host copy).

    Attach LoRA after this call: adapters are created where the layer's weight is, which is then the
    device (the placeholders live there). Use `remove()` before saving or moving the base model.
    `timing` records CUDA events around each copy (see `SwapHandle.copy_seconds`). `share`: another
    replica's handles, whose host copies of the blocks they also swap this one streams (the module docstring).
    Remove this handle before those.
    """
    return SwapHandle(model, list(offloaded), device, slots, pin, timing, freeze, share)

"""Copy tensors between devices without making the devices wait on each other.

Why: a plain cross-device `Tensor.to` between two GPUs runs on the source device's current stream
after a two-way barrier with the destination's current stream, so each GPU's compute stream waits
for everything already queued on the other one, and a split model's GPUs take turns instead of
working at once. Here a CUDA -> CUDA copy runs on a pair of side streams that belong to that
direction (one on each device) and is ordered by events against exactly the work it needs:

  before  the side stream on the source waits for the source's current stream (the tensor is ready);
  during  the barrier `Tensor.to` inserts is between the two side streams only;
  after   the destination's current stream waits for the copy, nothing else.

Caching-allocator safety: the source is read on the side stream (`record_stream` keeps its memory
from being reused by the source's stream too early) and the copy is allocated on the destination's
side stream but used on its current stream (`record_stream` again). No host synchronisation.

`move` is what callers use: the same device -> the tensor itself; CUDA <-> CUDA -> side streams
(through `Copy`, whose backward copies the gradient back the same way, when the tensor needs a
gradient); anything with a CPU end -> a plain `.to()` (blocking when the destination is the CPU:
a non-blocking device-to-host copy could be read before it lands). Everything here runs the same on
CPU-only machines, without streams.

Staged copies: GeForce cards have no peer access, so CUDA stages their GPU -> GPU copies through host
memory by itself. To measure that path on GPUs that do have peer access, `UGPUM_STAGED_COPIES=1` (or
`with staged_copies():`) makes every CUDA -> CUDA copy go explicitly device -> page-locked host ->
device: down on the source's side stream, up on the destination's once an event says the bytes
landed; still no host synchronisation. Off by default.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch

STAGED_ENV = "UGPUM_STAGED_COPIES"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
_staged_override: bool | None = None     # set by `staged_copies`; None: the environment decides

_streams: dict[tuple[int, int], tuple["torch.cuda.Stream", "torch.cuda.Stream"]] = {}
_streams_lock = threading.Lock()


def as_device(device: torch.device | str) -> torch.device:
    """`device` with an index for CUDA ("cuda" -> "cuda:N" of the current device), so it compares
    equal to the device of a tensor that lives there."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def edge_streams(src: torch.device, dst: torch.device) -> tuple["torch.cuda.Stream", "torch.cuda.Stream"]:
    """The side streams of copies from `src` to `dst`: (one on src, one on dst), made once per direction.

    One pair per direction means copies of one direction stay in the order they were issued (which
    is the order their data becomes ready), and a copy never queues behind the other direction's.
    """
    key = (src.index, dst.index)
    pair = _streams.get(key)
    if pair is None:
        with _streams_lock:
            pair = _streams.get(key)
            if pair is None:
                pair = (torch.cuda.Stream(device=src), torch.cuda.Stream(device=dst))
                _streams[key] = pair
    return pair


def direct_gpu_copy(x: torch.Tensor, dst: torch.device) -> torch.Tensor:
    """`x` (no autograd) copied to another GPU on side streams; see the module docstring."""
    src = x.device
    out_stream, in_stream = edge_streams(src, dst)
    src_compute = torch.cuda.current_stream(src)
    dst_compute = torch.cuda.current_stream(dst)
    out_stream.wait_stream(src_compute)                     # x is ready
    in_stream.wait_stream(out_stream)                       # (orders the copy when src == dst, in tests)
    with torch.cuda.stream(out_stream), torch.cuda.stream(in_stream):
        y = torch.empty_like(x, device=dst)                 # allocated for in_stream
        y.copy_(x, non_blocking=True)                       # on out_stream, barrier with in_stream
    x.record_stream(out_stream)
    x.record_stream(in_stream)
    y.record_stream(dst_compute)
    dst_compute.wait_stream(in_stream)                      # in_stream waited for the copy
    return y


def staged_copies_enabled() -> bool:
    """Whether CUDA -> CUDA copies go through host memory (`staged_copies`, else UGPUM_STAGED_COPIES)."""
    if _staged_override is not None:
        return _staged_override
    value = os.environ.get(STAGED_ENV, "").strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"{STAGED_ENV}={os.environ[STAGED_ENV]!r}: set it to 1 to stage GPU-to-GPU copies "
                     "through host memory, or to 0 (or unset it) to copy directly")


@contextlib.contextmanager
def staged_copies(enabled: bool = True):
    """Stage CUDA -> CUDA copies through host memory (or not) inside the block, whatever the
    environment says. Process-wide, not per thread: the autograd engine's threads copy gradients back
    and the pipeline runs forwards in threads of its own."""
    global _staged_override
    before = _staged_override
    _staged_override = bool(enabled)
    try:
        yield
    finally:
        _staged_override = before


def staged_copy(x: torch.Tensor, dst: torch.device) -> torch.Tensor:
    """`x` (no autograd) copied to `dst` through host memory (see the module docstring).

    Between GPUs the host buffer is page-locked and comes from torch's caching host allocator, which
    does not hand it out again before the events the two non-blocking copies record on their streams
    have passed, so dropping it here is safe. Elsewhere (CPU tensors, in tests) the same two copies
    run plainly, in order."""
    src = x.device
    gpu = src.type == "cuda" and dst.type == "cuda"
    down, up = edge_streams(src, dst) if gpu else (None, None)
    if gpu:
        down.wait_stream(torch.cuda.current_stream(src))    # x is ready
    with torch.cuda.stream(down):                           # (a no-op context without a stream)
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=gpu)
        host.copy_(x, non_blocking=gpu)                     # device -> host
        landed = down.record_event() if gpu else None
    if gpu:
        up.wait_event(landed)                               # the bytes are in host memory
    with torch.cuda.stream(up):
        y = torch.empty(x.shape, dtype=x.dtype, device=dst)  # allocated for `up`
        y.copy_(host, non_blocking=gpu)                     # host -> device
    if gpu:
        dst_compute = torch.cuda.current_stream(dst)
        x.record_stream(down)
        y.record_stream(dst_compute)
        dst_compute.wait_stream(up)
    return y


def gpu_copy(x: torch.Tensor, dst: torch.device) -> tuple[torch.Tensor, "torch.cuda.Stream"]:
    """(`x` copied to the GPU `dst`, the side stream the copy finishes on): staged through host
    memory when `staged_copies_enabled()`, else direct."""
    out_stream, in_stream = edge_streams(x.device, dst)
    if staged_copies_enabled():
        return staged_copy(x, dst), in_stream
    return direct_gpu_copy(x, dst), out_stream


def copy_tensor(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of `x`'s data on `device`, outside autograd (the result needs no gradient)."""
    device = as_device(device)
    x = x.detach()
    if x.device == device:
        return x
    if x.device.type == "cuda" and device.type == "cuda":
        return gpu_copy(x, device)[0]
    return x.to(device, non_blocking=device.type != "cpu")


class Copy(torch.autograd.Function):
    """Differentiable `copy_tensor`: forward copies to the destination, backward copies the gradient
    back, both on side streams.

    Backward contract of the autograd engine (PyTorch's note "Stream sync contract when dealing with
    multi-deviced-ness"): the gradient this node produces must be ready on the node's own stream (the
    destination device's stream the forward ran on), and older PyTorch makes the consumer wait on
    its own device's current stream. Both are made to wait for the copy, and for nothing else.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        ctx.src = x.device
        if x.device == device:
            return x.clone()
        return copy_tensor(x, device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        src = ctx.src
        if grad.device == src:
            return grad, None
        if grad.device.type == "cuda" and src.type == "cuda":
            moved, finished_on = gpu_copy(grad, src)   # src's current stream already waits for it
            torch.cuda.current_stream(grad.device).wait_stream(finished_on)
            return moved, None
        return copy_tensor(grad, src), None


def move(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`: itself when already there; a differentiable copy when `t` needs a gradient."""
    device = as_device(device)
    if t.device == device:
        return t
    if t.requires_grad and torch.is_grad_enabled():
        return Copy.apply(t, device)
    return copy_tensor(t, device)

"""Gradient accumulation as micro-batches flowing through the stages of a split model (DESIGN §5).

The problem: ComfyUI's model forward is one Python loop over all blocks, so "run stage 0 of
micro-batch 2" cannot be called on its own, and we do not rewrite ComfyUI's models.

The design, in three parts:

1. **A forward that pauses at stage boundaries.** Each micro-batch's `model_step` (forward + loss)
   runs in a thread of its own. A forward pre-hook on the first block of every stage after the
   first pauses that thread and hands control back to the scheduler. The threads are used as
   coroutines: exactly one thread runs at any moment (a baton passed with semaphores), so the order
   of work is the schedule's, deterministic, and nothing is shared between threads at the same time.

2. **A backward per stage.** At the pause the hook also cuts the autograd graph: every input of the
   stage's first block that needs a gradient (the hidden state; FLUX.2's double blocks: image and
   text streams) is copied to the stage's device as a new leaf (`copy.copy_tensor`: side streams
   for GPU -> GPU) and the block gets a clone of it (ComfyUI's FLUX.2 blocks add residuals in place,
   which autograd forbids on a leaf). Stage s's backward of micro-batch k is then its own call:
   `torch.autograd.backward(boundary outputs, their gradients)`, the gradients being the leaves'
   `.grad` copied back from stage s+1. The scheduler can therefore put any backward anywhere.
   Everything that carries a gradient from one stage into the next must enter the next stage's first
   block as an argument (true for FLUX.2, Wan and any model whose blocks are chained).

3. **Overlap from asynchronous launches.** The host only *enqueues* GPU work; a device runs its
   queue in order and waits on another device only through the events of a boundary copy. So
   issuing the ops in the schedule's per-stage order is enough for the GPUs to work at once, as long
   as nothing on the host waits for a GPU inside the step (no `.item()`, no blocking copy). The
   losses come back as tensors for that reason.

Schedules (per-stage order of forward F and backward B of micro-batch k):

* ``sequential``: plain gradient accumulation, one micro-batch after another through the whole
  model (no threads, no cuts); 1 micro-batch in flight. The fallback and the reference.
* ``gpipe``: every stage F0 .. F(m-1) then B0 .. B(m-1) (backward in ascending order, so every
  gradient is summed in the same order as `sequential`); m micro-batches in flight everywhere.
* ``1f1b``: stage s runs min(p-1-s, m) forwards, then alternates F and B, then drains; at most
  p - s micro-batches in flight on stage s, the same step time as GPipe for less memory.

On CPU the same logic runs (threads, pauses, cuts, order), just without streams, which is what the
tests exercise. Gradients are exactly those of `sequential`: each parameter receives one gradient per
micro-batch, in ascending micro-batch order, in every schedule.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .copy import as_device, copy_tensor
from .place import Layout
from .route import map_tensors
from .schedules import SCHEDULES, Op, best_schedule, in_flight, op_order, stage_order  # noqa: F401 (re-exported)


@dataclass
class TraceEvent:
    """One op as executed: which thread ran it and when (perf_counter seconds)."""
    kind: str
    stage: int
    micro_batch: int
    thread: str
    start: float
    end: float = 0.0



# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------

class _Abort(BaseException):
    """Raised inside a paused forward to unwind it when the step fails elsewhere."""


_current = threading.local()      # .worker: the _Worker whose forward this thread runs


@dataclass
class _ThreadState:
    """What a new thread must inherit from the caller to run the forward the same way."""
    grad: bool
    autocast: list[tuple[str, torch.dtype]]
    cuda_device: int | None
    streams: list

    @classmethod
    def capture(cls, devices: list[torch.device]) -> "_ThreadState":
        autocast = [(t, torch.get_autocast_dtype(t)) for t in ("cuda", "cpu")
                    if torch.is_autocast_enabled(t)]
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        streams = []
        if cuda:
            for d in {d for d in devices if d.type == "cuda"}:
                s = torch.cuda.current_stream(d)
                if s != torch.cuda.default_stream(d):
                    streams.append(s)
        return cls(torch.is_grad_enabled(), autocast, torch.cuda.current_device() if cuda else None, streams)

    @contextlib.contextmanager
    def applied(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad))
            if self.cuda_device is not None:
                stack.enter_context(torch.cuda.device(self.cuda_device))
            for s in self.streams:
                stack.enter_context(torch.cuda.stream(s))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            yield


class _Threads:
    """Threads kept for the whole process and reused by every step: a new thread pays CUDA's
    per-thread setup on its first kernels (measured on the H200, klein 9B: 40-70 ms per new thread,
    12-17 % of a 4-micro-batch step)."""

    def __init__(self):
        self._idle: queue.SimpleQueue = queue.SimpleQueue()     # job queues of idle threads
        self._count = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[Callable[[], None]], None]) -> None:
        """Run `job(give_back)` on an idle thread (a new one if none); the job calls `give_back()` as
        soon as its thread may take the next job (at the latest, when it returns)."""
        try:
            jobs = self._idle.get_nowait()
        except queue.Empty:
            jobs = queue.SimpleQueue()
            with self._lock:
                self._count += 1
                name = f"ugpum-pipeline-{self._count}"
            threading.Thread(target=self._serve, args=(jobs,), name=name, daemon=True).start()
        jobs.put(job)

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            given: list[bool] = []

            def give_back():
                if not given:
                    given.append(True)
                    self._idle.put(jobs)
            try:
                job(give_back)
            finally:
                give_back()


_THREADS = _Threads()


@dataclass
class _Worker:
    k: int
    micro_batch: Any
    run: "_Run"
    go: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    done: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    stage: int = -1                   # the stage this micro-batch's forward is in (or paused before)
    finished: bool = False
    loss: torch.Tensor | None = None
    error: BaseException | None = None
    # stage s -> [(output of stage s-1, leaf that stage s started from)]
    boundaries: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    started: bool = False
    event: TraceEvent | None = None

    def start(self) -> None:
        self.started = True
        _THREADS.submit(self._main)

    def _main(self, give_back: Callable[[], None]) -> None:
        self.go.acquire()
        _current.worker = self
        try:
            if self.run.aborted:
                raise _Abort()
            self.stage = 0
            self.run.begin_forward(self)
            with self.run.thread_state.applied():
                self.loss = self.run.model_step(self.micro_batch)
            self.run.end_forward(self)
        except _Abort:
            pass
        except BaseException as e:      # handed to the scheduler, raised there
            self.error = e
        finally:
            self.finished = True
            _current.worker = None
            give_back()                 # before the scheduler goes on: the next forward reuses this thread
            self.done.release()

    def pause(self) -> None:
        """Give control back to the scheduler until it resumes this forward."""
        self.done.release()
        self.go.acquire()
        if self.run.aborted:
            raise _Abort()


class _Run:
    """One call of `accumulate` with a pipelined schedule."""

    def __init__(self, model: nn.Module, layout: Layout, model_step, micro_batches, schedule: str,
                 trace: list | None):
        self.model, self.layout, self.model_step, self.schedule = model, layout, model_step, schedule
        self.stages = layout.stage_blocks()
        self.p, self.m = len(self.stages), len(micro_batches)
        self.devices = [as_device(layout.device_of(s[0])) for s in self.stages]
        self.trace = trace
        self.aborted = False
        self.thread_state = _ThreadState.capture(self.devices)
        self.workers = [_Worker(k, mb, self) for k, mb in enumerate(micro_batches)]
        self._handles = []

    # -- hooks ----------------------------------------------------------------------------------
    def install(self) -> None:
        for s in range(1, self.p):
            block = self.model.get_submodule(self.stages[s][0])
            self._handles.append(block.register_forward_pre_hook(
                self._entry_hook(s), with_kwargs=True, prepend=True))   # before the router's hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _entry_hook(self, s: int):
        device = self.devices[s]

        def hook(_module, args, kwargs):
            w = getattr(_current, "worker", None)
            if w is None or w.run is not self:
                return None                          # not a forward this run drives
            if w.stage != s - 1:
                raise RuntimeError(
                    f"pipeline: micro-batch {w.k} entered stage {s} ({self.stages[s][0]}) from stage "
                    f"{w.stage}; the model must run the stages' blocks once each, in order")
            cut: list[tuple[torch.Tensor, torch.Tensor]] = []

            def start_here(t: torch.Tensor) -> torch.Tensor:
                if not t.requires_grad:
                    return t
                leaf = copy_tensor(t, device).requires_grad_()
                cut.append((t, leaf))
                return leaf.clone()       # the block may add into its input in place (FLUX.2)

            args, kwargs = map_tensors(args, start_here), map_tensors(kwargs, start_here)
            w.boundaries[s] = cut
            self.end_forward(w)
            w.stage = s
            w.pause()
            self.begin_forward(w)
            return args, kwargs

        return hook

    # -- trace ----------------------------------------------------------------------------------
    def begin_forward(self, w: _Worker) -> None:
        w.event = TraceEvent("F", w.stage, w.k, threading.current_thread().name, time.perf_counter())

    def end_forward(self, w: _Worker) -> None:
        if self.trace is not None and w.event is not None:
            w.event.end = time.perf_counter()
            self.trace.append(w.event)
        w.event = None

    # -- ops ------------------------------------------------------------------------------------
    def forward(self, k: int, s: int) -> None:
        w = self.workers[k]
        if s == 0:
            w.start()
        w.go.release()
        w.done.acquire()
        if w.error is not None:
            raise w.error
        if s < self.p - 1 and (w.finished or w.stage != s + 1):
            raise RuntimeError(
                f"pipeline: micro-batch {k}'s forward ended in stage {s} without reaching stage {s + 1} "
                f"({self.stages[s + 1][0]} was not called)")
        if s == self.p - 1 and not isinstance(w.loss, torch.Tensor):
            raise TypeError(f"model_step must return the loss tensor, got {type(w.loss).__name__}")

    def backward(self, k: int, s: int) -> None:
        w = self.workers[k]
        event = TraceEvent("B", s, k, threading.current_thread().name, time.perf_counter())
        if s == self.p - 1:
            roots, grads = [w.loss], [None]
        else:
            roots, grads = [], []
            for out, leaf in w.boundaries.pop(s + 1):
                if leaf.grad is not None:
                    roots.append(out)
                    grads.append(copy_tensor(leaf.grad, out.device))
        if roots:
            torch.autograd.backward(roots, grads)
        if s == self.p - 1:
            w.loss = w.loss.detach()
        if self.trace is not None:
            event.end = time.perf_counter()
            self.trace.append(event)

    def run(self) -> list[torch.Tensor]:
        self.install()
        try:
            for op in op_order(self.schedule, self.p, self.m):
                (self.forward if op.kind == "F" else self.backward)(op.micro_batch, op.stage)
        except BaseException:
            self.abort()
            raise
        finally:
            self.remove()
        return [w.loss for w in self.workers]      # every forward has signalled `done` last

    def abort(self) -> None:
        """Unwind every forward still paused (each raises _Abort inside its hook)."""
        self.aborted = True
        for w in self.workers:
            if w.started and not w.finished:
                w.go.release()
                w.done.acquire()
            w.boundaries.clear()
            w.loss = None


def accumulate(model_step: Callable[[Any], torch.Tensor], micro_batches: Sequence, schedule: str,
               layout: Layout, model: nn.Module, trace: list | None = None) -> list[torch.Tensor]:
    """Forward and backward of every micro-batch in `schedule`'s order, leaving the gradients summed
    in the parameters' `.grad` (exactly as sequential accumulation would); returns the losses.

    `model_step(micro_batch)` runs the forward of the placed `model` and returns the loss to
    backpropagate (divide by the number of micro-batches there for a mean). The losses come back
    detached and still on their device: converting one to a float waits for the GPUs, so do it when
    the step is over (or only every few steps). `trace`, if given, receives a `TraceEvent` per op as
    executed. With `sequential` or one stage (`layout.stage_blocks()`), no thread is used.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if schedule == "sequential" or len(micro_batches) == 1:   # one micro-batch: nothing to overlap
        return _sequential(model_step, micro_batches, trace)
    return _Run(model, layout, model_step, micro_batches, schedule, trace).run()


def _sequential(model_step, micro_batches, trace) -> list[torch.Tensor]:
    losses = []
    name = threading.current_thread().name
    for k, mb in enumerate(micro_batches):
        start = time.perf_counter()
        loss = model_step(mb)
        middle = time.perf_counter()
        loss.backward()
        losses.append(loss.detach())
        if trace is not None:        # the whole model is one stage here
            trace += [TraceEvent("F", 0, k, name, start, middle), TraceEvent("B", 0, k, name, middle,
                                                                              time.perf_counter())]
    return losses

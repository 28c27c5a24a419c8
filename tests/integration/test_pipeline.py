"""Pipelined micro-batches (ugpum.placement.pipeline): the LoRA after N AdamW steps equals sequential gradient
accumulation's for every schedule, unsplit and split over two (or three) CPU "devices"; the orders
the schedules claim are the orders that run, slow stages or not.

Every stage here lives on the CPU, so no tensor changes device, but the pipeline's whole logic runs:
threads paused at stage boundaries, graph cuts with per-stage backward, the schedule's order.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from support import comfy_models as cm
from support.toy_dit import ToyDiT
from ugpum.compute.recompute import recompute_blocks
from ugpum.placement.copy import Copy, move
from ugpum.compute.inplace_guard import guard_inplace_residuals
from ugpum.placement.pipeline import SCHEDULES, accumulate, best_schedule, in_flight, op_order, stage_order
from ugpum.placement.place import Layout, place
from ugpum.placement.route import SharedInputCache
from ugpum.compute.lora import attach_lora

M = 4           # micro-batches per step
STEPS = 3
TOL = 1e-6


# ------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Tiny models: one intra-op thread is faster, and far faster on a busy machine (OpenMP teams
    of two thrash when the cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)




class Case:
    """A model with LoRA on every Linear of its blocks, built the same way every time."""

    def __init__(self, kind: str, checkpointing: bool = False, dtype: torch.dtype = torch.float32):
        self.kind = kind
        torch.manual_seed(0)
        if kind == "toy":
            self.model = ToyDiT(dim=16, n_double=3, n_single=3).to(dtype)
            self.blocks = self.model.block_paths()
            self.tail = ("final_layer",)
        elif kind == "flux2":
            self.model = cm.build_tiny_flux2(dtype=dtype, depth=2, depth_single=3,
                                             exact_rope=dtype == torch.float64)
            self.blocks = [f"double_blocks.{i}" for i in range(2)] + [f"single_blocks.{i}" for i in range(3)]
            self.tail = ("final_layer",)
        else:
            self.model = cm.build_tiny_wan(dtype=dtype, num_layers=4, exact_rope=dtype == torch.float64)
            self.blocks = [f"blocks.{i}" for i in range(4)]
            self.tail = ("head",)
        self.model.requires_grad_(False)
        targets = [f"{b}.{name}" for b in self.blocks
                   for name, mod in self.model.get_submodule(b).named_modules() if isinstance(mod, nn.Linear)]
        torch.manual_seed(1)
        self.lora = attach_lora(self.model, targets, rank=2, alpha=2.0, dtype=dtype)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for _, a in self.lora.items():          # B = 0 would give A no gradient in the first step
                a.B.copy_(0.1 * torch.randn(a.B.shape, generator=g, dtype=dtype))
        guard_inplace_residuals(self.model, include_rms=False)   # FLUX.2's in-place residuals
        if checkpointing:
            recompute_blocks(self.model, self.blocks)

    def micro_batch(self, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        if self.kind == "toy":
            dtype = self.model.img_in.weight.dtype
            return dict(x=torch.randn(2, 5, 8, generator=g, dtype=dtype), t=torch.randn(2, 4, generator=g, dtype=dtype))
        if self.kind == "flux2":
            return cm.flux2_inputs(self.model, batch=1, height_latent=4, width_latent=4, seed=seed)
        return cm.wan_inputs(self.model, batch=1, frames=1, height_latent=4, width_latent=4, seed=seed)

    def step(self, mb: dict) -> torch.Tensor:
        extra = {} if self.kind == "toy" else {"transformer_options": {}}
        out = self.model(**mb, **extra)
        target = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
        return (out - target).pow(2).mean() / M

    def layout(self, cuts: tuple[int, ...]) -> Layout:
        bounds = [0, *cuts, len(self.blocks)]
        stages = tuple(tuple(self.blocks[a:b]) for a, b in zip(bounds, bounds[1:]))
        return Layout({b: "cpu" for b in self.blocks}, "cpu", "cpu", self.tail, stages)

    def train(self, schedule: str, layout: Layout | None, trace: list | None = None):
        """STEPS AdamW steps of M micro-batches; the LoRA tensors after them and all losses."""
        placement = place(self.model, layout) if layout is not None else None
        params = [p for _, a in self.lora.items() for p in a.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
        losses = []
        for step in range(STEPS):
            mbs = [self.micro_batch(100 * step + k) for k in range(M)]
            got = accumulate(self.step, mbs, schedule, layout or self.layout(()), self.model, trace=trace)
            losses += [float(x) for x in got]
            opt.step()
            opt.zero_grad(set_to_none=True)
        if placement is not None:
            placement.undo()
        return {p: (a.A.detach().clone(), a.B.detach().clone()) for p, a in self.lora.items()}, losses


def assert_same_lora(got, ref):
    assert got.keys() == ref.keys() and len(got) >= 6
    worst = max(float((g - r).abs().max()) for p in ref for g, r in zip(got[p], ref[p]))
    assert worst <= TOL, f"LoRA differs from sequential accumulation by {worst:.2e}"
    moved = max(float((g - r).abs().max()) for p in ref for g, r in zip(got[p], ref[p]))
    assert moved == moved   # no NaN


CUTS = {"toy": [(), (3,), (2, 4)], "flux2": [(), (1,), (3,)], "wan": [(), (2,)]}


def _check_model(kind: str, checkpointing: bool = False):
    ref, ref_losses = Case(kind, checkpointing).train("sequential", None)   # unplaced, plain loop
    start = Case(kind, checkpointing)
    initial = {p: (a.A.detach().clone(), a.B.detach().clone()) for p, a in start.lora.items()}
    assert max(float((ref[p][0] - initial[p][0]).abs().max()) for p in ref) > 1e-3   # it trained
    for cuts in CUTS[kind]:
        for schedule in SCHEDULES:
            case = Case(kind, checkpointing)
            got, losses = case.train(schedule, case.layout(cuts))
            assert_same_lora(got, ref)
            assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-9)


def test_toy_dit_every_schedule_equals_sequential_accumulation():
    _check_model("toy")


def test_flux2_every_schedule_equals_sequential_accumulation(comfy):
    _check_model("flux2")


def test_wan_every_schedule_equals_sequential_accumulation(comfy):
    _check_model("wan")


def test_flux2_with_block_checkpointing(comfy):
    ref, _ = Case("flux2", checkpointing=True).train("sequential", None)
    plain, _ = Case("flux2").train("sequential", None)
    assert_same_lora(ref, plain)
    case = Case("flux2", checkpointing=True)
    got, _ = case.train("1f1b", case.layout((2,)))
    assert_same_lora(got, ref)


@pytest.mark.parametrize("kind", ["toy", "flux2", "wan"])
def test_pipelined_gradients_match_finite_differences(request, kind):
    """DESIGN §3: never trust split-vs-unsplit equality alone. fp64, split, 1F1B, 3 micro-batches."""
    if kind != "toy":
        request.getfixturevalue("comfy")
    case = Case(kind, dtype=torch.float64)
    layout = case.layout((2,))
    place(case.model, layout)
    mbs = [case.micro_batch(k) for k in range(3)]
    params = [p for _, a in case.lora.items() for p in a.parameters()]
    accumulate(case.step, mbs, "1f1b", layout, case.model)
    grads = [p.grad.clone() for p in params]

    def total() -> float:
        with torch.no_grad():
            return sum(float(case.step(mb)) for mb in mbs)

    h, worst = 1e-6, 0.0
    for i in (0, 1, len(params) // 2, len(params) - 2, len(params) - 1):   # first, middle, last stage
        p, g = params[i], grads[i]
        j = int(g.abs().argmax())
        with torch.no_grad():
            old = p.view(-1)[j].item()
            p.view(-1)[j] = old + h
            up = total()
            p.view(-1)[j] = old - h
            down = total()
            p.view(-1)[j] = old
        fd = (up - down) / (2 * h)
        worst = max(worst, abs(fd - g.view(-1)[j].item()) / max(abs(fd), 1e-12))
    assert worst < 1e-6, f"pipelined gradient vs central differences: relative error {worst:.1e}"


# ------------------------------------------------------------------------------------------
# orders
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_op_order_keeps_stage_orders_and_dependencies(schedule, p, m):
    order = op_order(schedule, p, m)
    assert len(order) == len(set(order)) == 2 * p * m
    for s in range(p):
        assert [(o.kind, o.micro_batch) for o in order if o.stage == s] == stage_order(schedule, s, p, m)
    pos = {(o.kind, o.stage, o.micro_batch): i for i, o in enumerate(order)}
    for k in range(m):
        for s in range(p):
            if s:
                assert pos[("F", s - 1, k)] < pos[("F", s, k)]
            after = ("B", s + 1, k) if s < p - 1 else ("F", s, k)
            assert pos[after] < pos[("B", s, k)]


def _max_in_flight(events, stage):
    live = peak = 0
    for e in events:
        if e.stage == stage:
            live += 1 if e.kind == "F" else -1
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3])
def test_executed_order_is_the_schedule_with_slow_stages(schedule, p):
    case = Case("toy")
    layout = case.layout((3,) if p == 2 else (2, 4))
    placement = place(case.model, layout)
    stages = layout.stage_blocks()
    entered = []           # (thread, stage) as the model itself sees it: hooks on each stage's first block
    handles = [case.model.get_submodule(blocks[0]).register_forward_pre_hook(
        lambda *_, s=s: entered.append((threading.current_thread().name, s))) for s, blocks in enumerate(stages)]
    slow = case.model.get_submodule(stages[1][0]).register_forward_pre_hook(lambda *_: time.sleep(0.003))
    mbs = [case.micro_batch(k) for k in range(M)]
    traces = []
    for sleep in (True, False):
        if not sleep:
            slow.remove()
        trace = []
        accumulate(case.step, mbs, schedule, layout, case.model, trace=trace)
        traces.append([(e.kind, e.stage, e.micro_batch, e.thread) for e in trace])
        for s in range(p):
            assert [(e.kind, e.micro_batch) for e in trace if e.stage == s] == stage_order(schedule, s, p, M)
            assert _max_in_flight(trace, s) == (M if schedule == "gpipe" else min(M, p - s))
        # each micro-batch's forward runs in a pipeline thread of its own, backwards in the caller's;
        # one at a time
        main = threading.current_thread().name
        thread_of = {e.micro_batch: e.thread for e in trace if e.kind == "F"}
        assert all(e.thread == (thread_of[e.micro_batch] if e.kind == "F" else main) for e in trace)
        assert all(t.startswith("ugpum-pipeline") for t in thread_of.values())
        span = {k: (min(e.start for e in trace if e.kind == "F" and e.micro_batch == k),
                    max(e.end for e in trace if e.kind == "F" and e.micro_batch == k)) for k in range(M)}
        for j in range(M):           # forwards paused at the same time never share a thread
            for k in range(j + 1, M):
                if span[j][0] < span[k][1] and span[k][0] < span[j][1]:
                    assert thread_of[j] != thread_of[k]
        assert all(b.start >= a.end for a, b in zip(trace, trace[1:]))
        # micro-batch 1 entered stage 0 while micro-batch 0 was paused before stage 1
        assert entered.index((thread_of[1], 0)) < entered.index((thread_of[0], 1))
        entered.clear()
    assert [[e[:3] for e in t] for t in traces] == [[e[:3] for e in traces[0]]] * 2   # order independent of timing
    for h in handles:
        h.remove()
    placement.undo()
    assert len(_pipeline_threads()) <= M      # the same threads served both steps


def test_error_in_a_micro_batch_propagates_and_unwinds():
    case = Case("toy")
    layout = case.layout((3,))
    placement = place(case.model, layout)
    calls = []

    def step(mb):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise ValueError("bad micro-batch")
        return case.step(mb)

    with pytest.raises(ValueError, match="bad micro-batch"):
        accumulate(step, [case.micro_batch(k) for k in range(M)], "gpipe", layout, case.model)
    assert len(_pipeline_threads()) <= M      # the unwound forwards gave their threads back
    block = case.model.get_submodule(layout.stage_blocks()[1][0])
    assert len(block._forward_pre_hooks) == 1             # only the router's is left
    losses = accumulate(case.step, [case.micro_batch(k) for k in range(M)], "1f1b", layout, case.model)
    assert len(losses) == M and all(x.requires_grad is False for x in losses)
    assert len(_pipeline_threads()) <= M
    placement.undo()


def test_model_that_skips_a_stage_is_refused():
    case = Case("toy")
    layout = case.layout((3,))

    def step(mb):                              # runs only the head: never reaches stage 1
        return case.model.img_in(mb["x"]).sum()

    with pytest.raises(RuntimeError, match="without reaching stage 1"):
        accumulate(step, [case.micro_batch(0), case.micro_batch(1)], "gpipe", layout, case.model)
    assert len(_pipeline_threads()) <= M


def _pipeline_threads() -> list[str]:
    """Live pipeline threads (kept for reuse across steps, so their number stays at the most
    micro-batches ever in flight)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("ugpum-pipeline")]


# ------------------------------------------------------------------------------------------
# small pieces
# ------------------------------------------------------------------------------------------

def test_in_flight_and_best_schedule():
    assert in_flight("sequential", 2, 8) == 1
    assert in_flight("gpipe", 2, 8) == 8
    assert in_flight("1f1b", 2, 8) == 2 and in_flight("1f1b", 4, 3) == 3
    stage = lambda a, b, off=(): SimpleNamespace(blocks=[a, b], offloaded=list(off))     # noqa: E731
    fast = SimpleNamespace(stages=[stage(0, 8), stage(8, 16)],
                           step_s={"sequential": [2.0 * m for m in range(1, 9)],
                                   "pipelined": [1.0 * (m + 1) for m in range(1, 9)]})
    assert best_schedule(fast, 1) == "sequential"
    assert best_schedule(fast, 4) == "1f1b"
    one = SimpleNamespace(stages=[stage(0, 16), stage(16, 16)], step_s=fast.step_s)
    assert best_schedule(one, 4) == "sequential"
    slow = SimpleNamespace(stages=fast.stages, step_s={"sequential": [1.0] * 8, "pipelined": [2.0] * 8})
    assert best_schedule(slow, 4) == "sequential"
    swapping = SimpleNamespace(stages=[stage(0, 8), stage(8, 16, [12, 13])], step_s=fast.step_s)
    assert best_schedule(swapping, 4) == "sequential"


def test_shared_input_copies_belong_to_their_thread():
    cache = SharedInputCache()
    t = torch.ones(4)
    meta = torch.device("meta")
    a = cache.move(t, meta)
    assert cache.move(t, meta) is a and cache.copied_bytes == 16
    seen = {}

    def other():
        seen["first"] = cache.move(t, meta)
        seen["again"] = cache.move(t, meta)
        cache.reset()

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert seen["first"] is not a and seen["again"] is seen["first"]
    assert cache.move(t, meta) is a                # the other thread's reset left ours alone
    assert cache.copied_bytes == 32


def test_copy_on_one_device_is_a_differentiable_clone():
    x = torch.randn(3, requires_grad=True)
    assert move(x, "cpu") is x
    y = Copy.apply(x, torch.device("cpu"))
    assert y is not x and y.data_ptr() != x.data_ptr()
    y.add_(1.0)                                     # in place on the copy is allowed
    (y * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


# ------------------------------------------------------------------------------------------
# one GPU (skipped without CUDA): the stream choreography and two stages on one device
# ------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_side_stream_copy_waits_for_its_producer():
    from ugpum.placement.copy import direct_gpu_copy
    dev = torch.device("cuda", 0)
    a = torch.randn(2048, 2048, device=dev)
    for _ in range(3):
        x = a
        for _ in range(20):                   # keep the compute stream busy when the copy is issued
            x = torch.tanh(x @ a) * 0.5
        y = direct_gpu_copy(x, dev)                # src == dst: two side streams on one GPU, same events
        assert y.data_ptr() != x.data_ptr()
        torch.testing.assert_close(y, x, rtol=0, atol=0)


@cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_on_one_gpu_equal_sequential(schedule):
    def run(sched, layout_cuts):
        case = Case("toy")
        case.model.cuda()
        for _, a in case.lora.items():
            a.cuda()
        blocks = case.blocks
        bounds = [0, *layout_cuts, len(blocks)]
        stages = tuple(tuple(blocks[a:b]) for a, b in zip(bounds, bounds[1:]))
        layout = Layout({b: "cuda:0" for b in blocks}, "cuda:0", "cuda:0", case.tail, stages)
        mbs = [{k: v.cuda() for k, v in case.micro_batch(k).items()} for k in range(M)]
        placement = place(case.model, layout)
        opt = torch.optim.AdamW([p for _, a in case.lora.items() for p in a.parameters()], lr=1e-2)
        for _ in range(STEPS):
            accumulate(case.step, mbs, sched, layout, case.model)
            opt.step()
            opt.zero_grad(set_to_none=True)
        placement.undo()
        return {p: (a.A.detach().cpu(), a.B.detach().cpu()) for p, a in case.lora.items()}

    assert_same_lora(run(schedule, (3,)), run("sequential", ()))

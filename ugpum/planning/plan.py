"""Contiguous stages over devices (+ a CPU swap tier), chosen to minimise the slowest stage, with
the forecast a user reads before loading anything (DESIGN §5)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

from . import cost
from ..arch.base import ACT_BYTES, WEIGHT_BYTES, ArchSpec, Workload
from ..compute import modes
from ..compute.recompute import SELECTIVE_CHECKPOINTING
from ..compute.modes import (AUTO, EXACT, fastest_mode_for, mode_named, modes_run_by, tensor_core_modes,
                             within_quality_bound)
from .devices import Device, gpu_to_gpu_gbps, host_memory, speed_assumed
from ..placement.schedules import best_schedule, in_flight as held_in_flight
from ..wording import EngineError, setting

GIB = cost.GIB
MIB = 1024 ** 2
# A hand-described card's total includes what the CUDA context takes before training starts (an H100
# with torch 2.11: 0.64 GiB of the process's use outside PyTorch's allocator, bench/results/calibration_fit.jsonl
# fit-8's out-of-memory message). cuBLAS and attention workspaces come from the allocator, so the forecast
# counts them (cost.block_peak_extra_bytes), and the allocator's own slack too (cost.allocator_bytes).
CUDA_CONTEXT = 0.64 * GIB
# The share of a device's usable memory a plan leaves free: the allocator's slack varies between runs and
# steps (the 8 GiB card's first step reserved 0.76 GiB beyond its allocations, its second step 0.83 GiB and
# more, bench/results/calibration_fit.jsonl), and a forecast at the very edge must not decide a run.
HEADROOM = 0.03
MAX_MICRO_BATCHES = 8
# Recomputed blocks may keep their self-attention outputs (`Workload.attention_kept`, where faster; False: never):
# where this torch has selective checkpointing
KEEP_ATTENTION = SELECTIVE_CHECKPOINTING


class PlanError(ValueError, EngineError):
    """The request cannot be planned; the message says what is missing and what would fit."""


@dataclass
class Stage:
    device: str                 # the device's label
    torch_device: str | None
    blocks: list[int]           # [first, end_exclusive]
    offloaded: list[int]        # block indices streamed from pinned host memory
    forecast_gib: float
    budget_gib: float
    seconds: float              # per micro-batch, forward + backward
    detail_gib: dict[str, float] = field(default_factory=dict)
    kept_activations: list[int] = field(default_factory=list)   # blocks not recomputed in backward
    kept_gib: float = 0.0       # what keeping them holds beyond recomputing every block


@dataclass
class Plan:
    model: str
    workload: dict
    grad_accum: int
    stages: list[Stage]
    offloaded_blocks: list[int]
    boundary_mib: float
    crossing_bytes_per_step: int
    swap_bytes_per_step: int
    step_s: dict[str, list[float]]      # schedule -> seconds per step for 1..8 micro-batches
    predicted_step_s: float             # at grad_accum, best schedule
    swap_forecast: dict | None          # one GPU (the first) with block swap
    verdict: str
    block_paths: list[str]
    schedule: str = "sequential"        # the micro-batch order the run uses (ugpum.placement.pipeline)
    in_flight: int = 1                  # micro-batches whose activations a stage holds at once
    base_compute: str = "bf16"          # the frozen base's matmuls this plan was made for (auto resolved)
    base_compute_note: str = ""         # why, when base_compute = auto chose
    # the other modes' plans: those auto weighed, or the quantised ones beside a bf16 plan that swaps
    alternatives: list[dict] = field(default_factory=list)
    recompute: str = "all"              # the setting this plan was made for (ugpum.arch.base.RECOMPUTE_SETTINGS)
    recompute_saved_s: float = 0.0      # seconds per step the kept activations save against recompute all
    forecast_host_gib: float = 0.0      # the process's peak host memory (pinned swap copies included)
    inputs_on_host_gib: float = 0.0     # the recomputed blocks' inputs held in host memory (Workload.inputs_on_host)
    inputs_on_host_s: float = 0.0       # the seconds a micro-batch spends copying them out and back
    assumed: list[str] = field(default_factory=list)   # per device: the memory, speed and link the forecast takes
    # Replicas (ugpum.planning.space): several copies of the model side by side, each with its own plan over its
    # GPU(s) (`replicas`, in device order) training `shares` of the step's micro-batches, their LoRA gradients
    # averaged each step (`average_s`); the fields above are then the first replica's, but for the step's
    # forecast, host memory and verdict. Empty: one copy, this plan.
    replicas: list["Plan"] = field(default_factory=list)
    shares: list[int] = field(default_factory=list)
    average_s: float = 0.0
    runs_as: str = ""                   # replicas: "one process" or "processes" (ugpum.planning.replicas)
    layouts: list[dict] = field(default_factory=list)     # every layout weighed, its best plan's forecast (the table)

    @property
    def copies(self) -> list["Plan"]:
        """The plan of each copy of the model that trains: the replicas', or this one."""
        return self.replicas or [self]

    def planned_workload(self) -> Workload:
        """The workload this plan was made for, from its record (less the older names and the derived keys)."""
        known = {f.name for f in dataclasses.fields(Workload)}
        return Workload(**{k: v for k, v in self.workload.items() if k in known})

    @property
    def kept_activations(self) -> list[int]:
        """Every block that keeps its activations (is not recomputed in backward), over all stages."""
        return [i for s in self.stages for i in s.kept_activations]

    def to_json(self) -> dict:
        return dict(dataclasses.asdict(self), kept_activations=self.kept_activations)


@dataclass(frozen=True)
class Layout:
    """The blocks of one workload over the devices with their forecast (`_solve`): what a Plan is built
    from, once, with the choices made around it (schedule, base compute)."""
    stages: list[Stage]
    offloaded_blocks: list[int]
    boundary_mib: float
    forecast_host_gib: float
    crossing_bytes_per_step: int
    swap_bytes_per_step: int
    step_s: dict[str, list[float]]
    predicted_step_s: float
    recompute_saved_s: float
    inputs_on_host_gib: float = 0.0
    inputs_on_host_s: float = 0.0

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def usable_bytes(device: Device) -> float:
    """What training can have of `device`: a detected GPU's free memory (read with its CUDA context made,
    and with whatever the desktop holds at that moment); a card described by hand, its total less the
    CUDA context; either less what is left to the desktop (`Device.desktop_bytes`)."""
    context = CUDA_CONTEXT if device.torch_device is None else 0
    return device.free_bytes - context - device.desktop_bytes


def budget_bytes(device: Device) -> float:
    """What a plan may fill on `device`: its usable memory less the headroom."""
    return usable_bytes(device) * (1 - HEADROOM)


def memory_assumed(device: Device) -> str:
    """How the plan reads `device`'s memory, in words."""
    if device.torch_device is not None:
        what = f"{device.free_bytes / GIB:.1f} GiB free when planned"
        if device.desktop_bytes:
            what += f" less {device.desktop_bytes / GIB:g} for the desktop to grow (it drives a display)"
    else:
        what = (f"{device.total_bytes / GIB:g} GiB less {CUDA_CONTEXT / GIB:.2f} for the CUDA context and "
                f"{device.desktop_bytes / GIB:g} for the desktop")
    return f"{what}, {HEADROOM:.0%} left free: a budget of {budget_bytes(device) / GIB:.1f} GiB"


class StageCosts:
    """Costs of one stage (a block range on one device), cached for the partition search."""

    def __init__(self, spec: ArchSpec, devices: list[Device], w: Workload, in_flight: int):
        self.spec, self.devices, self.w, self.in_flight = spec, devices, w, in_flight
        self.hidden = spec.boundary_bytes(w)
        self.weight = [cost.block_weight_bytes(b, w) for b in spec.blocks]
        self.lora = [cost.lora_bytes(b, w) for b in spec.blocks]
        # per block, indexed by whether it is recomputed in backward (False: it keeps its activations)
        self.kept = {r: [cost.block_activation_bytes(spec, b, w, r) for b in spec.blocks] for r in (False, True)}
        self.extra = {r: [cost.block_peak_extra_bytes(spec, b, w, r) for b in spec.blocks] for r in (False, True)}
        # inputs on host: a recomputed block keeps nothing on the GPU; its input comes back for its backward
        self.on_host = self.kept[True] if w.inputs_on_host else [0.0] * len(spec.blocks)
        if w.inputs_on_host:
            self.extra[True] = [e + k for e, k in zip(self.extra[True], self.kept[True])]
            self.kept[True] = [0.0] * len(spec.blocks)
        self.allocator = cost.allocator_bytes(spec, w)
        # recompute = auto keeps the largest savings first (the same order on every device: seconds scale
        # with 1 / its rate), among equal savings (FLUX.2's double and single blocks) the fewest bytes first
        saving = [cost.recompute_seconds(spec, b, w, 1.0) for b in spec.blocks]
        top = max(saving, default=1.0) or 1.0
        self.keep_order = sorted(range(len(spec.blocks)), key=lambda i: (
            -round(saving[i] / top, 9), self.kept[False][i] - self.kept[True][i], i))
        # embedders and modulations are held like the blocks (1 byte each in fp8 weights), except under a
        # quantised base, which quantises only the blocks' Linears: the rest stays as loaded
        outside = WEIGHT_BYTES[w.loaded_dtype if mode_named(w.base_compute).quantises else w.held_dtype]
        self.head = spec.head_params * outside + w.batch * w.text_tokens * spec.context_dim * ACT_BYTES
        self.tail = spec.tail_params * outside
        self.stage = lru_cache(maxsize=None)(self._stage)
        self._block_seconds = lru_cache(maxsize=None)(self._block_seconds_at)

    def fixed_kept(self, a: int, b: int) -> tuple[int, ...]:
        """The blocks of [a, b) that keep their activations before auto chooses any: every one under
        recompute = none (swapped ones too: ugpum.placement.swap rebuilds their saved tensors), else none."""
        return tuple(range(a, b)) if self.w.recompute == "none" else ()

    def _memory(self, k: int, a: int, b: int, offloaded: tuple[int, ...],
                kept: tuple[int, ...] | None = None) -> dict[str, float]:
        """Stage k's memory for blocks [a, b), `offloaded` streamed, `kept` keeping their activations
        (None: `fixed_kept`)."""
        first, last = k == 0, k == len(self.devices) - 1
        resident = [i for i in range(a, b) if i not in offloaded]
        kept = self.fixed_kept(a, b) if kept is None else kept
        busy = b > a or first or last
        mem = {
            "weights": sum(self.weight[i] for i in resident)
            + (self.head if first else 0) + (self.tail if last else 0),
            "swap_slots": 2 * max((self.weight[i] for i in offloaded), default=0),
            "lora": sum(self.lora[a:b]),
            "activations": self.in_flight * sum(self._each(self.kept, kept, a, b))
            + max(self._each(self.extra, kept, a, b), default=0)
            + (self.spec.shared_input_bytes(self.w) + 2 * self.hidden if busy else 0),
            "allocator": self.allocator if busy else 0,
        }
        return mem

    @staticmethod
    def _each(by_choice: dict, kept: tuple[int, ...], a: int, b: int) -> list[float]:
        """Per block of [a, b): its value of `by_choice` (indexed by recomputed) under its choice;
        `kept` holds blocks of [a, b) only."""
        if len(kept) in (0, b - a):                    # (all one way: the common case, kept fast)
            return by_choice[not kept][a:b]
        keep = set(kept)
        return [by_choice[i not in keep][i] for i in range(a, b)]

    def _stage(self, k: int, a: int, b: int):
        """(seconds, memory dict, offloaded, kept) or None if the range cannot fit on device k."""
        budget = budget_bytes(self.devices[k])
        # a swap set changes only the resident weights and the two slots (`_memory`): counted as such
        offloaded = self._first_swap_that_fits(a, b, sum(self._memory(k, a, b, ()).values()) - budget)
        if offloaded is None:
            return None
        # The order is deliberate: the swap set above is the smallest that fits with every block
        # recomputed (a swapped block costs its bytes over the host link twice a step, far more than a
        # recomputed forward), and only the memory then left over keeps activations (auto).
        kept = self._keep_what_fits(k, a, b, offloaded, budget) if self.w.recompute == "auto" else self.fixed_kept(a, b)
        return self.seconds(k, a, b, offloaded, kept), self._memory(k, a, b, offloaded, kept), offloaded, kept

    def seconds(self, k: int, a: int, b: int, offloaded: tuple[int, ...], kept: tuple[int, ...]) -> float:
        """Stage k's seconds per micro-batch: its blocks' compute (a kept block skips its recompute) plus
        the swap copies that compute cannot hide (forward and backward each hide one copy's worth)."""
        dev = self.devices[k]
        block_s = self._block_seconds(dev.tflops_bf16)
        each = [(block_s[i not in kept][i], cost.forward_share(i not in kept)) for i in range(a, b)]
        compute = sum(s for s, _ in each)
        forward = sum(s * share for s, share in each)
        transfer = sum(self.weight[i] for i in offloaded) / (dev.host_gbps * 1e9)
        # inputs on host: each recomputed block's input out in forward and back in backward, on the compute stream
        inputs = 2 * sum(self.on_host[i] for i in range(a, b) if i not in kept) / (dev.host_gbps * 1e9)
        return compute + inputs + max(0.0, transfer - forward) + max(0.0, transfer - (compute - forward))

    def _block_seconds_at(self, tflops: float) -> dict[bool, list[float]]:
        """Each block's seconds on a device of `tflops`, indexed by whether it is recomputed (asked once per rate:
        the partition search weighs each block in thousands of stage ranges)."""
        return {r: [cost.block_seconds(self.spec, b, self.w, tflops, r) for b in self.spec.blocks]
                for r in (False, True)}

    def _keep_what_fits(self, k: int, a: int, b: int, offloaded: tuple[int, ...], budget: float) -> tuple[int, ...]:
        """recompute = auto: the resident blocks of [a, b) whose activations the budget still holds, at
        `in_flight` micro-batches each, the largest saving first (`keep_order`); a block that does not
        fit is passed over for smaller ones after it. Swapped blocks are always recomputed."""
        resident = tuple(i for i in range(a, b) if i not in offloaded)
        if sum(self._memory(k, a, b, offloaded, resident).values()) <= budget:
            return resident                              # (a large budget: no need to choose)
        # `_memory` with a block more kept, counted by difference: its kept bytes for every micro-batch in
        # flight instead of its recomputed ones, and the largest of the blocks' peak extras
        room = budget - sum(self._memory(k, a, b, offloaded, ()).values())
        extras = self._each(self.extra, (), a, b)
        peak, kept = max(extras, default=0), []
        for i in self.keep_order:
            if a <= i < b and i not in offloaded:
                trial = extras[:i - a] + [self.extra[False][i]] + extras[i - a + 1:]
                grows = self.in_flight * (self.kept[False][i] - self.kept[True][i]) + max(trial) - peak
                if grows <= room:
                    kept.append(i)
                    room, peak, extras = room - grows, max(trial), trial
        return tuple(sorted(kept))

    def _first_swap_that_fits(self, a: int, b: int, excess: float) -> tuple[int, ...] | None:
        """The first of `_swap_choices(a, b)` that frees `excess` bytes (its weights less two slots of its
        largest block), or None. Counted, not listed: within a slot size each choice takes one block more, the
        largest first, so the bytes it frees are a running sum (the partition search asks thousands of ranges)."""
        if excess <= 0:
            return ()
        for pools in self._swap_tiers(a, b):
            slots, freed, count = 2 * self.weight[pools[0][0]], 0, 0
            for i in (i for pool in pools for i in pool):
                freed, count = freed + self.weight[i], count + 1
                if freed - slots >= excess:
                    return self._chosen(pools, count)
        return None

    def _swap_choices(self, a: int, b: int):
        """Sets of blocks of [a, b) to stream from host memory, to try in this order. The GPU keeps two
        slots of the largest swapped block, so the bytes streamed per step are about the memory missing
        plus those slots: the smallest slot size that can free enough wins, and under it the largest
        blocks first (fewer copies), evenly spaced within a size so each copy hides behind the resident
        blocks computed before it. (Largest-first streamed klein 9B's 8 leading double blocks back to
        back: 1.09x the unconstrained step at a 16 GiB cap on the H200; this choice: 1.00x.)"""
        yield ()
        for pools in self._swap_tiers(a, b):
            for count in range(1, sum(len(p) for p in pools) + 1):
                yield self._chosen(pools, count)

    def _swap_tiers(self, a: int, b: int) -> list[list[list[int]]]:
        """Per slot size, smallest first: the blocks of [a, b) of that size and below, grouped by size, largest
        first."""
        by_size: dict[int, list[int]] = {}
        for i in range(a, b):
            by_size.setdefault(self.weight[i], []).append(i)
        sizes = sorted(by_size)
        return [[by_size[size] for size in reversed(sizes[:top + 1])] for top in range(len(sizes))]

    @staticmethod
    def _chosen(pools: list[list[int]], count: int) -> tuple[int, ...]:
        """`count` blocks, from the first pool on, evenly spaced within each."""
        chosen: list[int] = []
        for pool in pools:
            take = min(count - len(chosen), len(pool))
            chosen += [pool[int((j + 0.5) * len(pool) / take)] for j in range(take)]
        return tuple(sorted(chosen))

    def key(self, k: int, a: int, b: int):
        """Sort key of one stage: slowest first, then bytes streamed, then memory pressure."""
        r = self.stage(k, a, b)
        if r is None:
            return None
        seconds, mem, offloaded, _ = r
        return (seconds, sum(self.weight[i] for i in offloaded),
                sum(mem.values()) / max(budget_bytes(self.devices[k]), 1))


def combine_keys(x, y):
    """Key of two stage groups: the slowest stage decides; then total bytes swapped, then the
    fullest device. (Only the first part is guaranteed optimal; the rest breaks ties.)"""
    return max(x[0], y[0]), x[1] + y[1], max(x[2], y[2])


def best_split(ev: StageCosts) -> list[int] | None:
    """Stage boundaries [0, c1, ..., n] minimising the combined stage key (exact dynamic program)."""
    n, p = len(ev.spec.blocks), len(ev.devices)
    # best[k][j]: best key for blocks [0, j) on devices 0..k; choice[k][j] the start of stage k.
    best = [[None] * (n + 1) for _ in range(p)]
    choice = [[0] * (n + 1) for _ in range(p)]
    for j in range(n + 1):
        best[0][j] = ev.key(0, 0, j)
    for k in range(1, p):
        for j in range(n + 1):
            for i in range(j + 1):
                if best[k - 1][i] is None:
                    continue
                here = ev.key(k, i, j)
                if here is None:
                    continue
                cand = combine_keys(best[k - 1][i], here)
                if best[k][j] is None or cand < best[k][j]:
                    best[k][j], choice[k][j] = cand, i
    if best[p - 1][n] is None:
        return None
    cuts, j = [n], n
    for k in range(p - 1, 0, -1):
        j = choice[k][j]
        cuts.append(j)
    return [0] + cuts[::-1]


def _step_times(ev: StageCosts, stages: list[Stage], upto: int = MAX_MICRO_BATCHES
                ) -> tuple[dict[str, list[float]], int, float]:
    """({schedule: s/step for 1..upto micro-batches}, boundary crossings, bytes of shared inputs per step)."""
    busy = [s for s in stages if s.blocks[1] > s.blocks[0]]
    cross_s, crossings = 0.0, 0
    for x, y in zip(busy, busy[1:]):
        if x.torch_device is None or x.torch_device != y.torch_device:
            dx = ev.devices[stages.index(x)]
            dy = ev.devices[stages.index(y)]
            cross_s += 2 * ev.hidden / (gpu_to_gpu_gbps(dx, dy) * 1e9)   # activation + its gradient
            crossings += 1
    shared = ev.spec.shared_input_bytes(ev.w) * max(0, len(busy) - 1)
    shared_s = shared / (min(d.host_gbps for d in ev.devices) * 1e9) if shared else 0.0
    t = [s.seconds for s in busy]
    sequential = [m * (sum(t) + cross_s) + shared_s for m in range(1, upto + 1)]
    pipelined = [(m + len(t) - 1) * max(t) + cross_s + shared_s for m in range(1, upto + 1)]
    return {"sequential": sequential, "pipelined": pipelined}, crossings, shared


def manual_cuts(ev: StageCosts, split: list[int]) -> list[int]:
    """Stage boundaries from block counts per device; PlanError when they do not add up or fit."""
    n, p = len(ev.spec.blocks), len(ev.devices)
    if len(split) != p or sum(split) != n or min(split) < 0:
        raise PlanError(f"manual split {split}: give {p} block counts (one per device) adding up to {n}")
    cuts = [0]
    for count in split:
        cuts.append(cuts[-1] + count)
    for k in range(p):
        if ev.stage(k, cuts[k], cuts[k + 1]) is None:
            raise PlanError(f"manual split {split}: blocks {cuts[k]}-{cuts[k + 1] - 1} do not fit on "
                            f"{ev.devices[k].label} even with block swap; leave the split empty to let the planner choose")
    return cuts


def _solve(spec: ArchSpec, devices: list[Device], w: Workload, grad_accum: int, in_flight: int,
           split: list[int] | None = None, kind: str | None = None) -> Layout | None:
    """The layout of the best split (or `split`), its step forecast for the schedule `kind` ("sequential" or
    "pipelined"; None: the faster of the two)."""
    ev = StageCosts(spec, devices, w, in_flight)
    cuts = manual_cuts(ev, split) if split else best_split(ev)
    if cuts is None:
        return None
    stages, all_recomputed = [], []
    for k, dev in enumerate(devices):
        a, b = cuts[k], cuts[k + 1]
        seconds, mem, offloaded, kept = ev.stage(k, a, b)
        kept_bytes = sum(mem.values()) - sum(ev._memory(k, a, b, offloaded, ()).values())
        stages.append(Stage(dev.label, dev.torch_device, [a, b], list(offloaded),
                            round(sum(mem.values()) / GIB, 3), round(budget_bytes(dev) / GIB, 3),
                            seconds, {key: round(v / GIB, 3) for key, v in mem.items()}, list(kept),
                            round(kept_bytes / GIB, 3)))
        all_recomputed.append(dataclasses.replace(stages[-1], seconds=ev.seconds(k, a, b, offloaded, ())))
    m = max(grad_accum, 1)
    upto = max(m, MAX_MICRO_BATCHES)
    step_s, crossings, shared = _step_times(ev, stages, upto)
    offloaded = [i for s in stages for i in s.offloaded]
    per_mb_crossing = crossings * 2 * ev.hidden
    recomputing, _, _ = _step_times(ev, all_recomputed, upto)

    def at_m(times):
        return times[kind][m - 1] if kind else min(times["sequential"][m - 1], times["pipelined"][m - 1])
    predicted = at_m(step_s)
    on_host = [sum(ev.on_host[i] for i in range(*s.blocks) if i not in s.kept_activations) for s in stages]
    pinned = sum(ev.weight[i] for i in offloaded) + ev.in_flight * sum(on_host)
    return Layout(stages=stages, offloaded_blocks=offloaded, boundary_mib=round(ev.hidden / MIB, 2),
                  forecast_host_gib=round(cost.host_bytes(spec, w.base_compute, pinned) / GIB, 2),
                  crossing_bytes_per_step=per_mb_crossing * grad_accum + shared,
                  swap_bytes_per_step=2 * sum(ev.weight[i] for i in offloaded) * grad_accum,
                  step_s=step_s, predicted_step_s=predicted,
                  recompute_saved_s=at_m(recomputing) - predicted,
                  inputs_on_host_gib=round(ev.in_flight * sum(on_host) / GIB, 2),
                  inputs_on_host_s=sum(2 * b / (d.host_gbps * 1e9) for b, d in zip(on_host, devices)))


def make_plan(spec: ArchSpec, devices: list[Device], w: Workload, grad_accum: int = 1,
              in_flight: int = 1, split: list[int] | None = None) -> Plan:
    """The best plan (or the given `split`: blocks per device) with its forecast, each stage holding the
    activations of `in_flight` micro-batches; no schedule chosen (`plan_training` chooses one)."""
    if w.base_compute == AUTO:                    # (callers that plan below plan_training)
        w = workload_in_mode(w, choose_base_compute(spec, devices, w, grad_accum, split=split).base_compute)
    return _plan(spec, devices, w, grad_accum, _arranged(spec, devices, w, grad_accum, in_flight, split),
                 "sequential", in_flight)


def _arranged(spec, devices, w, grad_accum, in_flight, split, kind: str | None = None) -> Layout:
    """The best layout (or the given split's), or PlanError saying what would fit."""
    if not devices:
        raise PlanError(f"no device to plan for: give at least one {setting('gpu')} (e.g. 16GiB, rtx4090, auto)")
    layout = _solve(spec, devices, w, grad_accum, in_flight, split, kind)
    if layout is None:
        raise PlanError(_explain_failure(spec, devices, w, grad_accum, in_flight))
    return layout


def _scheduled(spec, devices, w, grad_accum, schedule, split) -> tuple[Layout, str, int, Workload]:
    """(layout, schedule, micro-batches in flight, the workload planned): `_scheduled_as_given`, with the
    recomputed blocks keeping their self-attention outputs (`Workload.attention_kept`) where that is faster and
    swaps no block (a swapped block's bytes over the host link cost more than its attention)."""
    plain = _scheduled_as_given(spec, devices, w, grad_accum, schedule, split)
    keeping = _attention_kept(plain[3])
    if keeping is None:
        return plain
    try:
        kept = _scheduled_as_given(spec, devices, keeping, grad_accum, schedule, split)
    except PlanError:
        return plain
    faster = kept[0].predicted_step_s < plain[0].predicted_step_s
    return kept if faster and not kept[0].offloaded_blocks and kept[3].attention_kept else plain


def _attention_kept(w: Workload) -> Workload | None:
    """`w` with the recomputed blocks keeping their self-attention outputs (None: it recomputes nothing, or its
    recomputed blocks' inputs wait in host memory, or it keeps them already)."""
    if not KEEP_ATTENTION or w.recompute == "none" or w.inputs_on_host or w.attention_kept:
        return None
    return dataclasses.replace(w, attention_kept=True)


def _scheduled_as_given(spec, devices, w, grad_accum, schedule, split) -> tuple[Layout, str, int, Workload]:
    """(layout, schedule, micro-batches in flight, the workload planned): `schedule` "auto" takes the fastest
    order for the split, and the layout counts the activations of every micro-batch that order keeps in flight;
    its step forecast is that order's (a split that swaps blocks runs its micro-batches one after another).
    Where the GPUs cannot hold the recomputed blocks' inputs even with every block swapped, they wait in host
    memory (`Workload.inputs_on_host`) if that fits."""
    try:
        layout = _arranged(spec, devices, w, grad_accum, 1, split)
    except PlanError:
        on_host = _inputs_on_host(w)
        if on_host is None or _solve(spec, devices, on_host, grad_accum, 1, split) is None:
            raise
        return _scheduled_as_given(spec, devices, on_host, grad_accum, schedule, split)
    chosen = best_schedule(layout, grad_accum) if schedule == "auto" else schedule
    held = held_in_flight(chosen, len(devices), grad_accum)
    kind = "sequential" if chosen == "sequential" else "pipelined"
    if held > 1 or layout.step_s[kind][max(grad_accum, 1) - 1] != layout.predicted_step_s:
        layout = _arranged(spec, devices, w, grad_accum, held, split, kind)
    return layout, chosen, held, w


def _inputs_on_host(w: Workload) -> Workload | None:
    """`w` with the recomputed blocks' inputs in host memory, the last resort (None: it has them there, or
    recomputes nothing)."""
    if w.recompute == "none" or w.inputs_on_host:
        return None
    return dataclasses.replace(w, inputs_on_host=True, attention_kept=False)


def _fits(spec, devices, w, grad_accum, in_flight, split=None) -> Layout | None:
    """The best layout of `w`, or of it with the inputs in host memory where only that fits; None if neither."""
    layout = _solve(spec, devices, w, grad_accum, in_flight, split)
    on_host = _inputs_on_host(w) if layout is None else None
    return layout if on_host is None else _solve(spec, devices, on_host, grad_accum, in_flight, split)


def _plan(spec, devices, w, grad_accum, layout: Layout, schedule: str, in_flight: int, note: str = "",
          alternatives: list[dict] | None = None) -> Plan:
    """The Plan of a layout, with the choices made for it, its one-GPU swap comparison and its verdict."""
    swap = None
    if len(devices) > 1:
        one = _fits(spec, devices[:1], w, grad_accum, in_flight)
        if one is not None:
            swap = {"device": devices[0].label, "offloaded_blocks": one.offloaded_blocks,
                    "forecast_gib": one.stages[0].forecast_gib, "predicted_step_s": one.predicted_step_s,
                    "swap_bytes_per_step": one.swap_bytes_per_step}
    # (the workload's "checkpointing" and "weight_dtype": the older names of recompute and held_dtype, for
    # readers of plan.json from before them)
    workload = dict(dataclasses.asdict(w), checkpointing=w.recompute != "none", weight_dtype=w.held_dtype,
                    latent_frames=spec.latent_frames(w.frames))
    said = verdict(layout, swap, devices) + host_shortfall(layout, w.base_compute, devices)
    return Plan(model=spec.id, workload=workload, grad_accum=grad_accum, **layout.fields(), swap_forecast=swap,
                verdict=said, block_paths=[b.path for b in spec.blocks], schedule=schedule, in_flight=in_flight,
                base_compute=w.base_compute, base_compute_note=note, alternatives=alternatives or [],
                recompute=w.recompute, assumed=_assumed(w, devices))


def _assumed(w: Workload, devices: list[Device]) -> list[str]:
    """What the forecast takes for each GPU, and for the base's compute mode."""
    gpus = [d for d in devices if d.torch_device != "cpu"]
    mode_line = cost.dense_speed_assumed(w, [d.label for d in gpus])
    return [f"{d.label}: {memory_assumed(d)}; {speed_assumed(d)}" for d in gpus] + ([mode_line] if mode_line else [])


def plan_training(spec: ArchSpec, devices: list[Device], w: Workload, grad_accum: int = 1,
                  schedule: str = "auto", split: list[int] | None = None, listed: bool = True) -> Plan:
    """The plan a training run uses, and the only one any front end shows: the split, its forecast
    and the micro-batch schedule, with the activations of every micro-batch that schedule keeps in
    flight counted in each stage's memory. `schedule` "auto" takes the fastest order for the split.
    `w.base_compute` "auto" picks the base's precision (`choose_base_compute`); a bf16 plan that swaps
    blocks lists the quantised plans the devices could run instead (`Plan.alternatives`; not when `listed` is
    False: a plan only weighed against others)."""
    if w.base_compute == AUTO:
        return choose_base_compute(spec, devices, w, grad_accum, schedule, split, listed)
    _check_tensor_cores(w.base_compute, devices)
    layout, chosen, held, w = _scheduled(spec, devices, w, grad_accum, schedule, split)
    return _plan(spec, devices, w, grad_accum, layout, chosen, held,
                 alternatives=_alternatives_to(w, layout, spec, devices, grad_accum, schedule, split, listed))


def _alternatives_to(w, layout, spec, devices, grad_accum, schedule, split, listed: bool = True) -> list[dict]:
    """The quantised plans beside an exact base that swaps blocks (none otherwise, or unless `listed`)."""
    if mode_named(w.base_compute).quantises or not layout.offloaded_blocks or not listed:
        return []
    return _quantised_alternatives(spec, devices, w, grad_accum, schedule, split)


def _check_tensor_cores(mode: str, devices: list[Device]) -> None:
    """PlanError when a GPU lacks the tensor cores of the `mode` asked for (an RTX 30 card has int8 but no
    fp8 ones); the CPU's emulation (tests) is not checked here."""
    chosen = mode_named(mode)
    for d in devices:
        if d.torch_device == "cpu" or d.compute_capability is None or chosen.runs_on(d.compute_capability):
            continue
        has = fastest_mode_for([d.compute_capability])
        other = (f"{setting('base_compute', has.name)} runs on its {has.name} tensor cores, or " if has else "")
        raise PlanError(f"base compute {mode} needs {mode} tensor cores and {d.label} has none (compute "
                        f"capability {d.compute_capability[0]}.{d.compute_capability[1]}): {other}"
                        f"{setting('base_compute', EXACT.name)} computes in {EXACT.name}")


def devices_modes(devices: list[Device]) -> tuple:
    """The tensor-core modes every device runs (none with a CPU among them)."""
    return modes_run_by([d.compute_capability if d.torch_device != "cpu" else None for d in devices])


def auto_summary(devices: list[Device]) -> str:
    """One line for the Loader: what base compute auto weighs on these devices."""
    runs = devices_modes(devices)
    weighed = [EXACT.name, *(m.name for m in runs if within_quality_bound(m))]
    if not runs:
        return f"base compute auto: {EXACT.name} (no tensor cores for {_mode_list()} on these devices)"
    if len(weighed) == 1:
        return f"base compute auto: {EXACT.name} ({_only_exact_because(runs)})"
    return (f"base compute auto: the fastest forecast of {_joined(weighed, 'and')} (the modes these devices run "
            f"whose LoRA gradients stay within the quality bound: cosine >= {modes.QUALITY_BOUND} against "
            f"{EXACT.name}'s)")


def _only_exact_because(runs) -> str:
    """Why auto weighs no mode but the exact base on devices that run the tensor-core modes `runs`."""
    if not runs:
        return "these devices have no tensor cores for a quantised base: " + ", ".join(
            f"{m.name} needs {m.needs}" for m in tensor_core_modes())
    measured = ", ".join(f"{m.name} {m.gradient_cosine if m.gradient_cosine is not None else 'not measured'}"
                         for m in runs)
    return (f"no mode these devices run stays within the quality bound, LoRA gradients vs the {EXACT.name} base: "
            f"cosine >= {modes.QUALITY_BOUND} per block ({measured})")


def _joined(names: list[str], word: str) -> str:
    """'a, b and c' (`word`: and, or)."""
    return f" {word} ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _mode_list() -> str:
    return _joined([m.name for m in tensor_core_modes()], "or")


def workload_in_mode(w: Workload, mode: str) -> Workload:
    """`w` with its base in `mode`, held as the mode holds it on the GPUs."""
    return dataclasses.replace(w, base_compute=mode, held_dtype=mode_named(mode).held_dtype or w.held_dtype)


def _planned_in(candidates, spec, devices, w, grad_accum, schedule, split) -> dict:
    """{mode: (layout, schedule, in flight, workload planned)} for each of the `candidates` modes that fits."""
    planned = {}
    for mode in candidates:
        try:
            planned[mode] = _scheduled(spec, devices, workload_in_mode(w, mode.name), grad_accum, schedule, split)
        except PlanError:
            pass
    return planned


def _alternative(mode, layout: Layout) -> dict:
    """A mode's plan as a row of `Plan.alternatives`: mode, memory, s/step, blocks swapped, quality."""
    return {"base_compute": mode.name, "forecast_gib": max(s.forecast_gib for s in layout.stages),
            "predicted_step_s": layout.predicted_step_s, "swapped_blocks": len(layout.offloaded_blocks),
            "swap_bytes_per_step": layout.swap_bytes_per_step, "quality": mode.quality}


def _quantised_alternatives(spec, devices, w, grad_accum, schedule, split) -> list[dict]:
    """The quantised plans the devices can run, as rows."""
    planned = _planned_in(devices_modes(devices), spec, devices, w, grad_accum, schedule, split)
    return [_alternative(mode, layout) for mode, (layout, *_) in planned.items()]


def choose_base_compute(spec: ArchSpec, devices: list[Device], w: Workload, grad_accum: int = 1,
                        schedule: str = "auto", split: list[int] | None = None, listed: bool = True) -> Plan:
    """base_compute = auto: the fastest forecast among the exact base (bf16) and each tensor-core mode every
    device runs whose LoRA gradients stay within the quality bound of the exact base's
    (`modes.within_quality_bound`); the exact base on a tie. The plan says in one line which and why, and
    lists the others that fit (`Plan.alternatives`; not when `listed` is False)."""
    w16 = workload_in_mode(w, EXACT.name)
    try:
        planned, exact_error = {EXACT: _scheduled(spec, devices, w16, grad_accum, schedule, split)}, None
    except PlanError as err:
        planned, exact_error = {}, err
    runs = devices_modes(devices)
    planned |= _planned_in([m for m in runs if within_quality_bound(m)], spec, devices, w, grad_accum, schedule, split)
    if not planned:
        raise exact_error
    # (the exact base is planned first, so min keeps it on a tie)
    fastest = min(planned, key=lambda mode: planned[mode][0].predicted_step_s)
    layout, chosen, held, planned_w = planned[fastest]
    others = [_alternative(mode, planned[mode][0]) for mode in planned if mode is not fastest] if listed else []
    return _plan(spec, devices, planned_w, grad_accum, layout, chosen, held,
                 "base compute auto: " + _auto_reason(fastest, planned, runs), others)


def _auto_reason(fastest, planned: dict, runs) -> str:
    """Auto's choice in words: the mode, and why (its forecast against the exact base's)."""
    step = {mode: layout.predicted_step_s for mode, (layout, *_) in planned.items()}
    exact = EXACT.name
    if EXACT not in planned:
        return (f"{fastest.name} ({exact} does not fit even with block swap; {fastest.name} forecasts "
                f"{step[fastest]:.2f} s/step, the fastest that fits; {fastest.quality})")
    if fastest is not EXACT:
        return (f"{fastest.name}, forecast {1 - step[fastest] / step[EXACT]:.0%} faster than {exact} "
                f"({step[fastest]:.2f} against {step[EXACT]:.2f} s/step; {fastest.quality}); "
                f"{setting('base_compute', exact)} trains on the exact base")
    weighed = [mode for mode in runs if within_quality_bound(mode)]
    if not weighed:
        return f"{exact} ({_only_exact_because(runs)})"
    if len(planned) == 1:
        return f"{exact} ({_joined([m.name for m in weighed], 'and')} {'does' if len(weighed) == 1 else 'do'} not fit)"
    slower = _joined([f"{mode.name}'s {step[mode]:.2f}" for mode in planned if mode is not EXACT], "and")
    return f"{exact}, the fastest forecast ({step[EXACT]:.2f} s/step against {slower})"


def alternatives_text(plan: Plan) -> list[str]:
    """Lines for the plan's text: why auto chose, and the other modes' plans (`Plan.alternatives`)."""
    lines = [plan.base_compute_note] if plan.base_compute_note else []
    for a in plan.alternatives:
        swap = f"{a['swapped_blocks']} blocks swapped" if a["swapped_blocks"] else "no swap"
        lines.append(f"with base compute {a['base_compute']}: {a['predicted_step_s']:.2f} s/step, {swap}, "
                     f"{a['forecast_gib']:.1f} GiB; {a['quality']}")
    return lines


def verdict(layout: Layout, swap: dict | None, devices: list[Device]) -> str:
    """The plan in one or two sentences: where it runs, how fast, and against one GPU with swap (`swap`)."""
    busy = [s for s in layout.stages if s.blocks[1] > s.blocks[0]]
    link = "/".join(sorted({d.link for d in devices}))
    here = f"{layout.predicted_step_s:.2f} s/step"
    if all(d.torch_device == "cpu" for d in devices):      # the cost model knows GPUs only
        return f"A CPU run ({', '.join(d.label for d in devices)}): fits, no step-time forecast."
    if len(devices) == 1:
        if layout.offloaded_blocks:
            return (f"One GPU with block swap: {here}, streaming {layout.swap_bytes_per_step / GIB:.1f} GiB "
                    f"per step over {devices[0].link}; a second GPU would keep those blocks resident.")
        return f"Fits on {devices[0].label} without swap: {here}."
    split = (f"Split over {len(busy)} devices: {here}, {layout.crossing_bytes_per_step / MIB:.0f} MiB per step "
             f"between GPUs ({link})")
    if layout.offloaded_blocks:
        split += f" plus {layout.swap_bytes_per_step / GIB:.1f} GiB of block swap"
    if swap is None:
        return split + "; one GPU cannot train this even with block swap."
    ratio = swap["predicted_step_s"] / layout.predicted_step_s
    if abs(ratio - 1) < 0.05:
        compare = "about the same speed (the swap hides behind compute; gradient accumulation lets the split pipeline)"
    else:
        compare = f"{max(ratio, 1 / ratio):.2f}x {'faster' if ratio > 1 else 'slower'}"
    return (split + f"; one GPU with swap: {swap['predicted_step_s']:.2f} s/step, streaming "
            f"{swap['swap_bytes_per_step'] / GIB:.1f} GiB per step. Split: {compare}.")


def host_shortfall(layout: Layout, base_compute: str, devices: list[Device]) -> str:
    """For this machine's own GPUs: a sentence when the run's host memory peak exceeds the RAM available
    now, with what to change ('' when it fits, or for cards described by hand: their host is not this one)."""
    if not any((d.torch_device or "").startswith("cuda") for d in devices):
        return ""
    _, available = host_memory()
    if not available or layout.forecast_host_gib * GIB <= available:
        return ""
    fix = (f"base compute {_mode_list()} ({setting('base_compute', AUTO)}) holds half of the swapped blocks' "
           "pinned copies" if not mode_named(base_compute).quantises and layout.offloaded_blocks else
           "close other programs, or train at a lower resolution")
    return (f" Host memory: the run needs {layout.forecast_host_gib:.1f} GiB at its peak and {available / GIB:.1f} GiB "
            f"is available now; {fix}.")


def _explain_failure(spec, devices, w, grad_accum, in_flight) -> str:
    pooled = sum(max(budget_bytes(d), 0) for d in devices) / GIB
    ev = StageCosts(spec, devices, _inputs_on_host(w) or w, in_flight)
    # The least any device must hold even with every block streamed: embedders, LoRA, activations.
    floor = min(sum(ev._memory(0, 0, len(spec.blocks), tuple(range(len(spec.blocks)))).values()),
                sum(ev._memory(len(devices) - 1, 0, len(spec.blocks), tuple(range(len(spec.blocks)))).values()))
    biggest = max(budget_bytes(d) for d in devices)
    missing = max(floor - biggest, 0) / GIB
    tries = []
    variants = []
    if w.held_dtype != "fp8":
        variants.append((f"fp8 weights ({setting('weight_dtype', 'fp8')})",
                         dataclasses.replace(w, held_dtype="fp8", loaded_dtype="fp8"), devices))
    if w.recompute == "none":                   # (auto recomputes every block before it would not fit)
        variants.append((f"every block recomputed in backward ({setting('recompute', 'all')})",
                         dataclasses.replace(w, recompute="all"), devices))
    for res in (768, 512):
        if res < max(w.width, w.height):
            variants.append((f"resolution {res} ({setting('resolution', res)})",
                             dataclasses.replace(w, width=res, height=res), devices))
    largest = max(devices, key=lambda d: d.free_bytes)
    for more in (1, 2, 3):
        variants.append((f"{more} more GPU(s) like {largest.label}", w, devices + [largest] * more))
    for label, w2, devs in variants:
        if _fits(spec, devs, w2, grad_accum, in_flight) is not None:
            tries.append(label)
            if devs is not devices:
                break                     # name only the fewest extra GPUs that would do
    return (f"{spec.id} does not fit on {len(devices)} device(s): with every block swapped to CPU one "
            f"device would still hold {floor / GIB:.1f} GiB (embedders, LoRA, optimizer state, activations), "
            f"the largest budget is {biggest / GIB:.1f} GiB ({missing:.1f} GiB short; pooled budget "
            f"{pooled:.1f} GiB). "
            + (f"Would fit with: {'; '.join(tries)}." if tries else _what_would_fit(spec, devices, w, grad_accum,
                                                                                       in_flight)))


LARGEST_GPU_GIB = 512           # the search's end: beyond any one GPU (B300: 288 GB)


def _what_would_fit(spec, devices, w, grad_accum, in_flight) -> str:
    """The sentence for a run nothing simple fits: the smallest GPU size (whole GiB, as many GPUs) that
    would hold it; else that size with every memory-saving setting at once; else that nothing would."""
    def smallest_gib(w2) -> int | None:
        def fits(gib: int) -> bool:
            sized = [dataclasses.replace(d, label=f"{gib}GiB", torch_device=None, total_bytes=gib * GIB,
                                         free_bytes=gib * GIB) for d in devices]
            return _fits(spec, sized, w2, grad_accum, in_flight) is not None
        if not fits(LARGEST_GPU_GIB):
            return None
        low, high = 1, LARGEST_GPU_GIB                  # memory only helps: bisect for the first size that fits
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if fits(mid) else (mid + 1, high)
        return low

    def gpus(gib: int) -> str:
        return (f"a GPU with {gib} GiB" if len(devices) == 1 else f"{len(devices)} GPUs with {gib} GiB each")

    def flag(gib: int) -> str:
        return setting("gpu", f"{gib}GiB") + ("" if len(devices) == 1 else f" {len(devices)} times")
    gib = smallest_gib(w)
    if gib is not None:
        return f"Nothing simple would fit: {gpus(gib)} would ({flag(gib)})."
    lean = dataclasses.replace(w, held_dtype="fp8", loaded_dtype="fp8", recompute="all", batch=1,
                               width=min(w.width, 512), height=min(w.height, 512))  # (auto fits where all does)
    changes = [text for text, changed in (
        (f"fp8 weights ({setting('weight_dtype', 'fp8')})", w.held_dtype != "fp8"),
        (f"every block recomputed in backward ({setting('recompute', 'all')})", w.recompute == "none"),
        (f"batch 1 ({setting('batch', 1)})", w.batch > 1),
        (f"resolution 512 ({setting('resolution', 512)})", max(w.width, w.height) > 512)) if changed]
    gib = smallest_gib(lean) if changes else None
    if gib is None:
        return f"Nothing would fit, not even {gpus(LARGEST_GPU_GIB)}."
    return (f"Nothing simple would fit, not even {gpus(LARGEST_GPU_GIB)}; with {', '.join(changes)}, "
            f"{gpus(gib)} would ({flag(gib)}).")

"""Pipeline schedules as pure arithmetic, read by every layer (planner, engines, front ends): the
names a `schedule` setting takes, the order each stage runs its micro-batches in, how many micro-
batches' activations a stage holds, and which stages a rank holds in a distributed run. No torch.

One process (`ugpum.placement.pipeline` runs these):

* ``sequential``: plain gradient accumulation, one micro-batch after another through the whole
  model; 1 micro-batch in flight. The fallback and the reference.
* ``gpipe``: every stage F0 .. F(m-1) then B0 .. B(m-1); m micro-batches in flight everywhere.
* ``1f1b``: stage s runs min(p-1-s, m) forwards, then alternates F and B, then drains; at most
  p - s micro-batches in flight on stage s, the same step time as GPipe for less memory.

Distributed runs (`ugpum.distributed`, torch.distributed.pipelining) also take two stages per rank,
for a smaller bubble (each rank has work while the pipeline fills and drains):

- ``interleaved-1f1b``: ScheduleInterleaved1F1B (Narayanan et al. 2021); rank r of P holds stages r
  and r + P ("loop" placement).
- ``zero-bubble``: ScheduleZBVZeroBubble (Qi et al. 2024, ZB-V); rank r holds stages r and 2P - 1 - r
  ("v" placement: rank 0 holds the first and the last stage).
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("sequential", "gpipe", "1f1b")          # one process


@dataclass(frozen=True)
class Op:
    kind: str          # "F" or "B"
    stage: int
    micro_batch: int


def stage_order(schedule: str, stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """The (kind, micro_batch) sequence stage `stage` of `p` runs for `m` micro-batches."""
    if schedule == "sequential":
        return [(kind, k) for k in range(m) for kind in ("F", "B")]
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    if schedule == "1f1b":
        warmup = min(p - 1 - stage, m)
        order = [("F", k) for k in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i), ("B", i)]
        return order + [("B", k) for k in range(m - warmup, m)]
    raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")


def op_order(schedule: str, p: int, m: int, forward_s: float = 1.0, backward_s: float = 2.0) -> list[Op]:
    """One host order of all ops that keeps every stage's `stage_order` and every dependency
    (F(k,s) after F(k,s-1); B(k,s) after B(k,s+1), B(k,p-1) after F(k,p-1)).

    Chosen by simulating the pipeline with the given op times: the op that can start first goes
    first (ties: lower stage). Any order with those properties gives the GPUs the same queues; this
    one also issues work roughly when the devices get to it.
    """
    orders = [stage_order(schedule, s, p, m) for s in range(p)]
    nxt = [0] * p
    stage_free = [0.0] * p
    finish: dict[tuple[str, int, int], float] = {}
    out: list[Op] = []
    total = sum(len(o) for o in orders)
    while len(out) < total:
        best = None
        for s in range(p):
            if nxt[s] == len(orders[s]):
                continue
            kind, k = orders[s][nxt[s]]
            if kind == "F":
                dep = ("F", s - 1, k) if s > 0 else None
            else:
                dep = ("B", s + 1, k) if s < p - 1 else ("F", s, k)
            if dep is not None and dep not in finish:
                continue
            start = max(stage_free[s], finish[dep] if dep else 0.0)
            if best is None or start < best[0]:
                best = (start, s, kind, k)
        if best is None:
            raise RuntimeError(f"schedule {schedule!r} deadlocks for {p} stages, {m} micro-batches")
        start, s, kind, k = best
        end = start + (forward_s if kind == "F" else backward_s)
        finish[(kind, s, k)] = stage_free[s] = end
        nxt[s] += 1
        out.append(Op(kind, s, k))
    return out


def in_flight(schedule: str, p: int, m: int) -> int:
    """Most micro-batches whose activations one stage holds at once (for the memory forecast:
    `plan.make_plan(..., in_flight=...)`; stage 0 holds the most)."""
    if schedule == "sequential":
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p)
    raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")


def best_schedule(plan, m: int) -> str:
    """The schedule the training loop should use for `plan` with `m` micro-batches per step:
    ``1f1b`` when the plan has several busy stages and forecasts pipelining faster (it has GPipe's
    speed with less memory), else ``sequential``. Plan with `in_flight(best, p, m)` micro-batches of
    activations (at most min(m, number of devices)) so the memory forecast covers it.
    Block swap (`Stage.offloaded`) streams one micro-batch's blocks in order; interleaved
    micro-batches would fight over its slots, so a plan with swapped blocks stays sequential."""
    busy = [s for s in plan.stages if s.blocks[1] > s.blocks[0]]
    if m < 2 or len(busy) < 2 or any(getattr(s, "offloaded", None) for s in plan.stages):
        return "sequential"
    i = min(m, len(plan.step_s["pipelined"])) - 1
    return "1f1b" if plan.step_s["pipelined"][i] < plan.step_s["sequential"][i] else "sequential"


MULTI_STAGE = {"interleaved-1f1b": "loop", "zero-bubble": "v"}   # schedule -> placement of a rank's stages
DISTRIBUTED_ONLY = tuple(MULTI_STAGE)                            # schedules only a distributed run has
SETTINGS = ("auto", *SCHEDULES)                                  # what the `schedule` setting takes in one process
ALL_SETTINGS = (*SETTINGS, *DISTRIBUTED_ONLY)
STAGES_PER_RANK = 2


def stages_per_rank(schedule: str) -> int:
    """Pipeline stages on each rank for `schedule`."""
    return STAGES_PER_RANK if schedule in MULTI_STAGE else 1


def rank_stages(schedule: str, pipe_rank: int, ranks: int) -> list[int]:
    """The stages (of ranks x stages_per_rank, in the model's order) that rank `pipe_rank` of a
    pipeline of `ranks` holds, ascending."""
    v = stages_per_rank(schedule)
    if MULTI_STAGE.get(schedule) == "v":
        return sorted({pipe_rank, 2 * ranks - 1 - pipe_rank})
    return [pipe_rank + i * ranks for i in range(v)]


def schedule_kind(schedule: str) -> str:
    """The setting as the distributed engine reads it: gpipe, 1f1b, interleaved-1f1b or zero-bubble."""
    if schedule in MULTI_STAGE:
        return schedule
    return "gpipe" if schedule in ("gpipe", "sequential") else "1f1b"

"""Which `torch.distributed.pipelining` schedule runs a distributed run's micro-batches, and which
pipeline stages each rank holds for it: the `schedule` setting read for a pipeline of ranks.

One stage per rank: `gpipe` (also `sequential`) is ScheduleGPipe; `auto` and `1f1b` are
Schedule1F1B (GPipe where a run of one bucket shape has fewer micro-batches than ranks). Two stages
per rank, for a smaller bubble (each rank has work while the pipeline fills and drains):

- `interleaved-1f1b`: ScheduleInterleaved1F1B (Narayanan et al. 2021); rank r of P holds stages r
  and r + P ("loop" placement). A run whose micro-batch count the schedule refuses (it needs a
  multiple of its rounds, n // P) runs ScheduleLoopedBFS, the same placement.
- `zero-bubble`: ScheduleZBVZeroBubble (Qi et al. 2024, ZB-V); rank r holds stages r and 2P - 1 - r
  ("v" placement: rank 0 holds the first and the last stage), and each backward is split into the
  gradient for the stage's input (sent on at once) and the LoRA's own gradient (run later, in the
  bubble).

Names only here (no torch import): `TrainConfig` may list them. `schedule_class` imports torch.
"""
from __future__ import annotations

MULTI_STAGE = {"interleaved-1f1b": "loop", "zero-bubble": "v"}   # schedule -> placement of a rank's stages
DISTRIBUTED_ONLY = tuple(MULTI_STAGE)                            # schedules only a distributed run has
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


def schedule_class(schedule: str, n_microbatches: int, ranks: int):
    """The torch schedule class for a run of `n_microbatches` of one shape on a pipeline of `ranks`."""
    from torch.distributed import pipelining as pp
    kind = schedule_kind(schedule)
    if kind == "gpipe":
        return pp.ScheduleGPipe
    if kind == "1f1b":
        return pp.Schedule1F1B if n_microbatches >= ranks else pp.ScheduleGPipe
    if kind == "zero-bubble":
        return pp.ScheduleZBVZeroBubble
    rounds = max(1, n_microbatches // ranks)
    return pp.ScheduleInterleaved1F1B if n_microbatches % rounds == 0 else pp.ScheduleLoopedBFS

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

The names and the arithmetic live in `ugpum.placement.schedules`; this module picks torch's classes.
"""
from __future__ import annotations

from ..placement.schedules import MULTI_STAGE, rank_stages, schedule_kind, stages_per_rank  # noqa: F401 (re-exported)


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

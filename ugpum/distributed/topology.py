"""The ranks of a distributed run and their process groups.

world = P x replicas, P ranks to a pipeline (P = 1: every rank a whole copy of the model, plain data
parallel); rank = replica x P + pipeline rank, so the ranks of one replica are neighbours (one machine,
fast links: the hidden state crosses them every micro-batch) and the replicas of a rank are P apart (the
sum of its LoRA gradients, LoRA-sized, once per step, may cross machines). NCCL on GPUs (each rank on cuda:LOCAL_RANK, or the LOCAL_RANK-th GPU `devices`
names), gloo on the CPU: `process_group_choice`.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..placement.schedules import rank_stages, stages_per_rank
from ..train.errors import TrainingError
from ..train.stopping import Stopped


class DistributedStop(Stopped):
    """Signal `signum` reached rank `stopped_by`, and every rank stops after step `step` with the same
    stop, so that they save the completed steps together. `rank`: the rank that raised it."""

    def __init__(self, signum: int, rank: int, stopped_by: int, step: int):
        name = signal.Signals(signum).name
        super().__init__(signum, f"rank {rank}: stopped by {name} on rank {stopped_by} after step {step}")
        self.rank, self.stopped_by, self.step = rank, stopped_by, step


# --------------------------------------------------------------------------------------------
# ranks and groups
# --------------------------------------------------------------------------------------------

@dataclass
class Topology:
    rank: int
    world: int
    ranks: int                         # ranks of one pipeline (P)
    replicas: int
    device: torch.device
    schedule: str = "1f1b"             # the `schedule` setting: which stages a rank holds
    pipe_group: object = None          # this replica's ranks
    dp_group: object = None            # this pipeline rank's replicas (None with one replica)
    pipe_ranks: list[int] = field(default_factory=list)

    @property
    def pipe_rank(self) -> int:
        return self.rank % self.ranks

    @property
    def replica(self) -> int:
        return self.rank // self.ranks

    @property
    def n_stages(self) -> int:
        """Pipeline stages of one replica: P x stages per rank."""
        return self.ranks * stages_per_rank(self.schedule)

    @property
    def stage_ids(self) -> list[int]:
        """The stages this rank holds, ascending."""
        return rank_stages(self.schedule, self.pipe_rank, self.ranks)

    def owner(self, stage: int) -> int:
        """The global rank of this replica that holds `stage`."""
        for r in range(self.ranks):
            if stage in rank_stages(self.schedule, r, self.ranks):
                return self.replica * self.ranks + r
        raise ValueError(f"no rank holds stage {stage} of {self.n_stages}")


def process_group_choice(has_cuda: bool, local_rank: int, devices=("auto",), local_world: int = 1) -> tuple[str, str]:
    """(backend, device) of one rank: NCCL and a GPU of its own where CUDA is here and `devices` do
    not ask for the CPU: cuda:LOCAL_RANK, or the LOCAL_RANK-th of the GPUs `devices` names (--devices
    cuda:2,cuda:3 for a machine's two ranks); gloo and the CPU otherwise. Pure: decided by its
    arguments alone (`init_distributed` passes what torchrun and torch say)."""
    devices = [d.strip() for d in devices]
    if not has_cuda or all(d == "cpu" for d in devices):
        return "gloo", "cpu"
    named = [d for d in devices if d.startswith("cuda")]
    if not named:                                              # auto, or GPUs described by name
        return "nccl", f"cuda:{local_rank}"
    if len(named) != local_world:
        raise TrainingError(f"--devices {','.join(devices)} names {len(named)} GPU(s) for the {local_world} rank(s) "
                            "torchrun starts on this machine: name one per rank, or use auto (rank i takes cuda:i)")
    return "nccl", named[local_rank] if ":" in named[local_rank] else f"cuda:{local_rank}"


def init_distributed(data_parallel: int = 1, cpu: bool | None = None, schedule: str = "1f1b",
                     devices=("auto",)) -> Topology:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR...) with
    the backend and device `process_group_choice` gives (`cpu`: gloo even where CUDA is here)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise TrainingError("--distributed runs under torchrun: torchrun --standalone --nproc-per-node=N "
                            "-m ugpum train ... --distributed (N = stages x --data-parallel)")
    world = int(os.environ["WORLD_SIZE"])
    if data_parallel < 1 or world % data_parallel:
        raise TrainingError(f"--data-parallel {data_parallel}: torchrun started {world} ranks, not a multiple of "
                            f"{data_parallel} (ranks = stages x replicas)")
    ranks = world // data_parallel
    if ranks < 2 and stages_per_rank(schedule) > 1:
        raise TrainingError(f"--schedule {schedule} interleaves two stages on each rank of a pipeline of at least 2 "
                            f"ranks; {world} rank(s) with --data-parallel {data_parallel} are pipelines of one rank: "
                            "use --schedule auto")
    backend, name = process_group_choice(torch.cuda.is_available() and not cpu, int(os.environ.get("LOCAL_RANK", "0")),
                                         devices, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    rank = dist.get_rank()
    top = Topology(rank, world, ranks, data_parallel, device, schedule)
    for r in range(data_parallel):                     # every rank creates every group, in one order
        members = list(range(r * ranks, (r + 1) * ranks))
        group = dist.new_group(members)
        if r == top.replica:
            top.pipe_group, top.pipe_ranks = group, members
    if data_parallel > 1:
        for s in range(ranks):
            group = dist.new_group(list(range(s, world, ranks)))
            if s == top.pipe_rank:
                top.dp_group = group
    return top

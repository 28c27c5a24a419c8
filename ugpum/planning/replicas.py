"""What running copies of the model side by side costs beyond each copy's own plan (`ugpum.planning.space`
weighs them; `ugpum.train.replicas` runs them): a replica trains its share of a step's micro-batches with its
own plan over its GPU(s), and once a step the LoRA gradients are summed on the first replica's GPU.

* Averaging: a replica sends the LoRA's fp32 gradient of each of its micro-batches (kept apart, so that they
  add up in the order one GPU adds them; a pipelined split: the sum of its share) to the first replica's GPU
  over the link between them; the first replica's new LoRA goes back to each.
* Host memory: in one process the replicas share one pinned host copy of the blocks they swap (the same
  block in the same precision); as processes each holds its own. Replicas that swap read host memory at the
  same time, so each streams at most `HOST_MEMORY_GBPS` / (replicas that swap).
* One process or processes: one Python process drives every GPU (what the LoRA Trainer node does); where
  that would lose more than `ONE_PROCESS_LIMIT` of a step on two cards, the replicas run as processes.
"""
from __future__ import annotations

import dataclasses

from ..arch.base import WEIGHT_BYTES
from . import cost
from .devices import Device, gpu_to_gpu_gbps

MIB = 1024 ** 2
# What two GPUs' block swap can read from host memory at once, GB/s: dual-channel DDR4-3200 (51 GB/s peak) reads
# about 40 in practice, DDR5 desktops about 60-70. Assumed, not measured: one swapping card reads at its link's
# rate (25 GB/s for PCIe 4 x16), so two of them meet this limit.
HOST_MEMORY_GBPS = 40.0
# The share of each step one process loses driving two GPUs instead of one (Python, the GIL, the kernel launch
# queues), taken for any number of GPUs. Two worker threads driving two replicas of klein 9B on one H100 lost
# nothing against one worker (0.745 against 0.747 s for the same two micro-batches, bench/results/README.md;
# `bench/two_gpu.py --devices cuda:0,cuda:0 --layouts one,replicas` measures it again); on two cards, where the
# host must keep two GPUs fed, it is assumed until bench/two_gpu.py runs on a machine of two.
ONE_PROCESS_LOSS = 0.02
ONE_PROCESS_LIMIT = 0.05          # above it, the replicas run as processes


def shares(grad_accum: int, replicas: int) -> list[int]:
    """Micro-batches per step of each replica: consecutive runs of the step's micro-batches, the first replicas
    one more where they do not divide evenly."""
    base, extra = divmod(grad_accum, replicas)
    return [base + (r < extra) for r in range(replicas)]


def runs_as() -> str:
    """How replicas run on one machine: "one process", unless that loses more than `ONE_PROCESS_LIMIT`."""
    return "one process" if ONE_PROCESS_LOSS <= ONE_PROCESS_LIMIT else "processes"


def one_process_factor(how: str) -> float:
    """The step's forecast multiplier for replicas running `how`."""
    return 1 + ONE_PROCESS_LOSS if how == "one process" else 1.0


def lora_gradient_bytes(spec, w) -> int:
    """The LoRA's fp32 gradient (or weights): what one copy between replicas moves."""
    return sum(b.lora_params(w.rank) for b in spec.blocks) * 4


def hands_each(plan) -> bool:
    """Whether a replica of this plan hands over each micro-batch's LoRA gradient (kept apart: it is one stage,
    or runs its micro-batches one after another), not its share's sum (a pipelined split)."""
    busy = [s for s in plan.stages if s.blocks[1] > s.blocks[0]]
    return len(busy) <= 1 or plan.schedule == "sequential"


def gradients_sent(plan) -> int:
    """How many LoRA gradients a replica sends each step (`hands_each`: one per micro-batch, else one)."""
    return plan.grad_accum if hands_each(plan) else 1


def averaging_seconds(spec, w, plans, groups: list[list[Device]]) -> float:
    """Seconds per step the replicas spend averaging: each replica's gradients to the first (the replicas send at
    once, each its own one after the other), then the new LoRA from the first to each, one after the other."""
    size = lora_gradient_bytes(spec, w)
    links = [gpu_to_gpu_gbps(g[0], groups[0][0]) * 1e9 for g in groups[1:]]
    sending = max((gradients_sent(p) * size / link for p, link in zip(plans[1:], links)), default=0.0)
    return sending + sum(size / link for link in links)


def room_for_gradients(spec, w, groups: list[list[Device]], parts: list[int]) -> list[list[Device]]:
    """The replicas' devices less what each replica after the first keeps of its micro-batches' gradients until
    the step ends (all but one: that one is the gradient any run holds), spread over a split's GPUs as the LoRA."""
    size = lora_gradient_bytes(spec, w)
    return [g if r == 0 or n < 2 else
            [dataclasses.replace(d, free_bytes=d.free_bytes - (n - 1) * size // len(g)) for d in g]
            for r, (g, n) in enumerate(zip(groups, parts))]


def host_rate_shared(groups: list[list[Device]], plans) -> list[list[Device]]:
    """The replicas' devices with each host link slowed to its share of host memory where several replicas
    swap (unchanged where at most one does)."""
    swapping = sum(bool(p.offloaded_blocks) for p in plans)
    if swapping < 2:
        return groups
    share = HOST_MEMORY_GBPS / swapping
    return [[dataclasses.replace(d, host_gbps=min(d.host_gbps, share)) for d in g] for g in groups]


def pinned_bytes(spec, plans, how: str) -> list[int]:
    """Host bytes of the swapped blocks' pinned copies each process holds: one process shares a block swapped
    by several replicas in the same precision; processes hold each their own."""
    def held(p):
        return p.workload["held_dtype"], p.base_compute
    if how != "one process":
        return [sum(spec.blocks[i].params for i in p.offloaded_blocks) * WEIGHT_BYTES[held(p)[0]] for p in plans]
    union: dict[tuple, set[int]] = {}
    for p in plans:
        union.setdefault(held(p), set()).update(p.offloaded_blocks)
    return [sum(spec.blocks[i].params * WEIGHT_BYTES[dtype] for (dtype, _), blocks in union.items() for i in blocks)]


def host_gib(spec, plans, how: str) -> float:
    """The host memory the replicas need at their peak, over every process they run in."""
    modes = [[p.base_compute] for p in plans] if how != "one process" else [[p.base_compute for p in plans]]
    held = [max(cost.host_bytes(spec, mode, pinned) for mode in process)
            for process, pinned in zip(modes, pinned_bytes(spec, plans, how))]
    return round(sum(held) / cost.GIB, 2)


def assumed(spec, w, plans, groups: list[list[Device]], how: str) -> list[str]:
    """The `assumed:` lines of a plan of replicas."""
    first = groups[0][0]
    links = sorted({f"{g[0].label} -> {first.label} at {gpu_to_gpu_gbps(g[0], first):.1f} GB/s" for g in groups[1:]})
    lines = [f"LoRA gradients averaged over the GPUs' link ({'; '.join(links)}), "
             f"{lora_gradient_bytes(spec, w) / MIB:.0f} MiB each"]
    swapping = sum(bool(p.offloaded_blocks) for p in plans)
    if swapping > 1:
        lines.append(f"host memory read at {HOST_MEMORY_GBPS:g} GB/s by the {swapping} replicas that swap, "
                     f"{HOST_MEMORY_GBPS / swapping:g} GB/s each (dual-channel DDR4's; not measured)")
    lines.append(f"replicas in {how}: one process driving two GPUs loses {ONE_PROCESS_LOSS:.0%} of a step (two "
                 f"workers on one H100 lost nothing; two GPUs not measured); above {ONE_PROCESS_LIMIT:.0%} they run "
                 f"as processes")
    return lines

"""What a distributed run would cost before anything is launched (`python -m ugpum plan --distributed
--nodes K`): per-rank memory, step time with the network's bandwidth, the data-parallel all-reduce
of the LoRA gradients, and whether the single process on one machine is the better choice.

The layout is the one `ugpum.distributed.stepper` uses: `nodes` machines with the same GPUs, ranks =
nodes x GPUs, R replicas of a pipeline of ranks / R stages; a replica's stages are neighbouring
ranks (one machine while the pipeline is no longer than a machine's GPUs), so the hidden state
crosses the network only when a pipeline spans machines, while the replicas of a stage (one
all-reduce of its LoRA gradients per step) sit on different machines. With `interleaved-1f1b` or
`zero-bubble` each rank holds two stages (`schedules.rank_stages`), each planned on half its GPU.

Model, deliberately simple (DESIGN §5): the pipeline's step from the single-process planner for the
micro-batches one replica runs (two stages per rank: (m + (P - 1) / 2) times the busiest rank's
time per micro-batch, the interleaved schedules' smaller bubble); plus, serialised (no overlap
assumed), the hidden state and its gradient crossing each machine boundary of a pipeline per
micro-batch, and the sum of the LoRA's fp32 gradients over the replicas in micro-batch order
(`run.GradientsInOrder`: R - 1 hops from replica to replica, then a broadcast; about R times the
LoRA's bytes through one machine's link, all stages sharing it), over the network when replicas
span machines (else over the GPUs' link).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..arch.base import WEIGHT_BYTES
from ..planning.devices import Device, gpu_to_gpu_gbps
from ..planning import cost
from ..planning.plan import GIB, MIB, Plan, PlanError, plan_training
from ..planning.space import best_plan
from .schedules import rank_stages, schedule_kind, stages_per_rank

DEFAULT_NETWORK_GBPS = 10.0          # Gbit/s: a 10 GbE LAN between workstations
GBIT = 1e9 / 8                       # bytes per second in one Gbit/s


def stage_slots(devices: list[Device], schedule: str, every_stage_bytes: int = 0) -> list[Device]:
    """One device per pipeline stage, in the model's order, for the pipeline's ranks `devices`: a
    schedule with V stages per rank plans each of a rank's stages with a V-th of its GPU's memory
    (at its full speed: a rank runs its stages one after the other). A rank without the first stage
    also holds the small embedders (`every_stage_bytes`), set aside before the planner fills the rest
    (with recompute auto it keeps activations up to the budget)."""
    v, ranks = stages_per_rank(schedule), len(devices)
    owner = {s: r for r in range(ranks) for s in rank_stages(schedule, r, ranks)}
    slots = []
    for s in range(ranks * v):
        gpu = devices[owner[s]]
        aside = 0 if owner[s] == owner[0] else every_stage_bytes
        slots.append(dataclasses.replace(gpu, total_bytes=(gpu.total_bytes - aside) // v,
                                         free_bytes=(gpu.free_bytes - aside) // v))
    return slots


def distributed_plan(spec, devices: list[Device], w, per_replica: int, schedule: str = "1f1b") -> Plan:
    """The planner's split of `spec` over the pipeline's stages (`stage_slots` of its ranks'
    `devices`) for `per_replica` micro-batches per step; an even split by blocks where the planner
    would leave a stage empty or swap blocks (each rank must hold its blocks: there is no swap tier
    in a distributed run)."""
    slots = stage_slots(devices, schedule, every_stage_bytes(spec, w))
    kind = "gpipe" if schedule_kind(schedule) == "gpipe" else "1f1b"     # what the planner models
    n = len(slots)
    if len(spec.blocks) < n:
        raise PlanError(f"{spec.id} has {len(spec.blocks)} blocks: too few for {n} pipeline stages")
    plan = plan_training(spec, slots, w, grad_accum=per_replica, schedule=kind)
    if len(plan.stages) != n or any(b <= a for a, b in (s.blocks for s in plan.stages)) or plan.offloaded_blocks:
        cuts = [round(i * len(spec.blocks) / n) for i in range(n + 1)]
        plan = plan_training(spec, slots, w, grad_accum=per_replica, schedule=kind,
                             split=[cuts[i + 1] - cuts[i] for i in range(n)])
    return plan


def every_stage_bytes(spec, w) -> int:
    """Bytes each stage after the first also holds, in the run's weight dtype: the small embedders it
    recomputes the timestep's modulation (and Wan's text embedding) with (ArchSpec.every_stage_params)."""
    return int(spec.every_stage_params() * WEIGHT_BYTES[w.held_dtype])


@dataclass
class DistributedForecast:
    model: str
    nodes: int
    gpus_per_node: int
    stages: int                           # ranks of one pipeline (replica)
    replicas: int
    grad_accum: int
    rank_gib: list[float]                 # per rank of a pipeline (every replica alike)
    budget_gib: list[float]
    pipeline_s: float                     # one replica's pipelined step (planner)
    network_s: float                      # hidden state crossing machines, per step
    allreduce_s: float                    # LoRA gradients over the replicas, per step
    allreduce_mib: float                  # through one machine's link per step (about R x the LoRA)
    step_s: float
    single_step_s: float | None           # one process on one machine, the same global batch
    network_gbps: float
    verdict: str
    plan: Plan = field(repr=False, default=None)
    stages_per_rank: int = 1              # 2 for interleaved-1f1b and zero-bubble
    rank_stages: list[list[int]] = field(default_factory=list)   # the plan's stages each rank holds
    schedule: str = "1f1b"

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "plan"}
        out["plan"] = self.plan.to_json()
        return out


def forecast_distributed(spec, node_devices: list[Device], w, grad_accum: int, nodes: int = 1,
                         data_parallel: int | None = None, network_gbps: float = DEFAULT_NETWORK_GBPS,
                         schedule: str = "1f1b") -> DistributedForecast:
    g = len(node_devices)
    ranks = nodes * g
    replicas = data_parallel or nodes
    if replicas < 1 or ranks % replicas:
        raise PlanError(f"{nodes} machine(s) x {g} GPU(s) = {ranks} ranks cannot form {replicas} replica(s) of a "
                        "pipeline; choose --data-parallel R so that R divides the ranks (R = ranks: each rank a whole "
                        "copy of the model)")
    if ranks == replicas and stages_per_rank(schedule) > 1:
        raise PlanError(f"--schedule {schedule} puts two stages on each rank of a pipeline of at least 2 ranks; with "
                        f"--data-parallel {replicas} each pipeline is one rank: use --schedule auto")
    if grad_accum % replicas:
        raise PlanError(f"--grad-accum {grad_accum} must be a multiple of the {replicas} replicas (each runs "
                        "grad-accum / R micro-batches of the global batch)")
    stages = ranks // replicas
    per_replica = grad_accum // replicas
    devices = [node_devices[i % g] for i in range(stages)]
    plan = distributed_plan(spec, devices, w, per_replica, schedule)
    extra = every_stage_bytes(spec, w)
    held = [rank_stages(schedule, r, stages) for r in range(stages)]
    # a rank's stages share its GPU and its copy of the small embedders (which the first stage has anyway;
    # stage_slots set it aside from the other ranks' stages)
    aside = [0.0 if 0 in mine else extra / GIB for mine in held]
    # (the allocator's slack is the GPU's, not each stage's: a rank of two stages holds it once)
    slack = cost.allocator_bytes(spec, w) / GIB
    rank_gib = [sum(plan.stages[i].forecast_gib for i in mine) - (len(mine) - 1) * slack + a
                for mine, a in zip(held, aside)]
    budget_gib = [sum(plan.stages[i].budget_gib for i in mine) + a for mine, a in zip(held, aside)]
    # the hidden state (and its gradient) over each machine boundary inside one pipeline
    owner = {i: r for r, mine in enumerate(held) for i in mine}
    crossings = sum(owner[i] // g != owner[i + 1] // g for i in range(len(plan.stages) - 1))
    boundary = spec.boundary_bytes(w)
    network_s = per_replica * crossings * 2 * boundary / (network_gbps * GBIT)
    # all-reduce of the LoRA's fp32 gradients (all stages' groups share a machine's network link)
    lora = sum(b.lora_params(w.rank) for b in spec.blocks) * 4
    sent = replicas * lora if replicas > 1 else 0
    across = replicas > 1 and nodes > 1
    link = network_gbps * GBIT if across else gpu_to_gpu_gbps(node_devices[0], node_devices[-1]) * 1e9
    allreduce_s = sent / link
    pipeline_s = plan.predicted_step_s
    if len(held[0]) > 1:      # interleaved: (m + (P - 1) / V) x the slowest rank's work per micro-batch
        busiest = max(sum(plan.stages[i].seconds for i in mine) for mine in held)
        pipeline_s = (per_replica + (stages - 1) / len(held[0])) * busiest
    step = pipeline_s + network_s + allreduce_s
    try:
        single = best_plan(spec, node_devices, w, grad_accum=grad_accum)      # (one card, the split, replicas)
        single_s = single.predicted_step_s
    except PlanError:
        single_s = None
    over = [i for i, (m, b) in enumerate(zip(rank_gib, budget_gib)) if m > b]
    fc = DistributedForecast(spec.id, nodes, g, stages, replicas, grad_accum, [round(x, 2) for x in rank_gib],
                             [round(x, 2) for x in budget_gib], pipeline_s, network_s, allreduce_s,
                             sent / MIB, step, single_s, network_gbps, "", plan, len(held[0]), held,
                             schedule)
    fc.verdict = _verdict(fc, over)
    return fc


def _verdict(fc: DistributedForecast, over: list[int]) -> str:
    dist = f"{fc.step_s:.2f} s/step distributed ({fc.nodes} machine(s), {fc.stages} stages x {fc.replicas} replica(s))"
    if over:
        return (f"Does not fit: stage(s) {', '.join(map(str, over))} need more memory than a GPU has; use more stages "
                "(fewer replicas) or a smaller workload.")
    if fc.single_step_s is None:
        return f"Only the distributed run trains this: one machine cannot hold it; {dist}."
    single = f"{fc.single_step_s:.2f} s/step in one process on one machine for the same global batch"
    gain = fc.single_step_s / fc.step_s
    if fc.nodes == 1 and fc.replicas == 1:
        return (f"The single process is the better choice: the same plan on one machine ({single}) needs no "
                "launcher and runs on Windows; --distributed pays off with more machines or replicas.")
    if gain < 1.1 and fc.nodes == 1:
        return (f"The single process is the better choice: {single} against {dist} ({gain:.2f}x); one process "
                "weighs the same replicas (ugpum plan shows them) and needs no launcher.")
    if gain < 1.1:
        return (f"The single process is the better choice: {single} against {dist} ({gain:.2f}x); the network "
                f"({fc.network_gbps:g} Gbit/s) or the all-reduce eats the gain.")
    return f"Distributed is {gain:.2f}x faster: {dist} against {single}."


def format_distributed(fc: DistributedForecast) -> str:
    p = fc.plan
    order = p.schedule if fc.stages_per_rank == 1 else f"{fc.schedule}, {fc.stages_per_rank} stages per rank"
    lines = [f"{fc.model}  distributed: {fc.nodes} machine(s) x {fc.gpus_per_node} GPU(s) = {fc.nodes * fc.gpus_per_node} "
             f"ranks: {fc.stages} stages x {fc.replicas} replica(s); grad-accum {fc.grad_accum} "
             f"({fc.grad_accum // fc.replicas} per replica, {order})", ""]
    header = f"{'pipeline rank (r*stages+s)':<26} {'blocks':>10} {'forecast / budget GiB per rank':>32}"
    lines += [header, "-" * len(header)]
    for i, (mine, m, b) in enumerate(zip(fc.rank_stages, fc.rank_gib, fc.budget_gib)):
        blocks = ", ".join(f"{p.stages[j].blocks[0]}-{p.stages[j].blocks[1] - 1}" for j in mine)
        lines.append(f"{f'{i}: {p.stages[mine[0]].device}'[:26]:<26} {blocks:>10} {m:>18.1f} / {b:<9.1f}")
    lines += ["",
              f"step: {fc.pipeline_s:.2f} s pipeline + {fc.network_s:.3f} s hidden state between machines + "
              f"{fc.allreduce_s:.3f} s summing LoRA gradients over replicas ({fc.allreduce_mib:.0f} MiB, "
              f"{'network ' + format(fc.network_gbps, 'g') + ' Gbit/s' if fc.replicas > 1 and fc.nodes > 1 else 'GPU link'}) "
              f"= {fc.step_s:.2f} s", fc.verdict]
    return "\n".join(lines)

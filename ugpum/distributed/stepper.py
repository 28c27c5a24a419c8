"""The torchrun engine behind `ugpum.train.loop.train` (a stepper keeping `ugpum.train.engine.Stepper`,
as `ugpum.train.stepper` does for one process), on `torch.distributed.pipelining`: the planner's
stages on ranks (one stage per rank, or two with the `interleaved-1f1b` and `zero-bubble` schedules:
`schedules.py`), `--data-parallel R` replicas of that pipeline, launched by torchrun.

Ranks and groups: `topology.py`.

Rank 0 is the run's front: it alone reads the dataset, runs the encoders (through the feature
cache), checks the output folder and a resume, writes plan.json, metrics.jsonl, checkpoints and the
LoRA, in exactly the single-process formats. It hands every other rank what it needs (the cached
features, the split, a resumed checkpoint) over the process group, so other machines need only the
DiT file (each rank streams its own blocks), not the dataset, encoders or output folder.

One step = the same global batch as the single-process run: micro-batches k = step x grad_accum ..
+ grad_accum - 1, replica r taking its consecutive share (grad_accum must divide by R); each
micro-batch's noise and timesteps are drawn from (seed, k), as `ugpum.train.objective.micro_loss` draws
them (`ugpum.train.objective.micro_batch_inputs`); the loss of each is divided by grad_accum; each micro-batch's LoRA gradient is kept apart as
its backward ends (whatever order a schedule runs them in) and all are summed in ascending
micro-batch order across the replicas (`GradientsInOrder`); clipping uses the norm over every
stage; AdamW steps each stage's own adapters. So the float operations are the single process's: on
the CPU the LoRA comes out bit for bit the same (the tests ask for a relative difference < 1e-6,
fp32).

Validation: the single process's validation loss (`ugpum.train.objective.validation_inputs`:
the same items, noise and timesteps) before the first step and after the last, through replica 0's stages
(forward only, one input at a time, sent rank to rank), logged as the single process logs it.
Preview samples are not rendered (the run log says so once): the model is spread over ranks.

Stopping: Ctrl-C or SIGTERM on any rank sets a flag; at the end of the step every rank learns of it
(a tiny all-reduce each step, `agree`) and hands the loop the same stop (`DistributedStop`): the
loop's one stop handler has rank 0 save the checkpoint and the LoRA of the completed steps with the
others, and every rank ends with one sentence (the command line words it: the loop's `Stop` says it is
told). A rank killed outright (SIGKILL, a crash) cannot save: torchrun stops the others and the run
resumes from its last periodic checkpoint (`save_every`, `save_every_minutes`).
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from ..compute.base_compute import check_devices
from ..compute.modes import AUTO
from ..planning.devices import resolve_devices
from ..compute.dtypes import TORCH_DTYPES
from ..planning.plan import PlanError
from ..placement.schedules import rank_stages, schedule_kind, stages_per_rank
from ..train.run.checkpoint import load_checkpoint, restore_optimizer
from ..train.config import TrainConfig
from ..train.errors import TrainingError
from ..train.prepare import make_trainable, quantiser
from ..train.run.folder import save_run
from ..train.stopping import Stop
from .forecast import distributed_plan
from .schedule_run import GradientsInOrder, clip_pipeline, run_schedule
from .stage_lora import full_lora, lora_params, stage_adapters, stage_lora
from .stages import keep_only, stage_module, stage_ranges
from .topology import DistributedStop, Topology, init_distributed
from .validation import validation_loss


def split_for(cfg: TrainConfig, spec, top: Topology):
    """(plan, block bounds per stage): the planner's split of `spec` over the pipeline's stages (on P
    devices like this rank's, `stages_per_rank` stages on each), for the micro-batches one replica
    runs per step; an even split (by blocks) when the planner leaves a stage empty or swaps blocks
    (a rank must hold its blocks)."""
    device = top.device
    if len(cfg.devices) == top.ranks and "auto" not in cfg.devices:
        names = list(cfg.devices)
    else:
        names = [str(device) if device.type == "cpu" else f"cuda:{device.index}"] * top.ranks
    devices = resolve_devices(names, spec, training=True, desktop_gib=cfg.desktop_gib)
    try:
        plan = distributed_plan(spec, devices, cfg.workload(), max(cfg.grad_accum // top.replicas, 1), cfg.schedule)
    except PlanError as e:
        raise TrainingError(str(e)) from None
    bounds = [tuple(s.blocks) for s in plan.stages]
    return plan, bounds


def _share(payload, top: Topology):
    """Rank 0's payload (or its error) to every rank."""
    box = [payload]
    dist.broadcast_object_list(box, src=0, device=top.device if top.device.type == "cuda" else None)
    return box[0]


class _Flags:
    """Ctrl-C and SIGTERM set a flag instead of raising: a rank stops where every rank can stop with
    it (the end of a step) and the run saves what the completed steps trained."""

    def __init__(self):
        self.signum = 0
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.previous[s] = signal.signal(s, self._set)
        return self

    def _set(self, signum, _frame):
        self.signum = self.signum or signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class TorchrunRankStepper:
    """One rank of a torchrun job, as `ugpum.train.loop.train` drives it (`engine.Stepper`). Rank 0 is
    the lead: it reads the data, runs the encoders (`make_encoders`, called there only) and writes the
    run folder."""

    def __init__(self, cfg: TrainConfig, make_encoders, data_parallel: int = 1, cpu: bool | None = None):
        if cfg.optimizer != "adamw":
            raise TrainingError(f"--distributed trains with optimizer 'adamw' (not {cfg.optimizer!r})")
        self.top = top = init_distributed(data_parallel, cpu, cfg.schedule, cfg.devices)
        if cfg.grad_accum % top.replicas:
            raise TrainingError(f"grad_accum {cfg.grad_accum} does not divide into {top.replicas} replicas: each "
                                "replica runs grad_accum / R micro-batches of the step's global batch")
        if cfg.base_compute != AUTO:                        # before any data is read or weight loaded
            check_devices(cfg.base_compute, [top.device])
        self.make_encoders = make_encoders
        self.lead = top.rank == 0
        self.can_sample = False    # the model is spread over ranks
        self.defers_readings = False   # every rank agrees on each step's loss and stop as it ends
        self.name = "a distributed run"
        self.devices = [str(top.device)] if top.device.type == "cuda" else []
        self.flags = _Flags()

    # -- before the steps --------------------------------------------------------------------
    def share(self, begin):
        """`begin()` on rank 0 (its result, or its error, to every rank)."""
        payload = None
        if self.lead:
            try:
                payload = begin()
            except Exception as e:                          # every rank ends with its sentence
                _share({"error": str(e)}, self.top)
                raise
        shared = _share(payload, self.top)
        if isinstance(shared, dict) and "error" in shared:
            raise TrainingError(shared["error"])
        return shared

    def make_plan(self, cfg, spec):
        plan, _ = split_for(cfg, spec, self.top)
        return plan

    def plan_record(self, plan) -> dict:
        top, schedule = self.top, self.top.schedule
        return {**plan.to_json(), "distributed": {"stages": top.n_stages, "stages_per_rank": stages_per_rank(schedule),
                                                  "replicas": top.replicas, "ranks": top.world,
                                                  "bounds": [tuple(s.blocks) for s in plan.stages]}}

    def encoders(self, given):
        return self.make_encoders()                         # (a rank is given none: it builds rank 0's)

    def prepare(self, cfg, spec, plan, model, key_prefix: str, log) -> None:
        """This rank's share of the model (streamed from its file), trainable as in one process (8-bit
        base, in-place guard, compiled, the blocks the plan recomputes wrapped), with its stages' LoRA."""
        top = self.top
        self.cfg, self.spec = cfg, spec
        self.ranges = ranges = stage_ranges([tuple(s.blocks) for s in plan.stages])
        mine = [ranges[s] for s in top.stage_ids]
        log(_layout_line(top, ranges))
        keep_only(model, spec, mine)
        own_paths = [spec.blocks[i].path for r in mine for i in range(r.start, r.end)]
        quantise = quantiser(plan, spec, own_paths, [top.device], model)
        if any(p.is_meta for p in model.parameters()):
            from ..placement.place import Layout
            from ..placement.stream_load import fill_from_file
            layout = Layout({path: str(top.device) for path in own_paths}, str(top.device), str(top.device),
                            tuple(spec.tail_modules))
            fill_from_file(model, layout, Path(cfg.model_file), key_prefix, TORCH_DTYPES[cfg.weight_dtype],
                           on_weight=quantise)
        model.to(top.device)
        self.lora = stage_lora(model, cfg, spec, mine)
        # (each rank wraps its own blocks that the plan recomputes)
        self.undo = make_trainable(cfg, plan, spec, model, own_paths, quantise, self.lora, log)
        self.model = model
        self.params = [p for _, p in lora_params(self.lora)]
        self.stages = [stage_module(model, spec, r, cfg.autocast, cfg.weight_dtype)
                       .adopt(stage_adapters(self.lora, cfg, spec, r)) for r in mine]
        self.gradients = GradientsInOrder(self.params, top)
        self.schedules: dict = {}
        self.per_replica = cfg.grad_accum // top.replicas
        log(f"micro-batch schedule: {schedule_kind(cfg.schedule)} ({self.per_replica} micro-batch(es) per replica "
            "and step)")

    def load(self, checkpoint, optimizer) -> None:
        """Rank 0 reads the checkpoint into the whole LoRA; every rank takes its stages' part."""
        resumed = None
        if self.lead:
            full, full_opt = full_lora(self.cfg, self.spec)
            state = load_checkpoint(checkpoint, full, full_opt)
            resumed = {"weights": {n: p.detach().clone() for n, p in lora_params(full)},
                       "optimizer": {n: dict(full_opt.state[p]) for n, p in lora_params(full) if p in full_opt.state},
                       "param_groups": state["param_groups"]}
        resumed = _share(resumed, self.top)
        with torch.no_grad():
            for name, p in lora_params(self.lora):
                p.copy_(resumed["weights"][name].to(p.device))
        restore_optimizer(optimizer, {p: resumed["optimizer"][name] for name, p in lora_params(self.lora)
                                      if name in resumed["optimizer"]}, resumed["param_groups"])

    # -- each step ---------------------------------------------------------------------------
    def forward_backward(self, ks: list[int], features, micro_batches) -> float:
        """This replica's share of the step's micro-batches through the pipeline; every replica's
        gradients summed in micro-batch order. The loss is this rank's part (see `agree`)."""
        top = self.top
        own = ks[top.replica * self.per_replica:(top.replica + 1) * self.per_replica]
        loss = 0.0
        for run in micro_batches.runs(own):
            loss += run_schedule(run, self.cfg, self.spec, self.stages, top, self.schedules, micro_batches,
                                 features.latents, features.contexts, self.gradients)
        self.gradients.reduce()
        return loss

    def prepare_inputs(self, k: int, features, micro_batches) -> None:
        """Nothing ahead: a rank reads each run's losses as its schedule ends (`run_schedule`), a host sync
        per run of micro-batches, so inputs made early would not keep its GPU busier."""

    def clip(self, max_norm: float, norm: torch.Tensor | None) -> None:
        clip_pipeline(self.params, max_norm, self.top)      # (`norm` is this rank's part: measured there whole)

    def agree(self, step: int, loss: float, due: bool) -> tuple[float, bool, Stop | None]:
        """Every rank learns the step's loss (the last stages' sum), whether rank 0 is due to save, and
        whether a signal reached any rank: then every rank gets the same stop, at this step."""
        top, flags = self.top, self.flags
        control = torch.tensor([loss], dtype=torch.float64, device=top.device)   # (NCCL: device tensors)
        dist.all_reduce(control)
        flag = torch.tensor([flags.signum, top.rank + 1 if flags.signum else 0, int(due and self.lead)],
                            dtype=torch.int64, device=top.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum, by, due_on_lead = (int(x) for x in flag.cpu())
        # told: each rank's front end says what is kept (commands/train_distributed.py), the loop nothing
        stop = Stop(DistributedStop(signum, top.rank, by - 1, step), told=True) if signum else None
        return float(control[0]), bool(due_on_lead), stop

    def stop_guard(self):
        return self.flags

    def can_save_after(self, stop: BaseException) -> bool:
        # only the stop every rank took together: after an error on one rank the others cannot join its
        # save, and the run resumes from its last periodic checkpoint
        return isinstance(stop, DistributedStop)

    def validation(self, features, picks: list[int]) -> float:
        return validation_loss(self.cfg, self.spec, self.stages, self.top, features.latents, features.contexts, picks)

    def save(self, run, optimizer, at: int, name: str, stopping: bool, log) -> Path | None:
        """Replica 0's stages send their adapters and optimizer state to rank 0, which writes the
        checkpoint and the LoRA in the single-process format; every rank waits until they are written."""
        top, path = self.top, None
        if top.replica == 0:
            mine = {"weights": {n: p.detach().cpu() for n, p in lora_params(self.lora)},
                    "optimizer": {n: {k: torch.as_tensor(v).detach().cpu() for k, v in optimizer.state[p].items()}
                                  for n, p in lora_params(self.lora) if p in optimizer.state},
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
            gathered = [None] * top.ranks if self.lead else None
            dist.gather_object(mine, gathered, dst=0, group=top.pipe_group)
            if self.lead:
                full, full_opt = _assemble(self.cfg, self.spec, gathered)
                path = save_run(run, self.cfg, self.spec, full, full_opt, at, name, stopping, log)
        dist.barrier()
        return path

    def finish(self) -> None:
        if dist.is_initialized():
            dist.barrier()


def _assemble(cfg, spec, gathered: list[dict]):
    """The whole LoRA and its optimizer state from every stage's part."""
    full, full_opt = full_lora(cfg, spec)
    by_name = dict(lora_params(full))
    with torch.no_grad():
        for part in gathered:
            for n, t in part["weights"].items():
                by_name[n].copy_(t)
    restore_optimizer(full_opt, {by_name[n]: state for part in gathered for n, state in part["optimizer"].items()},
                      gathered[0]["param_groups"])
    return full, full_opt


def _layout_line(top: Topology, ranges) -> str:
    per_rank = stages_per_rank(top.schedule)
    layout = f"{top.ranks} stages" if per_rank == 1 else f"{top.ranks} ranks of {per_rank} stages (" + "; ".join(
        f"rank {r}: " + " and ".join(map(str, rank_stages(top.schedule, r, top.ranks))) for r in range(top.ranks)) + ")"
    return (f"distributed: {top.world} ranks = {layout} x {top.replicas} replica(s), blocks "
            + ", ".join(f"[{r.start}, {r.end})" for r in ranges) + f", {'NCCL' if top.device.type == 'cuda' else 'gloo'}")

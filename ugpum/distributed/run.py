"""The training loop on `torch.distributed.pipelining`: the planner's stages on ranks (one stage per
rank, or two with the `interleaved-1f1b` and `zero-bubble` schedules: `schedules.py`),
`--data-parallel R` replicas of that pipeline, launched by torchrun.

Ranks: world = P x replicas, P ranks to a pipeline; rank = replica x P + pipeline rank, so the ranks
of one replica are neighbours (one machine, fast links: the hidden state crosses them every
micro-batch) and the replicas of a rank are P apart (the sum of its LoRA gradients, LoRA-sized, once
per step, may cross machines). NCCL on GPUs (each rank on cuda:LOCAL_RANK, or the LOCAL_RANK-th GPU
`devices` names), gloo on the CPU: `process_group_choice`.

Rank 0 is the run's front: it alone reads the dataset, runs the encoders (through the feature
cache), checks the output folder and a resume, writes plan.json, metrics.jsonl, checkpoints and the
LoRA, in exactly the single-process formats. It hands every other rank what it needs (the cached
features, the split, a resumed checkpoint) over the process group, so other machines need only the
DiT file (each rank streams its own blocks), not the dataset, encoders or output folder.

One step = the same global batch as the single-process run: micro-batches k = step x grad_accum ..
+ grad_accum - 1, replica r taking its consecutive share (grad_accum must divide by R); each
micro-batch's noise and timesteps are drawn from (seed, k), as `ugpum.train.loop.micro_loss` draws
them; the loss of each is divided by grad_accum; each micro-batch's LoRA gradient is kept apart as
its backward ends (whatever order a schedule runs them in) and all are summed in ascending
micro-batch order across the replicas (`GradientsInOrder`); clipping uses the norm over every
stage; AdamW steps each stage's own adapters. So the float operations are the single process's: on
the CPU the LoRA comes out bit for bit the same (the tests ask for a relative difference < 1e-6,
fp32).

Static shapes: a `PipelineStage` and its schedule are built per (item shape, text length, samples,
micro-batches in the run) the first time they occur and reused; a step whose micro-batches come from
buckets of several shapes runs one schedule per run of consecutive micro-batches of one shape, in
ascending order (gradients accumulate in the single-process order).

Validation: the single process's validation loss (`ugpum.train.loop.validation_inputs`: the same
items, noise and timesteps) before the first step and after the last, through replica 0's stages
(forward only, one input at a time, sent rank to rank), logged as the single process logs it.
Preview samples are not rendered (the run log says so once): the model is spread over ranks.

Stopping: Ctrl-C or SIGTERM on any rank sets a flag; at the end of the step every rank learns of it
(a tiny all-reduce each step), rank 0 saves the checkpoint and the LoRA of the completed steps, and
every rank ends with one sentence. A rank killed outright (SIGKILL, a crash) cannot save: torchrun
stops the others and the run resumes from its last periodic checkpoint (`save_every`,
`save_every_minutes`).
"""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from ..arch import get_spec
from ..checkpointing import checkpoint_blocks
from ..devices import resolve_devices
from ..dtypes import TORCH_DTYPES
from ..formats.atomic import write_json_atomic
from ..inplace_guard import guard_inplace_residuals
from ..plan import PlanError
from ..train.cache import FeatureCache
from ..train.checkpoint import load_checkpoint, save_checkpoint
from ..train.config import TrainConfig
from ..train.dataset import caption_dropout
from ..train.flow import flow_loss, noisy, sample_timesteps, timestep_method
from ..train.lora import LoraAdapter, LoraSet, lora_targets
from ..train.loop import (MicroBatches, TrainingError, image_tokens, lr_factor, make_optimizer, model_context,
                          open_run, save_final_lora, training_guidance, validation_inputs, validation_picks)
from ..train.progress import Progress
from .forecast import distributed_plan
from .schedules import rank_stages, schedule_class, schedule_kind, stages_per_rank
from .stages import StageRange, keep_only, stage_module, stage_ranges


class DistributedStop(KeyboardInterrupt):
    """A signal stopped the run on some rank; every rank saved with the others and ends with this
    sentence. `signum`: the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


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
    if ranks < 2:
        raise TrainingError(f"{world} rank(s) with --data-parallel {data_parallel} leave one pipeline stage; "
                            "give torchrun at least 2 ranks per replica (or train without --distributed)")
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


# --------------------------------------------------------------------------------------------
# what rank 0 prepares and hands to every rank
# --------------------------------------------------------------------------------------------

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
    devices = resolve_devices(names, spec, training=True)
    try:
        plan = distributed_plan(spec, devices, cfg.workload(), max(cfg.grad_accum // top.replicas, 1), cfg.schedule)
    except PlanError as e:
        raise TrainingError(str(e)) from None
    bounds = [tuple(s.blocks) for s in plan.stages]
    return plan, bounds


def _prepare_on_rank0(cfg, spec, out: Path, make_encoders, resume: bool, overwrite: bool, top: Topology, log):
    """Rank 0's part before training: the folder checks, features, plan and a resumed checkpoint."""
    items, data_hash, identity, checkpoint, start = open_run(cfg, spec, out, resume, overwrite, log)
    encoders = make_encoders()
    cache = FeatureCache(cfg.cache_dir or out / "cache", encoders)
    try:
        latents = [cache.latent(item) for item in items]
        rng = random.Random(cfg.seed)
        contexts = [cache.text(caption_dropout(item.caption, cfg.caption_dropout, rng)) for item in items]
    finally:
        release = getattr(encoders, "release", None)
        if release:
            release()
    log(f"features: {len(items)} items, cache {cache.hits} hit(s), {cache.misses} computed")
    plan, bounds = split_for(cfg, spec, top)
    write_json_atomic(out / "plan.json", {**plan.to_json(), "distributed": {
        "stages": top.n_stages, "stages_per_rank": stages_per_rank(cfg.schedule), "replicas": top.replicas,
        "ranks": top.world, "bounds": bounds}})
    resumed = None
    if checkpoint is not None:
        lora, optimizer = full_lora(cfg, spec)
        state = load_checkpoint(checkpoint, lora, optimizer)
        resumed = {"weights": {n: p.detach().clone() for n, p in lora_params(lora)},
                   "optimizer": {n: dict(optimizer.state[p]) for n, p in lora_params(lora) if p in optimizer.state},
                   "param_groups": state["param_groups"]}
        metrics = out / "metrics.jsonl"                   # steps after the checkpoint are trained again
        kept = metrics.read_text().splitlines()[:start]
        metrics.write_text("".join(line + "\n" for line in kept))
    return {"latents": latents, "contexts": contexts, "data_hash": data_hash, "identity": identity, "start": start,
            "bounds": bounds, "resumed": resumed, "verdict": plan.verdict, "picks": validation_picks(items)}


def _share(payload, top: Topology):
    """Rank 0's payload (or its error) to every rank."""
    box = [payload]
    dist.broadcast_object_list(box, src=0, device=top.device if top.device.type == "cuda" else None)
    return box[0]


# --------------------------------------------------------------------------------------------
# the LoRA of one stage, and the whole LoRA on rank 0
# --------------------------------------------------------------------------------------------

def _targets(cfg: TrainConfig, spec) -> list[tuple[str, int, int, int]]:
    """(path, block index, in, out) of every LoRA target, in attach_lora's order."""
    out = []
    for i, block in enumerate(spec.blocks):
        for lin in block.linears:
            for path in lora_targets([block.path], [(lin,)], tuple(cfg.targets)):
                out.append((path, i, lin.in_features, lin.out_features))
    return out


def stage_lora(model: nn.Module, cfg: TrainConfig, spec, ranges: StageRange | list[StageRange]) -> LoraSet:
    """The adapters of the blocks of a rank's stage(s), initialised exactly as `attach_lora` initialises
    them on the whole model (one generator drawn in target order: the other stages' draws are made
    and dropped)."""
    ranges = [ranges] if isinstance(ranges, StageRange) else list(ranges)
    for p in model.parameters():
        p.requires_grad_(False)
    lora = LoraSet()
    g = torch.Generator().manual_seed(cfg.seed)
    for path, i, fan_in, fan_out in _targets(cfg, spec):
        if any(r.start <= i < r.end for r in ranges):
            lora.add(model, path, cfg.rank, cfg.alpha, torch.float32, g)
        else:
            LoraAdapter(fan_in, fan_out, cfg.rank, cfg.alpha, torch.device("meta"), torch.float32, g)
    return lora


def stage_adapters(lora: LoraSet, cfg: TrainConfig, spec, rng: StageRange) -> list[LoraAdapter]:
    """The adapters of `lora` on the blocks of stage `rng`."""
    block = {path: i for path, i, _, _ in _targets(cfg, spec)}
    return [a for path, a in lora.items() if rng.start <= block[path] < rng.end]


def lora_params(lora: LoraSet) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) as checkpoints name them: '<linear path>.A' / '.B'."""
    return [(f"{path}.{name}", p) for path, a in lora.items() for name, p in (("A", a.A), ("B", a.B))]


def full_lora(cfg: TrainConfig, spec) -> tuple[LoraSet, torch.optim.Optimizer]:
    """Every adapter of the model on the CPU (no model: a skeleton of Linears on meta carries the
    paths) and an optimizer over them: what rank 0 saves and reads checkpoints and LoRA files with."""
    skeleton = nn.Module()
    lora = LoraSet()
    for path, _, fan_in, fan_out in _targets(cfg, spec):
        parent = skeleton
        for part in path.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(path.rsplit(".", 1)[1], nn.Linear(fan_in, fan_out, bias=False, device="meta"))
        lora.add(skeleton, path, cfg.rank, cfg.alpha)
    lora.remove()                                         # no forward ever runs through the skeleton
    lora.to_empty(device="cpu")
    with torch.no_grad():
        for _, p in lora_params(lora):
            p.zero_()
    return lora, make_optimizer(cfg, [p for _, p in lora_params(lora)])


# --------------------------------------------------------------------------------------------
# the training
# --------------------------------------------------------------------------------------------

@dataclass
class DistributedResult:
    lora_path: Path | None            # on rank 0; None elsewhere
    steps_done: int
    losses: list[float]
    bounds: list[tuple[int, int]]
    resumed_at: int = 0
    validation_before: float = float("nan")
    validation_after: float = float("nan")      # nan when a signal stopped the run


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


def train_distributed(cfg: TrainConfig, out: str | Path, model: nn.Module, make_encoders, key_prefix: str = "",
                      resume: bool = False, overwrite: bool = False, data_parallel: int = 1, log=print,
                      cpu: bool | None = None) -> DistributedResult:
    """Train `cfg`'s LoRA on this rank's stage(s) of `model` (ComfyUI's DiT, on the meta device to be
    streamed from `cfg.model_file`, or with weights), into `out` (written by rank 0). `make_encoders()`
    is called on rank 0 only. Every rank of the torchrun job calls this with the same arguments."""
    out = Path(out)
    spec = get_spec(cfg.model)
    if cfg.optimizer != "adamw":
        raise TrainingError(f"--distributed trains with optimizer 'adamw' (not {cfg.optimizer!r})")
    top = init_distributed(data_parallel, cpu, cfg.schedule, cfg.devices)
    if cfg.grad_accum % top.replicas:
        raise TrainingError(f"grad_accum {cfg.grad_accum} does not divide into {top.replicas} replicas: each replica "
                            "runs grad_accum / R micro-batches of the step's global batch")
    say = log if top.rank == 0 else (lambda *a, **k: None)

    # 1. rank 0: data, folder, features, plan, resume; then everyone gets the same
    payload = None
    if top.rank == 0:
        try:
            payload = _prepare_on_rank0(cfg, spec, out, make_encoders, resume, overwrite, top, say)
        except Exception as e:                           # every rank ends with its sentence
            _share({"error": str(e)}, top)
            raise
    shared = _share(payload, top)
    if "error" in shared:
        raise TrainingError(shared["error"])
    latents, contexts, start = shared["latents"], shared["contexts"], shared["start"]
    ranges = stage_ranges(shared["bounds"])
    mine = [ranges[s] for s in top.stage_ids]
    per_rank = stages_per_rank(cfg.schedule)
    say(shared["verdict"])
    layout = f"{top.ranks} stages" if per_rank == 1 else f"{top.ranks} ranks of {per_rank} stages (" + "; ".join(
        f"rank {r}: " + " and ".join(map(str, rank_stages(cfg.schedule, r, top.ranks))) for r in range(top.ranks)) + ")"
    say(f"distributed: {top.world} ranks = {layout} x {top.replicas} replica(s), blocks "
        + ", ".join(f"[{r.start}, {r.end})" for r in ranges) + f", {'NCCL' if top.device.type == 'cuda' else 'gloo'}")
    if cfg.sample_every:
        say(f"samples: a distributed run renders none (sample_every = {cfg.sample_every} is ignored); the "
            f"validation loss shows progress, and {cfg.output_name}.safetensors loads in ComfyUI to see the LoRA")

    # 2. this rank's share of the model, made safe to differentiate, with its LoRA
    keep_only(model, spec, mine)
    own_paths = [spec.blocks[i].path for r in mine for i in range(r.start, r.end)]
    if any(p.is_meta for p in model.parameters()):
        from ..place import Layout
        from ..stream_load import fill_from_file
        layout_ = Layout({path: str(top.device) for path in own_paths}, str(top.device), str(top.device),
                         tuple(spec.tail_modules))
        fill_from_file(model, layout_, Path(cfg.model_file), key_prefix, TORCH_DTYPES[cfg.weight_dtype])
    model.to(top.device)
    guard_inplace_residuals(model, include_rms=False)
    if cfg.checkpointing:
        checkpoint_blocks(model, own_paths)
    lora = stage_lora(model, cfg, spec, mine)
    params = [p for _, p in lora_params(lora)]
    optimizer = make_optimizer(cfg, params)
    if shared["resumed"] is not None:
        resumed = shared["resumed"]
        with torch.no_grad():
            for name, p in lora_params(lora):
                p.copy_(resumed["weights"][name].to(p.device))
                if name in resumed["optimizer"]:
                    optimizer.state[p] = {k: (v.to(p.device) if v.dim() else v.clone())
                                          for k, v in resumed["optimizer"][name].items()}
        for group, saved in zip(optimizer.param_groups, resumed["param_groups"]):
            group.update(saved)
    stages = [stage_module(model, spec, r, autocast=cfg.autocast).adopt(stage_adapters(lora, cfg, spec, r))
              for r in mine]

    # 3. steps
    micro_batches = MicroBatches([(tuple(latent.shape), model_context(spec, context).shape[1])
                                  for latent, context in zip(latents, contexts)], cfg.batch, cfg.seed)
    schedules: dict = {}
    per_replica = cfg.grad_accum // top.replicas
    say(f"micro-batch schedule: {schedule_kind(cfg.schedule)} ({per_replica} micro-batch(es) per replica and step)")
    metrics_path = out / "metrics.jsonl"
    losses: list[float] = []
    step = saved = start
    last_save = time.monotonic()

    def save(at: int, name: str, stopping: bool = False) -> Path | None:
        nonlocal saved
        path = _collective_save(cfg, spec, lora, optimizer, top, out, at, name, shared, stopping, say)
        saved = at
        return path

    def validation() -> float:
        return validation_loss(cfg, spec, stages, top, latents, contexts, shared["picks"])

    validation_before = validation()
    say(f"validation loss before: {validation_before:.4f}")
    progress = Progress(cfg.steps, start) if top.rank == 0 else None
    lora_path = None
    gradients = GradientsInOrder(params, top)
    with _Flags() as flags:
        while step < cfg.steps:
            t0 = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * lr_factor(cfg, step)
            ks = [step * cfg.grad_accum + j for j in range(cfg.grad_accum)]
            own = ks[top.replica * per_replica:(top.replica + 1) * per_replica]
            loss = 0.0
            for run in _runs(own, micro_batches, latents, contexts):
                loss += _run_schedule(run, cfg, spec, stages, top, schedules, micro_batches, latents, contexts,
                                      gradients)
            gradients.reduce()
            if cfg.max_grad_norm:
                _clip(params, cfg.max_grad_norm, top)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            due = bool(cfg.save_every and step % cfg.save_every == 0) or \
                bool(cfg.save_every_minutes and time.monotonic() - last_save >= 60 * cfg.save_every_minutes)
            control = torch.tensor([loss], dtype=torch.float64, device=top.device)   # (NCCL: device tensors)
            dist.all_reduce(control)                       # the step's loss: the last stages' sum
            flag = torch.tensor([flags.signum, top.rank + 1 if flags.signum else 0, int(due and top.rank == 0)],
                                dtype=torch.int64, device=top.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            flag = flag.cpu()
            loss = float(control[0])
            losses.append(loss)
            if top.rank == 0:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps({"step": step, "loss": loss, "lr": optimizer.param_groups[0]["lr"],
                                        "seconds": round(time.perf_counter() - t0, 4)}) + "\n")
                progress.update(step, loss)
            signum, by = int(flag[0]), int(flag[1]) - 1
            if signum:
                done = step == cfg.steps
                save(step, f"{cfg.output_name}{'' if done else f'_step{step}'}.safetensors", stopping=True)
                name = signal.Signals(signum).name
                raise DistributedStop(
                    f"rank {top.rank}: stopped by {name} on rank {by} after step {step}: checkpoint and LoRA saved "
                    f"in {out} by rank 0; continue with the same torchrun command and --resume {out}", signum)
            if flag[2] and step < cfg.steps:
                save(step, f"{cfg.output_name}_step{step}.safetensors")
                last_save = time.monotonic()
        lora_path = save(step, f"{cfg.output_name}.safetensors")
    validation_after = validation()
    say(f"validation loss after {step} steps: {validation_after:.4f}")
    say(f"trained {step} steps on {top.world} ranks; LoRA {lora_path}")
    dist.barrier()
    return DistributedResult(lora_path, step, losses, shared["bounds"], start, validation_before, validation_after)


def _runs(ks: list[int], micro_batches: MicroBatches, latents, contexts) -> list[list[tuple[int, list[int]]]]:
    """The micro-batches `ks` as runs of consecutive ones of one static shape: [(k, items), ...]."""
    runs: list[list[tuple[int, list[int]]]] = []
    previous = None
    for k in ks:
        picked = micro_batches(k)
        key = (micro_batches.shapes[picked[0]], len(picked))
        if key != previous:
            runs.append([])
            previous = key
        runs[-1].append((k, picked))
    return runs


def micro_batch_inputs(cfg: TrainConfig, spec, latents: list[torch.Tensor], contexts: list[torch.Tensor], k: int):
    """(x0, noise, t, context) of the k-th micro-batch, drawn as `ugpum.train.loop.micro_loss` draws them
    (the same generator seeded by (seed, k), the same order of draws)."""
    g = torch.Generator().manual_seed((cfg.seed * 7_919 + k) % 2**63)
    x0 = torch.stack([latent.float() for latent in latents])
    noise = torch.randn(x0.shape, generator=g)
    t = sample_timesteps(len(latents), timestep_method(cfg.timesteps, spec.family), g, shift=cfg.shift,
                         image_seq_len=image_tokens(spec, latents[0].shape))
    context = torch.cat([model_context(spec, c) for c in contexts])
    return x0, noise, t, context


def stage_inputs(cfg: TrainConfig, spec, x0, noise, t, context, device: torch.device) -> dict:
    """The keyword inputs every stage takes for one micro-batch, as `ugpum.train.loop.loss_at` feeds
    the whole model: the noised latent, the scaled timestep, the text and (models with it) guidance."""
    kw = {"x": noisy(x0, noise, t).to(device), "timestep": (t * spec.timestep_scale).to(device),
          "context": context.to(device)}
    guidance = training_guidance(spec, cfg.guidance)
    if guidance is not None:
        kw["guidance"] = torch.full((x0.shape[0],), guidance, device=device)
    return kw


class KeptStage(PipelineStage):
    """A `PipelineStage` that hands each micro-batch's LoRA gradient to `GradientsInOrder` as soon as
    that micro-batch's backward is done: after the full backward, or, where a zero-bubble schedule
    splits it, after the weights' part (which sets `.grad` itself, so no autograd hook sees it)."""

    def __init__(self, module: nn.Module, index: int, n_stages: int, device, group, gradients):
        super().__init__(module, index, n_stages, device, group=group)
        self.gradients = gradients

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        if full_backward:
            self.gradients.take(self.submod, bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self.gradients.take(self.submod, bwd_chunk_id)


def _run_schedule(run, cfg, spec, stages: list[nn.Module], top: Topology, schedules: dict, micro_batches, latents,
                  contexts, gradients) -> float:
    """One schedule over a run of same-shape micro-batches; returns the sum of their losses (on the
    rank holding the last stage; 0 elsewhere)."""
    device = top.device
    (_, picked0) = run[0]
    key = (micro_batches.shapes[picked0[0]], len(picked0), len(run))
    if key not in schedules:
        held = [KeptStage(module, s, top.n_stages, device, top.pipe_group, gradients)
                for s, module in zip(top.stage_ids, stages)]
        cls = schedule_class(cfg.schedule, len(run), top.ranks)

        def loss_fn(pred, target):                  # target: x0, noise and t packed in one tensor [B, 2n + 1]
            n = pred[0].numel()
            x0, noise = target[:, :n].view_as(pred), target[:, n:2 * n].view_as(pred)
            return flow_loss(pred.float(), x0, noise, target[:, 2 * n], cfg.weighting) / cfg.grad_accum
        one = issubclass(cls, PipelineScheduleSingle)
        schedules[key] = cls(held[0] if one else held, n_microbatches=len(run), loss_fn=loss_fn, scale_grads=False)
    schedule = schedules[key]
    kwarg_mbs, target_mbs = [], []
    for k, picked in run:
        x0, noise, t, context = micro_batch_inputs(cfg, spec, [latents[i] for i in picked],
                                                   [contexts[i] for i in picked], k)
        kwarg_mbs.append(stage_inputs(cfg, spec, x0, noise, t, context, device))
        target_mbs.append(torch.cat([x0.flatten(1), noise.flatten(1), t.float()[:, None]], dim=1).to(device))
    last = top.n_stages - 1 in top.stage_ids
    losses: list = [] if last else None
    gradients.ks = [k for k, _ in run]
    schedule.step(arg_mbs=[()] * len(run), kwarg_mbs=kwarg_mbs, target_mbs=target_mbs if last else None,
                  losses=losses, return_outputs=False)
    return sum(float(x.detach()) for x in losses) if last else 0.0


class GradientsInOrder:
    """Each micro-batch's LoRA gradient kept apart (`KeptStage` takes it out of `.grad` when the
    micro-batch's backward ends, keyed by its number k), then summed in ascending k across the
    replicas: replica r receives the running sum of replicas 0..r-1, adds its own micro-batches one by
    one and passes it on; the last replica's sum goes back to all (a broadcast). The float additions
    are exactly those of the single process's gradient accumulation (((g0 + g1) + g2) + ...), whatever
    order a schedule runs the backwards in (Looped BFS runs them last micro-batch first), which an
    all-reduce of per-replica sums ((g0 + g1) + (g2 + g3)) is not: Adam turns that last-bit
    difference into ~1e-6 of the LoRA within a few steps. The cost against an all-reduce: the same
    bytes per rank, R - 1 hops of latency, and the micro-batches' gradients of a rank held until the
    step ends (LoRA-sized)."""

    def __init__(self, params: list[nn.Parameter], top: Topology):
        self.params, self.top = params, top
        self.index = {id(p): i for i, p in enumerate(params)}
        self.kept: dict[int, dict[int, torch.Tensor]] = {}
        self.ks: list[int] = []                    # micro-batch numbers of the running schedule's chunks

    def take(self, module: nn.Module, chunk: int) -> None:
        """Move the gradients `module`'s LoRA parameters hold (chunk `chunk` of the running schedule)."""
        kept = self.kept.setdefault(self.ks[chunk], {})
        for p in module.parameters():
            i = self.index.get(id(p))
            if i is not None and p.grad is not None:
                kept[i] = p.grad
                p.grad = None

    def reduce(self) -> None:
        """Set every parameter's `.grad` to the step's gradient (all micro-batches of all replicas)."""
        top, n = self.top, len(self.params)
        short = {k: n - len(g) for k, g in self.kept.items() if len(g) != n}
        if short:
            raise RuntimeError(f"pipeline: micro-batch(es) {sorted(short)} left LoRA parameters of rank {top.rank} "
                               "without a gradient")
        total = None
        if top.replica > 0:
            size = sum(p.numel() for p in self.params)
            total = torch.empty(size, dtype=torch.float32, device=top.device)
            dist.recv(total, src=top.rank - top.ranks)
        for k in sorted(self.kept):
            flat = torch.cat([self.kept[k][i].reshape(-1) for i in range(n)])
            total = flat if total is None else total + flat
        if top.replica < top.replicas - 1:
            dist.send(total, dst=top.rank + top.ranks)
        if top.replicas > 1:
            last = (top.replicas - 1) * top.ranks + top.pipe_rank
            dist.broadcast(total, src=last, group=top.dp_group)
        offset = 0
        for p in self.params:
            p.grad = total[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.kept = {}


# --------------------------------------------------------------------------------------------
# validation: forward only, through replica 0's stages
# --------------------------------------------------------------------------------------------

_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_TENSORS, _SLOT = 4, 8                        # a header slot: dtype, ndim, up to 6 sizes


def _send_hidden(tensors: tuple[torch.Tensor, ...], dst: int, device: torch.device) -> None:
    """A stage's output to rank `dst`: a header (count, dtypes, shapes), then each tensor."""
    header = torch.zeros(1 + _MAX_TENSORS * _SLOT, dtype=torch.int64)
    header[0] = len(tensors)
    for j, t in enumerate(tensors):
        at = 1 + j * _SLOT
        header[at], header[at + 1] = _WIRE_DTYPES.index(t.dtype), t.dim()
        header[at + 2:at + 2 + t.dim()] = torch.tensor(t.shape)
    dist.send(header.to(device), dst)
    for t in tensors:
        dist.send(t.contiguous(), dst)


def _recv_hidden(src: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    header = torch.empty(1 + _MAX_TENSORS * _SLOT, dtype=torch.int64, device=device)
    dist.recv(header, src)
    header = header.cpu().tolist()
    out = []
    for j in range(header[0]):
        at = 1 + j * _SLOT
        t = torch.empty(header[at + 2:at + 2 + header[at + 1]], dtype=_WIRE_DTYPES[header[at]], device=device)
        dist.recv(t, src)
        out.append(t)
    return tuple(out)


@torch.no_grad()
def validation_loss(cfg: TrainConfig, spec, stages: list[nn.Module], top: Topology, latents, contexts,
                    picks: list[int]) -> float:
    """`ugpum.train.loop.validation_loss` of the pipeline: the same inputs (`validation_inputs`), one at
    a time through replica 0's stages, the loss on the rank of the last stage, summed in the same
    order; every rank returns it."""
    total = torch.zeros(2, dtype=torch.float64, device=top.device)
    if top.replica == 0:
        last, device, summed, n = top.n_stages - 1, top.device, 0.0, 0
        for x0, noise, t, context in validation_inputs(spec, latents, contexts, picks):
            kw = stage_inputs(cfg, spec, x0, noise, t, context, device)
            hidden: tuple = ()
            for s, module in zip(top.stage_ids, stages):
                if s > 0 and top.owner(s - 1) != top.rank:
                    hidden = _recv_hidden(top.owner(s - 1), device)
                out = module(*hidden, **kw)
                hidden = out if isinstance(out, tuple) else (out,)
                if s == last:
                    pred = hidden[0].float()
                    summed += flow_loss(pred, x0.to(pred.device), noise.to(pred.device), t.to(pred.device),
                                        "none").item()
                    n += 1
                elif top.owner(s + 1) != top.rank:
                    _send_hidden(hidden, top.owner(s + 1), device)
        total[0], total[1] = summed, n
    dist.all_reduce(total)                         # from the last stage's rank to every rank
    return float(total[0]) / float(total[1])


def _clip(params: list[nn.Parameter], max_norm: float, top: Topology) -> None:
    """`clip_grad_norm_` over the whole LoRA: the norm over every stage of the pipeline."""
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.stack([torch.linalg.vector_norm(g, 2) for g in grads]) if grads else torch.zeros(1)
    square = (local.double() ** 2).sum().reshape(1).to(top.device)
    dist.all_reduce(square, group=top.pipe_group)
    total = square.sqrt().float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))


def _collective_save(cfg, spec, lora, optimizer, top: Topology, out: Path, at: int, name: str, shared: dict,
                     stopping: bool, say) -> Path | None:
    """Replica 0's stages send their adapters and optimizer state to rank 0, which writes the
    checkpoint and the LoRA in the single-process format; every rank waits until they are written."""
    path = None
    if top.replica == 0:
        mine = {"weights": {n: p.detach().cpu() for n, p in lora_params(lora)},
                "optimizer": {n: {k: torch.as_tensor(v).detach().cpu() for k, v in optimizer.state[p].items()}
                              for n, p in lora_params(lora) if p in optimizer.state},
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
        gathered = [None] * top.ranks if top.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=top.pipe_group)
        if top.rank == 0:
            full, full_opt = full_lora(cfg, spec)
            by_name = dict(lora_params(full))
            with torch.no_grad():
                for part in gathered:
                    for n, t in part["weights"].items():
                        by_name[n].copy_(t)
                    for n, state in part["optimizer"].items():
                        full_opt.state[by_name[n]] = state
            for group, saved in zip(full_opt.param_groups, gathered[0]["param_groups"]):
                group.update(saved)
            say(f"saving checkpoint and LoRA at step {at}")
            save_checkpoint(out, at, full, full_opt, {"model": spec.id, "identity": shared["identity"],
                                                      "interrupted": stopping})
            path = save_final_lora(cfg, spec, full, out, at, shared["data_hash"], name)
    dist.barrier()
    return path

"""One optimizer step's micro-batches through `torch.distributed.pipelining` schedules, their LoRA
gradients summed in the single process's order, and clipping over the whole pipeline.

Static shapes: a `PipelineStage` and its schedule are built per (item shape, text length, samples,
micro-batches in the run) the first time they occur and reused; a step whose micro-batches come from
buckets of several shapes runs one schedule per run of consecutive micro-batches of one shape, in
ascending order (gradients accumulate in the single-process order).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from ..diffusion.flow import flow_loss
from ..train.objective import micro_batch_inputs, model_inputs
from .schedules import schedule_class
from .topology import Topology


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


def run_schedule(run, cfg, spec, stages: list[nn.Module], top: Topology, schedules: dict, micro_batches, latents,
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
                                                   [contexts[i] for i in picked], k, device)
        kwarg_mbs.append(model_inputs(cfg, spec, x0, noise, t, context, device))
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


def clip_pipeline(params: list[nn.Parameter], max_norm: float, top: Topology) -> None:
    """`clip_grad_norm_` over the whole LoRA: the norm over every stage of the pipeline."""
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.stack([torch.linalg.vector_norm(g, 2) for g in grads]) if grads else torch.zeros(1)
    square = (local.double() ** 2).sum().reshape(1).to(top.device)
    dist.all_reduce(square, group=top.pipe_group)
    total = square.sqrt().float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))

"""Replicas in one process: a copy of the model for each replica of the plan (`Plan.replicas`), each on its
own device(s) with its own plan, each training its consecutive share of a step's micro-batches in a worker
thread of its own, their LoRA gradients summed on the first replica. Only the first replica's LoRA is
trained: the optimizer steps it, checkpoints save it, validation and samples use it; the others take its
weights at the start of every step (copied over the link between the GPUs: no NCCL).

The step is one device's: micro-batch k draws its noise and timesteps from (seed, k) wherever it runs; the
first replica accumulates the gradients of its micro-batches (the step's first ones) as one device does, and
another replica hands over the gradient of each of its micro-batches on its own (kept on its device until the
step ends), which the first adds in ascending k: ((g0 + g1) + g2) + g3, the float additions of one device's
gradient accumulation, so on the CPU the LoRA comes out bit for bit. A replica that pipelines its micro-batches
over several stages (splits x replicas) hands over the sum of its share: the same up to the order of float
additions.

The replicas share one pinned host copy of the blocks they swap alike (`ugpum.placement.place.
share_swapped_blocks`). One plan of one copy runs without threads, exactly as before replicas.
"""
from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..placement.pipeline import accumulate
from ..placement.place import Layout
from ..planning.plan import Plan
from ..planning.replicas import hands_each
from .prepare import make_placed_trainable, place_for_training


def _quiet(*_args) -> None:
    pass


@dataclass
class Replica:
    """One copy of the model, placed by its own plan and trainable."""
    plan: Plan
    model: nn.Module
    lora: object                       # ugpum.compute.lora.LoraSet
    layout: Layout
    release: Callable[[], None]
    swaps: list                        # its block swap handles (ugpum.placement.swap.SwapHandle), if it swaps

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, a in self.lora.items() for p in (a.A, a.B)]


def place_replicas(cfg, spec, plan: Plan, model: nn.Module, key_prefix: str, log) -> list[Replica]:
    """A trainable copy of `model` for each copy the plan trains (`model` itself for the first). Every copy is
    placed before any is made trainable, so each swapped block is copied (`block_copy`) as it was loaded."""
    models = [model] + [copy.deepcopy(model) for _ in plan.copies[1:]]    # (on meta, a copy costs nothing)
    placed, swaps = [], {}
    for p, m in zip(plan.copies, models):
        alike = (p.base_compute, p.workload["held_dtype"])                # a host copy serves its own precision
        placed.append(place_for_training(cfg, spec, p, m, key_prefix, share=swaps.get(alike, [])))
        swaps[alike] = swaps.get(alike, []) + placed[-1].swaps
    return [Replica(p.plan, *make_placed_trainable(cfg, spec, p, log if r == 0 else _quiet, drop=r > 0), p.swaps)
            for r, p in enumerate(placed)]


class Replicas:
    """The replicas of a run and how a step runs over them (one worker thread per replica)."""

    def __init__(self, replicas: list[Replica], shares: list[int]):
        self.replicas, self.shares = replicas, shares
        self.lead = replicas[0]
        self.pool = ThreadPoolExecutor(len(replicas), "ugpum-replica") if len(replicas) > 1 else None
        self.warm = False                  # the first step runs the replicas one after the other (compiling once)

    def step(self, ks: list[int], loss_of: Callable[[Replica, int], torch.Tensor]) -> list[torch.Tensor]:
        """Forward and backward of micro-batches `ks` over the replicas, the step's LoRA gradient in the first
        replica's parameters; `loss_of`'s losses in ascending k, left on their devices (the loop reads them
        with the gradients' norm in one host sync: `divergence.StepReading`)."""
        lead = self.lead
        if self.pool is None:
            return [x.detach() for x in accumulate(lambda k: loss_of(lead, k), ks, lead.plan.schedule,
                                                   lead.layout, lead.model)]
        self.take_lead_weights()
        parts, start = [], 0
        for share in self.shares:
            parts.append(ks[start:start + share])
            start += share
        jobs = [(r, part) for r, part in zip(self.replicas, parts) if part]
        if self.warm:
            futures = [self.pool.submit(self._run, r, part, loss_of, r is lead) for r, part in jobs]
            try:
                results = [f.result() for f in futures]
            finally:
                wait(futures)              # (a stop in this thread: the workers end their share first)
        else:
            results = [self._run(r, part, loss_of, r is lead) for r, part in jobs]
            self.warm = True
        losses, handed = {}, {}
        for own_losses, own_gradients in results:
            losses.update(own_losses)
            handed.update(own_gradients)
        self._add_in_order(handed)
        return [losses[k] for k in sorted(losses)]

    def take_lead_weights(self) -> None:
        """Every replica's LoRA set to the first replica's (after its optimizer step, or a resume)."""
        with torch.no_grad():
            for r in self.replicas[1:]:
                for mine, lead in zip(r.params, self.lead.params):
                    mine.copy_(lead)
                    mine.grad = None

    def _run(self, replica: Replica, ks: list[int], loss_of, is_lead: bool):
        """One replica's share: ({k: loss}, {k: the gradients handed over}). The first replica accumulates in
        its parameters; another hands over each micro-batch's gradients (`hands_each`) or its share's sum."""
        device = torch.device(replica.layout.first)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        runs = [[k] for k in ks] if hands_each(replica.plan) and not is_lead else [ks]
        losses, handed = {}, {}
        for run in runs:
            out = accumulate(lambda k: loss_of(replica, k), run, replica.plan.schedule, replica.layout, replica.model)
            losses.update({k: x.detach() for k, x in zip(run, out)})
            if not is_lead:
                handed[run[0]] = self._take_gradient(replica)
        return losses, handed

    @staticmethod
    def _take_gradient(replica: Replica) -> list[torch.Tensor | None]:
        """The gradient each LoRA parameter of `replica` holds, taken out (None where it has none)."""
        taken = []
        for p in replica.params:
            taken.append(p.grad)
            p.grad = None
        return taken

    def _add_in_order(self, handed: dict[int, list]) -> None:
        """Add the gradients handed over to the first replica's, in ascending micro-batch order."""
        with torch.no_grad():
            for k in sorted(handed):
                for p, g in zip(self.lead.params, handed[k]):
                    if g is None:
                        continue
                    g = g.to(p.device)
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad += g

    @property
    def devices(self) -> list[str]:
        """The CUDA devices every replica's stages run on."""
        return sorted({s.torch_device for r in self.replicas for s in r.plan.stages
                       if (s.torch_device or "").startswith("cuda")})

    def release(self) -> None:
        """Give back every replica (the copies first: they stream from the first's host copies), and the threads."""
        if self.pool is not None:
            self.pool.shutdown()
        for r in reversed(self.replicas):
            r.release()

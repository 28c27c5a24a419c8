"""The one-process engine behind `train()`: the model placed by the plan on this machine's devices
(split over its GPUs, blocks swapped from host memory where they do not fit), each step's
micro-batches pipelined over its stages (`ugpum.placement.pipeline.accumulate`); or, where the plan has
replicas, a copy of the model for each, training its share of the micro-batches beside the others
(`replicas.py`).

A stepper keeps the contract `engine.Stepper` writes down: what `ugpum.train.loop.train` asks of
its engine. The torchrun engine (`ugpum.distributed.stepper`) keeps it for one rank of a job."""
from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from .divergence import clip_with_norm
from .run.checkpoint import load_checkpoint
from .objective import InputsAhead, loss_at, micro_batch_inputs, validation_loss
from .prepare import plan_for
from .replicas import Replicas, place_replicas
from .run.folder import save_run
from .stopping import stop_on_sigterm


class OneProcessStepper:
    """Every device of the plan in this process (`engine.Stepper`)."""
    name = "one process"
    lead = True                    # this process reads the data and writes the run folder
    can_sample = True
    defers_readings = True         # nothing to agree on with other processes

    def __init__(self, plan=None):
        self.plan = plan           # the one the Partition Planner showed; None: planned here

    def share(self, begin):
        return begin()

    def make_plan(self, cfg, spec):
        return self.plan or plan_for(cfg, spec)

    def plan_record(self, plan) -> dict:
        return plan.to_json()

    def encoders(self, given):
        return given

    def prepare(self, cfg, spec, plan, model, key_prefix: str, log) -> None:
        self.cfg, self.spec, self.plan = cfg, spec, plan
        self.replicas = Replicas(place_replicas(cfg, spec, plan, model, key_prefix, log), plan.shares)
        lead = self.replicas.lead                  # the replica whose LoRA trains (the only one without replicas)
        self.model, self.lora, self.layout = lead.model, lead.lora, lead.layout
        self.params = lead.params
        self.devices = self.replicas.devices
        self.ahead = InputsAhead()
        if plan.replicas:
            log(f"replicas: {len(plan.replicas)} in one process, micro-batches per step "
                f"{'/'.join(map(str, plan.shares))}, LoRA gradients summed on the first")
            if plan.runs_as != "one process":        # (ugpum/planning/replicas.py: not built yet)
                log(f"note: the plan would run the replicas as {plan.runs_as}, which this engine cannot start: "
                    "they run in this one process, slower than the forecast by what one process loses")
        if cfg.grad_accum > 1:
            log(f"micro-batch schedule: {plan.schedule}")

    def load(self, checkpoint, optimizer) -> None:
        load_checkpoint(checkpoint, self.lora, optimizer)

    def forward_backward(self, ks: list[int], features, micro_batches) -> list[torch.Tensor]:
        """Forward and backward of the micro-batches `ks`, their LoRA gradients summed in order; each
        micro-batch's mean loss / grad_accum, in order, not yet read (the step's loss is their sum)."""
        cfg = self.cfg

        def one(replica, k: int) -> torch.Tensor:
            first = replica.layout.first
            inputs = self.ahead.take(k, first, lambda: self._inputs(features, micro_batches, k, first))
            return loss_at(replica.model, self.spec, cfg, *inputs, first, cfg.weighting) / cfg.grad_accum
        return self.replicas.step(ks, one)

    def prepare_inputs(self, k: int, features, micro_batches) -> None:
        """Micro-batch k's inputs made now, on the lead replica's first device (it runs a step's first micro-batch)."""
        first = self.layout.first
        self.ahead.prepare(k, first, lambda: self._inputs(features, micro_batches, k, first))

    def _inputs(self, features, micro_batches, k: int, device) -> tuple:
        picked = micro_batches(k)
        return micro_batch_inputs(self.cfg, self.spec, [features.latents[i] for i in picked],
                                  [features.contexts[i] for i in picked], k, device)

    def clip(self, max_norm: float, norm: torch.Tensor | None) -> None:
        clip_with_norm(self.params, max_norm, norm)          # (this process holds the whole LoRA)

    def agree(self, step: int, loss: float, due: bool) -> tuple[float, bool, None]:
        """(loss, a save due, no stop): one process agrees with itself; a signal has raised already."""
        return loss, due, None

    def stop_guard(self) -> AbstractContextManager:
        return stop_on_sigterm()   # a signal raises where it lands, Ctrl-C and SIGTERM alike

    def can_save_after(self, stop: BaseException) -> bool:
        return True                # every stop and error: the completed steps are saved before it goes on

    def validation(self, features, picks: list[int]) -> float:
        return validation_loss(self.model, self.spec, self.cfg, features.latents, features.contexts,
                               self.layout.first, picks)

    def save(self, run, optimizer, at: int, name: str, stopping: bool, log):
        return save_run(run, self.cfg, self.spec, self.lora, optimizer, at, name, stopping, log)

    def finish(self) -> None:
        self.replicas.release()

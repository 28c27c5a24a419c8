"""The engine's contract: what the one training loop (`loop.py`) asks of the stepper that runs it.

Two steppers keep it: `OneProcessStepper` (`stepper.py`: every GPU of this machine in one process)
and `TorchrunRankStepper` (`ugpum.distributed.stepper`: one rank of a torchrun job). Both pipeline a
step's micro-batches over stages; they differ in where the stages live and in how a run stops:

* one process: Ctrl-C or SIGTERM raises where it lands (`stopping.py`), and the loop saves the
  completed steps after any stop or error;
* a rank: a signal only sets a flag, `agree` hands the loop the stop that every rank takes at the
  same step (a `Stop`: each rank's front end says what is kept), and only that stop can be saved (the
  save needs every rank; after an error on one rank the others cannot join it, and the run resumes
  from its last periodic checkpoint).

The loop has one way to stop either way: whatever is raised during the steps reaches the one handler
in `RunState.run_steps`, which saves what `can_save_after` allows.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from ..arch import ArchSpec
    from ..planning.plan import Plan
    from .batches import Features, MicroBatches
    from .config import TrainConfig
    from .run.folder import OpenedRun
    from .stopping import Stop

T = TypeVar("T")


class Stepper(Protocol):
    """What `ugpum.train.loop.train` uses of its engine, in the order it uses it."""

    name: str                              # the engine in the run log's words ("one process", "a distributed run")
    lead: bool                             # this process reads the data, runs the encoders, writes the run folder
    can_sample: bool                       # the whole model is here, so preview samples can be rendered
    params: list[torch.nn.Parameter]       # the LoRA parameters this process trains (after `prepare`)
    model: torch.nn.Module                 # the model as `prepare` left it (samples render with it)
    devices: list[str]                     # the CUDA devices whose peak memory the run reports
    defers_readings: bool                  # a step's loss may be read while the next one runs (`agree` does nothing)

    def share(self, begin: Callable[[], T]) -> T:
        """`begin()` run by the lead; its result, or its error, on every process of the run."""

    def make_plan(self, cfg: TrainConfig, spec: ArchSpec) -> Plan:
        """The plan this engine trains with (made on the lead, inside `begin`)."""

    def plan_record(self, plan: Plan) -> dict:
        """What plan.json records of `plan`."""

    def encoders(self, given):
        """The text encoder and VAE the lead caches features with (`given`: the caller's)."""

    def prepare(self, cfg: TrainConfig, spec: ArchSpec, plan: Plan, model: torch.nn.Module, key_prefix: str,
                log: Callable) -> None:
        """This process's part of `model` placed by `plan` and made trainable, with its LoRA."""

    def load(self, checkpoint: Path, optimizer: torch.optim.Optimizer) -> None:
        """The LoRA and the optimizer's state from a run's checkpoint folder."""

    def forward_backward(self, ks: list[int], features: Features, micro_batches: MicroBatches
                         ) -> float | list[torch.Tensor]:
        """Forward and backward of the step's micro-batches `ks`, the LoRA gradients summed in micro-batch
        order; this process's part of the step's loss (each micro-batch's mean loss / grad_accum): a number,
        or those losses as tensors still on their devices, which `divergence.StepReading` reads and sums."""

    def prepare_inputs(self, k: int, features: Features, micro_batches: MicroBatches) -> None:
        """Make micro-batch k's inputs now, ahead of its step: the loop asks for the next step's first while the
        GPUs still run this step (the engine may also do nothing and make them in their turn)."""

    def clip(self, max_norm: float, norm: torch.Tensor | None) -> None:
        """Clip the gradients of the whole LoRA to `max_norm` (their norm over every process). `norm`: the norm of
        this process's gradients as `divergence.StepReading` measured it (a device tensor; None: no gradients),
        the whole LoRA's where one process holds it all."""

    def agree(self, step: int, loss: float, due: bool) -> tuple[float, bool, Stop | None]:
        """After step `step`: (its loss, whether a save is due, the stop every process takes now or None),
        the same on every process of the run."""

    def stop_guard(self) -> AbstractContextManager:
        """The context the steps run in: how Ctrl-C and SIGTERM reach the run while it steps."""

    def can_save_after(self, stop: BaseException) -> bool:
        """Whether the completed steps can still be saved once `stop` (a stop or an error) ended the steps."""

    def validation(self, features: Features, picks: list[int]) -> float:
        """The validation loss of the items `picks`, with the run's fixed noise and timesteps."""

    def save(self, run: OpenedRun, optimizer: torch.optim.Optimizer, at: int, name: str, stopping: bool,
             log: Callable) -> Path | None:
        """A checkpoint at step `at` and the LoRA as `name`, written by the lead (its path there; None elsewhere)."""

    def finish(self) -> None:
        """Give back what `prepare` took (the run is over, however it ended)."""

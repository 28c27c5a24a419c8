"""The training loop: dataset -> cached features -> plan -> trainable model -> steps -> LoRA.

Read `train()` top to bottom: it is the whole story, for one process and for every rank of a
distributed run alike. What differs between those is the stepper (`engine.Stepper`: `stepper.py`
for one process, `ugpum.distributed.stepper` for a rank of torchrun): where the model lives and how
one step's micro-batches run. Everything else here is the same for both: the run folder, the
learning rate, metrics, saves, validation, samples and what is kept when a run stops (one path:
`RunState.stopped`, whose `Stop` the exception carries out).
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..arch import ArchSpec, get_spec
from ..compute.compile import compile_stats
from ..formats.atomic import append_line, write_json_atomic
from ..formats.refused import SaveRefused
from ..planning.plan import Plan
from ..wording import plain, setting
from .batches import Features, MicroBatches, encode_features
from .config import TrainConfig
from .divergence import NonFiniteStep, StepReading, skips_on_device
from .engine import Stepper
from .errors import RunExists, TrainingError  # noqa: F401 (the engine's errors, importable from here)
from .objective import validation_picks
from .prepare import make_optimizer, plan_for, prepare_model  # noqa: F401 (bench, tests)
from .lr_schedule import lr_factor
from .progress import Progress
from .run.folder import OpenedRun, earlier_run, keep_metrics_until, open_run  # noqa: F401 (the nodes)
from .run.lock import hold_run_folder
from .samples import Samples
from .stepper import OneProcessStepper
from .stopping import Stop, saving, stop_on_sigterm, stopped_note, uninterrupted


@dataclass
class TrainResult:
    lora_path: Path | None                # None on the ranks of a distributed run that do not write
    steps_done: int
    losses: list[float]
    plan: Plan
    cache_hits: int
    cache_misses: int
    validation_before: float
    validation_after: float
    peak_gib: dict[str, float] = field(default_factory=dict)
    samples: list[Path] = field(default_factory=list)
    sample_grid: Path | None = None
    resumed_at: int = 0                   # the checkpoint's step a resumed run started from


@dataclass
class Hooks:
    """How a front end follows and steers a run (all optional)."""
    log: Callable = None                  # (default: print, the settings it names as the settings' own names)
    on_step: Callable[[int, int, float], None] | None = None
    check_interrupt: Callable[[], None] | None = None     # raises to stop (ComfyUI's Cancel)
    on_sample: Callable[[int, object], None] | None = None
    on_partial_lora: Callable[[Path], None] | None = None  # the LoRA a stopped run kept


def print_plain(text) -> None:
    """A library caller's log: the settings the engine names as the settings' own names (`wording.plain`);
    the command line and the nodes pass their own, which word them as flags and inputs."""
    print(plain(str(text)))


def _quiet(*_args, **_kwargs) -> None:
    pass


def train(cfg: TrainConfig, out: str | Path, model: torch.nn.Module, encoders, key_prefix: str = "",
          resume: bool = False, overwrite: bool = False, plan: Plan | None = None, stepper: Stepper | None = None,
          inputs: dict | None = None, spec: ArchSpec | None = None, **hooks) -> TrainResult:
    """Train `cfg`'s LoRA on `model` (ComfyUI's DiT module, on the meta device to be streamed from
    `cfg.model_file`, or with weights) with `encoders`, into `out`. `spec`: the model's (the front end's,
    passed along from here; None: `cfg.model`'s). `plan`: the one the Partition Planner showed; None plans
    here, with the same function. `resume` continues the run in `out` (only the same run); a new run never
    replaces an earlier one unless `overwrite`. `stepper`: the engine (`engine.Stepper`; default: this
    process, `OneProcessStepper`). `inputs`: what the front end loaded the run from (file paths,
    JSON-ready), recorded in each checkpoint so that a resume can load the same. `hooks`: `Hooks`' fields. Every way the run ends keeps every completed step: a checkpoint, and
    the LoRA so far; a run stopped during its steps raises its exception with a `Stop` saying what is kept
    (`stopping.Stop.of`). The run folder is locked for the run's life (another run into it is refused), and
    SIGTERM stops every phase as Ctrl-C does."""
    hooks["log"] = hooks.get("log") or print_plain
    out, stepper, log = Path(out), stepper or OneProcessStepper(plan), hooks["log"]
    with contextlib.ExitStack() as held:
        held.enter_context(stop_on_sigterm())
        try:
            if stepper.lead:
                with uninterrupted():                    # a stop as the lock is taken: lock released, said
                    held.enter_context(hold_run_folder(out, log))
            return _train(cfg, spec or get_spec(cfg.model), out, model, encoders, key_prefix, resume, overwrite,
                          stepper, inputs, hooks)
        except KeyboardInterrupt as why:                 # before or between the steps' own saves
            if stepper.lead and not Stop.of(why).told:
                log(stopped_note(out, resume))
            raise


def _train(cfg: TrainConfig, spec: ArchSpec, out: Path, model, encoders, key_prefix: str, resume: bool,
           overwrite: bool, stepper: Stepper, inputs: dict | None, hooks: dict) -> TrainResult:
    h = Hooks(**hooks)
    say = h.log if stepper.lead else _quiet

    # 1. on the lead: the data, whether this run may start or continue here, the features, the plan
    def begin():
        run = open_run(cfg, spec, out, resume, overwrite, h.log, inputs)
        features = encode_features(cfg, spec, run.items, stepper.encoders(encoders), out, h.log)
        chosen = stepper.make_plan(cfg, spec)
        write_json_atomic(run.files.plan, stepper.plan_record(chosen))
        return run, features, chosen
    run, features, plan = stepper.share(begin)
    say(plan.verdict)
    if cfg.guidance is not None and not spec.guidance:
        say(f"note: setting 'guidance' = {cfg.guidance} is ignored: {spec.id} has no guidance embedding")

    # 2. the model, trainable, and its optimizer (restored on resume)
    stepper.prepare(cfg, spec, plan, model, key_prefix, say)
    try:
        optimizer = make_optimizer(cfg, stepper.params)
        if run.checkpoint is not None:
            stepper.load(run.checkpoint, optimizer)
            if stepper.lead:
                keep_metrics_until(out, run.start)           # steps after the checkpoint are trained again
        samples = Samples(cfg, spec, out, stepper.model, getattr(encoders, "decode", None), features.prompt,
                          features.negative, run.items, h.on_sample, say) if cfg.sample_every and stepper.can_sample \
            else None
        if cfg.sample_every and samples is None:
            say(f"samples: {stepper.name} renders none (sample_every = {cfg.sample_every} is ignored); the validation "
                f"loss shows progress, and {cfg.output_name}.safetensors loads in ComfyUI to see the LoRA")
        state = RunState(cfg, spec, run, features, plan, stepper, optimizer, samples, h, say)
        return state.run_steps()
    finally:
        stepper.finish()


@dataclass
class RunState:
    """One run while it steps: what it trains with, and how far it got."""
    cfg: TrainConfig
    spec: ArchSpec
    run: OpenedRun
    features: Features
    plan: Plan
    stepper: Stepper
    optimizer: torch.optim.Optimizer
    samples: Samples | None
    hooks: Hooks
    say: Callable
    step: int = 0
    saved: int = 0                         # the step the newest save holds
    lora: Path | None = None               # that save's LoRA
    refused: int | None = None             # the step whose save the system refused
    losses: list[float] = field(default_factory=list)
    pending: tuple | None = None           # the applied step not read yet: (StepReading, its start, a save due, lr)
    last_read: float = 0.0                 # when the step before it was read (time.monotonic)
    progress: Progress | None = None

    def save(self, name: str, stopping: bool = False) -> Path | None:
        """A checkpoint and the LoRA at the current step (written by the lead)."""
        try:
            path = self.stepper.save(self.run, self.optimizer, self.step, name, stopping, self.say)
        except SaveRefused:
            self.refused = self.step                      # the run does not try this very save again on its way out
            raise
        except KeyboardInterrupt as why:
            if Stop.of(why).saved == self.step:          # a stop held back until the save was complete
                self.done_saving(name)
            raise
        self.done_saving(name)
        return path

    def done_saving(self, name: str) -> None:
        """The save of the current step, as LoRA `name`, is complete: a stop keeps it."""
        self.saved, self.lora = self.step, self.run.files.lora(name)

    def after_save_note(self) -> str:
        """A stop just after the save of the current step: what this run trained is all on disk."""
        out, name = self.run.out, self.cfg.output_name
        if self.step == self.cfg.steps:
            return (f"\nstopped after the last step ({self.step}), once its LoRA was saved: {out} keeps "
                    f"{name}.safetensors and its checkpoint; the run is complete")
        return (f"\nstopped at step {self.step}, just after its save: {out} keeps the checkpoint and the LoRA of "
                f"step {self.step}; continue with {setting('resume', out)}")

    def partial_name(self) -> str:
        done = self.step == self.cfg.steps
        return f"{self.cfg.output_name}{'' if done else f'_step{self.step}'}.safetensors"

    def run_steps(self) -> TrainResult:
        cfg, stepper = self.cfg, self.stepper
        self.step = self.saved = self.run.start
        picks = validation_picks(self.run.items)
        try:
            with stepper.stop_guard():
                before = stepper.validation(self.features, picks)
                self.say(f"validation loss before: {before:.4f}")
                if self.samples and self.run.start == 0:
                    self.samples.take(0)                              # "before": the LoRA starts as a no-op
                self.train_steps()
                # the trained LoRA first: what follows (validation, the "after" sample) can only be lost
                lora_path = self.save(f"{cfg.output_name}.safetensors")
                peak = {d: round(torch.cuda.max_memory_allocated(d) / 2**30, 3) for d in stepper.devices}
                after = stepper.validation(self.features, picks)
                self.say(f"validation loss after {self.step} steps: {after:.4f}" +
                         "".join(f"; peak {d}: {g:.2f} GiB" for d, g in peak.items()))
                grid = None
                if self.samples:
                    self.samples.take(self.step)                     # "after"
                    grid = self.samples.before_after(self.step)
        except BaseException as why:
            self.stopped(Stop.of(why)).throw()
        return TrainResult(lora_path, self.step, self.losses, self.plan, self.features.hits, self.features.misses,
                           before, after, peak, self.samples.paths if self.samples else [], grid,
                           resumed_at=self.run.start)

    def stopped(self, stop: Stop) -> Stop:
        """The one way a run stops: Ctrl-C, SIGTERM, ComfyUI's Cancel, an error, or the stop every rank took
        together. Keep what the completed steps trained where the stepper can (not again when the error was
        this very save refused) and say what is kept, unless it was said; the Stop the run ends with."""
        if self.pending is not None:                 # a step applied, not read: logged, or known skipped
            with saving(self.say, self.step, stopping=True):     # (a second stop meanwhile: noted)
                try:
                    self.log_step()
                except NonFiniteStep as skipped:      # the run is back at the step before: said
                    self.say(str(skipped))
                except (Exception, KeyboardInterrupt):  # noqa: BLE001  (the device failed: the save says what it can)
                    pass
        told = stop.told
        if self.step > self.saved and self.stepper.can_save_after(stop.why) and self.refused != self.step:
            self.keep_completed_steps(say=not told)
            told = True
        elif self.step == self.saved > self.run.start and self.stepper.lead and not told:
            self.say(self.after_save_note())              # right after a save: all it trained is kept
            told = True
        return Stop(stop.why, self.saved, self.lora, told)

    def keep_completed_steps(self, say: bool) -> None:
        """Save the steps completed before the stop, and `say` so."""
        partial = self.save(self.partial_name(), stopping=True)
        if say:
            out = self.run.out
            self.say(f"\nstopped at step {self.step}: checkpoint and LoRA saved in {out}; "
                     f"continue with {setting('resume', out)}")
        if self.hooks.on_partial_lora and partial is not None:
            self.hooks.on_partial_lora(partial)

    def train_steps(self) -> None:
        """The optimizer steps from the run's start to cfg.steps, with periodic saves and samples. Where the engine
        and the optimizer allow (`Stepper.defers_readings`, `divergence.skips_on_device`), a step's loss and
        gradients' norm are read while the next step runs (the one host sync of a step then finds them there,
        and the GPU never waits for the host between steps); before a save or a sample, and after the last step,
        they are read at once."""
        cfg, stepper, optimizer, h = self.cfg, self.stepper, self.optimizer, self.hooks
        micro_batches = MicroBatches.of(self.spec, self.features, cfg)
        self.progress = Progress(cfg.steps, self.step) if stepper.lead else None
        for dev in stepper.devices:
            torch.cuda.reset_peak_memory_stats(dev)
        skip = optimizer if stepper.defers_readings and skips_on_device(optimizer) else None
        self.last_read = last_save = time.monotonic()
        while self.step < cfg.steps:
            t0 = time.monotonic()
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * lr_factor(cfg, self.step)
            if h.check_interrupt:
                h.check_interrupt()
            ks = [self.step * cfg.grad_accum + j for j in range(cfg.grad_accum)]
            loss = stepper.forward_backward(ks, self.features, micro_batches)
            if self.step + 1 < cfg.steps:         # the next step's inputs while the GPUs run this one
                stepper.prepare_inputs(ks[-1] + 1, self.features, micro_batches)
            self.read_step()                      # the step before, which the GPUs finished meanwhile
            reading = StepReading(self.step + 1, loss, stepper.params, cfg, skip)   # NaN or inf: never applied
            if cfg.max_grad_norm:
                stepper.clip(cfg.max_grad_norm, reading.norm)
            step = self.step + 1
            due = bool(cfg.save_every and step % cfg.save_every == 0) or \
                bool(cfg.save_every_minutes and time.monotonic() - last_save >= 60 * cfg.save_every_minutes)
            sample = bool(self.samples and step % cfg.sample_every == 0 and step < cfg.steps)
            with self.whole():                    # applied, counted and kept to be read, or none of them
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                self.step, self.pending = step, (reading, t0, due, optimizer.param_groups[0]["lr"])
            if skip is not None and not (due or sample or step == cfg.steps):
                continue
            if self.read_step() and self.step < cfg.steps:
                self.save(f"{cfg.output_name}_step{self.step}.safetensors")
                last_save = time.monotonic()
            if sample:
                self.samples.take(self.step)

    def read_step(self) -> bool:
        """Read the applied step still unread, if any: its loss logged and shown; NonFiniteStep where it was not
        finite (the optimizer skipped it on the device: the run is at the step before). Whether a save is due
        after it, as every process of the run agrees; a stop some process took is raised here, once logged."""
        if self.pending is None:
            return False
        with self.whole():                # read and logged whole (a Ctrl-C meanwhile: raised once it is)
            loss, due, stop = self.log_step()
        if stop is not None:              # a signal on some rank: every rank stops here, once the step is logged
            stop.throw()
        if self.step == self.run.start + 1 and compile_stats().graphs:      # what the first step compiled
            self.say(compile_stats().line())
        if self.hooks.on_step:
            self.hooks.on_step(self.step, self.cfg.steps, loss)
        return due

    def whole(self):
        """A block a stop does not cut: one held back meanwhile is raised once it is done. (Where steps are read
        late, in one process, a signal raises where it lands; a rank's signal only sets a flag, which `agree`
        reads, so there nothing is held.)"""
        return uninterrupted() if self.stepper.defers_readings else contextlib.nullcontext()

    def log_step(self) -> tuple[float, bool, Stop | None]:
        """The pending step read (waiting for the device if need be) and logged: (its loss, a save due, the stop
        every process takes), as `agree` says."""
        reading, t0, due, lr = self.pending
        try:
            loss = reading.read()
        except NonFiniteStep:
            self.pending, self.step = None, reading.step - 1
            raise
        self.pending = None
        loss, due, stop = self.stepper.agree(self.step, loss, due)
        self.losses.append(loss)
        now = time.monotonic()
        if self.stepper.lead:            # (a step read late: timed from the read before, which it ran after)
            self.record(loss, lr, now - max(t0, self.last_read))
            self.progress.update(self.step, loss)
        self.last_read = now
        return loss, due, stop

    def record(self, loss: float, lr: float, seconds: float) -> None:
        append_line(self.run.files.metrics, json.dumps({     # whole lines only, even on a full disk
            "step": self.step, "loss": loss, "lr": lr, "seconds": round(seconds, 4)}))

"""The run folder: opened before any work (an earlier run refused or replaced, a resume checked to
be the same run), and the saves into it (checkpoint and LoRA, never cut short by a signal)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ...folders import read_reason
from ...formats.atomic import atomic_path
from ...formats.lora_file import lora_metadata, save_lora
from ..batches import load_items
from ..cache import dataset_hash
from ...formats.fingerprint import weights_fingerprint
from .checkpoint import (SaveRefused, check_same_run, header_digest, latest_checkpoint, read_state, refused_kept,
                         remove_leftovers, save_checkpoint)
from ..config import TrainConfig
from ..errors import RunExists, TrainingError
from ..lr_schedule import resume_note
from ...compute.lora import LoraSet, lora_targets
from .layout import RunFolder
from ..stopping import saving
from ...wording import setting


class RunFinished(TrainingError):
    """A resume of a run that has trained all its steps: nothing is left to train."""


@dataclass
class OpenedRun:
    out: Path
    items: list
    data_hash: str
    identity: dict                 # what makes the run this run (`run_identity`)
    checkpoint: Path | None        # the checkpoint a resume continues from
    start: int                     # the first step to train (the checkpoint's step)
    inputs: dict = dataclasses.field(default_factory=dict)   # what the front end loaded the run from

    @property
    def files(self) -> RunFolder:
        return RunFolder(self.out)


def open_run(cfg: TrainConfig, spec, out: Path, resume: bool, overwrite: bool, log=print,
             inputs: dict | None = None) -> OpenedRun:
    """The run folder made ready and the run's data read, before any work: leftovers of an interrupted
    save removed; for `resume` the checkpoint to continue (only the same run), else the folder checked
    free of an earlier run (replaced only with `overwrite`). `inputs` (the files a front end loaded the
    encoders from, and the like) is recorded in every checkpoint, for a resume to load them again."""
    out.mkdir(parents=True, exist_ok=True)
    removed = remove_leftovers(out, cfg.cache_dir)
    if removed:
        log(f"removed {len(removed)} temporary file(s) an interrupted save left in {out}")
    items = load_items(cfg, spec, log)
    data_hash = dataset_hash(items)
    identity = run_identity(cfg, spec, data_hash)
    if resume:
        checkpoint, start = resume_point(out, cfg, identity, log)
    else:
        checkpoint, start = None, 0
        held = earlier_run(out, cfg)
        if held and not overwrite:
            raise RunExists(f"{out} holds an earlier run ({held}); continue it with {setting('resume', out)}, train "
                            f"into another folder, or replace it ({setting('overwrite')})")
        clear_earlier_run(out, cfg)                      # (what a run that never stepped left, or --overwrite)
        if held:
            log(f"replacing the earlier run in {out} (overwrite)")
    return OpenedRun(out, items, data_hash, identity, checkpoint, start, dict(inputs or {}))


def lora_shapes(cfg: TrainConfig, spec) -> dict[str, list[int]]:
    """Every adapter's [rank, in, out], from the model's description alone (before anything is built)."""
    shapes = {}
    for block in spec.blocks:
        for lin in block.linears:
            path = f"{block.path}.{lin.path}"
            if path in lora_targets([block.path], [(lin,)], tuple(cfg.targets)):
                shapes[path] = [cfg.rank, lin.in_features, lin.out_features]
    return shapes


def run_identity(cfg: TrainConfig, spec, data_hash: str) -> dict:
    """What makes a run this run, recorded in every checkpoint and compared on resume: the whole
    config, the dataset's content hash, the model (and its file's header digest), the LoRA's shapes."""
    return {"config": dataclasses.asdict(cfg), "dataset_hash": data_hash, "lora_shapes": lora_shapes(cfg, spec),
            "model": {"id": spec.id, "family": spec.family,
                      "header_digest": header_digest(cfg.model_file) if cfg.model_file else None,
                      "weights_fingerprint": weights_fingerprint(cfg.model_file) if cfg.model_file else None}}


def earlier_run(out: Path, cfg: TrainConfig) -> str | None:
    """What an earlier run trained into `out` (steps logged, a checkpoint, a LoRA), or None when it
    holds nothing trained (a fresh folder, or a run that stopped before its first step)."""
    metrics = RunFolder(out).metrics
    found = [f"metrics of {len(metrics.read_text().splitlines())} step(s)"] \
        if metrics.is_file() and metrics.stat().st_size else []
    checkpoint = latest_checkpoint(out)
    found += [f"checkpoint {checkpoint.name}"] if checkpoint else []
    found += [p.name for p in RunFolder(out).loras(cfg.output_name)]
    return ", ".join(found) or None


def clear_earlier_run(out: Path, cfg: TrainConfig) -> None:
    """--overwrite: remove an earlier run's files (the feature cache stays: it is keyed by content)."""
    run = RunFolder(out)
    for path in run.run_files():
        if not path.is_dir():
            path.unlink(missing_ok=True)
            continue
        for inside in path.iterdir():          # the folder stays: a link to another disk, or a mount point
            shutil.rmtree(inside) if inside.is_dir() and not inside.is_symlink() else inside.unlink()
    for path in run.loras(cfg.output_name):
        path.unlink()


def _records(out: Path) -> tuple[list[tuple[int, str]], str]:
    """(the (step, line) records metrics.jsonl holds, its last line dropped when a write was cut short
    there; what is wrong with it, or ''): a complete line that is not this engine's record, or steps
    out of order, mean the file was edited."""
    metrics = RunFolder(out).metrics
    if not metrics.is_file():
        return [], ""
    text = metrics.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")[:-1]                  # (after the last newline: '', or a line a write cut short)
    records: list[tuple[int, str]] = []
    for number, line in enumerate(lines, 1):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            step = None
        if not isinstance(step, int) or isinstance(step, bool) or (records and step <= records[-1][0]):
            return records, f"its line {number} is not a record of the step after the line before it"
        records.append((step, line))
    return records, ""


def check_metrics(out: Path, step: int, log) -> None:
    """Before a resume from the checkpoint of `step`: metrics.jsonl missing, cut short or holding only
    some of the steps is said (the checkpoint alone continues the run); an edited one is refused, with
    the command that moves it aside (it is never rewritten)."""
    metrics = RunFolder(out).metrics
    if not metrics.exists():
        log(f"note: {metrics} is missing, so the losses of steps 1..{step} are not recorded; the checkpoint "
            "alone continues the run")
        return
    try:
        records, problem = _records(out)
    except OSError as error:
        problem = f"it cannot be read ({read_reason(error)})"
    if problem:
        raise TrainingError(f"{setting('resume', out)}: metrics.jsonl is not as UGPUM writes it ({problem}), so it "
                            f"is not rewritten; move it aside (mv {metrics} {metrics}.old) and resume again: the "
                            "checkpoint alone continues the run")
    kept = [s for s, _ in records if s <= step]
    if kept != list(range(1, step + 1)):
        log(f"note: metrics.jsonl records {len(kept)} of the {step} steps of the checkpoint (cut short or "
            "partly lost); the checkpoint alone continues the run, and the missing steps' losses stay unrecorded")


def resume_point(out: Path, cfg: TrainConfig, identity: dict, log) -> tuple[Path, int]:
    """The checkpoint a resume continues from and its step, after checking it is this run's, holds only
    finite numbers and lies within the run's steps; metrics.jsonl is checked too (`check_metrics`)."""
    folder = latest_checkpoint(out, log, deep=True)       # (a damaged newer one is skipped, and said so)
    if folder is None:
        raise TrainingError(f"{setting('resume', out)}: no intact checkpoint in {RunFolder(out).checkpoints}; start a new run")
    state = read_state(folder)
    check_same_run(state.get("identity") or {}, identity, folder)
    step = state["step"]
    if step == cfg.steps and RunFolder(out).lora(f"{cfg.output_name}.safetensors").is_file():
        raise RunFinished(f"{setting('resume', out)}: the run is finished ({step} of {cfg.steps} steps trained, "
                          f"{cfg.output_name}.safetensors written); nothing is left to train: to train on, resume "
                          f"with a new total, {setting('steps', 2 * step)} for instance")
    if not 0 < step <= cfg.steps:
        more = f"; set {setting('steps')} above {step} to train on" if step > cfg.steps else ""
        raise TrainingError(f"{setting('resume', out)}: its checkpoint is at step {step}, outside this run's "
                            f"1..{cfg.steps}{more}")
    check_metrics(out, step, log)
    log(f"resumed from {folder} at step {step}")
    note = resume_note(cfg, ((state.get("identity") or {}).get("config") or {}).get("steps", cfg.steps), step)
    if note:
        log(note)                             # a changed total stretches the schedule: said, with both rates
    return folder, step


def keep_metrics_until(out: Path, step: int) -> None:
    """A resumed run trains the steps after its checkpoint again: their metrics lines go (and a last line
    a write cut short)."""
    metrics = RunFolder(out).metrics
    records = _records(out)[0]
    kept = [line for s, line in records if s <= step]
    with atomic_path(metrics) as tmp:                  # a full disk or a kill never leaves half of it
        tmp.write_text("".join(line + "\n" for line in kept))


def save_final_lora(cfg: TrainConfig, spec, lora: LoraSet, out: Path, steps: int, data_hash: str, name: str) -> Path:
    meta = lora_metadata(architecture=f"{spec.title}/lora", base_model=spec.id, title=cfg.output_name,
                         target_modules=sorted({path for path, _ in lora.items()}),
                         steps=steps, resolution=cfg.resolution, dataset_hash=data_hash, implementation="ugpum")
    tensors = {path: (a.A.detach().cpu(), a.B.detach().cpu()) for path, a in lora.items()}
    return save_lora(RunFolder(out).lora(name), tensors, cfg.rank, cfg.alpha, meta, dtype=torch.float32)


def save_run(run: OpenedRun, cfg: TrainConfig, spec, lora: LoraSet, optimizer, at: int, name: str,
             stopping: bool = False, log=print) -> Path:
    """A checkpoint and the LoRA at step `at`, neither cut short by a signal. A save the system refuses (a
    full disk, a file-size limit, a quota, a read-only disk, an I/O error) keeps what was saved before and
    says what is kept."""
    log(f"saving checkpoint and LoRA at step {at}")
    with saving(log, at, stopping):
        try:
            save_checkpoint(run.out, at, lora, optimizer, {"model": spec.id, "identity": run.identity,
                                                           "inputs": run.inputs, "interrupted": stopping})
        except SaveRefused as refused:           # the LoRA is smaller: keep it when it can be written
            lora_path = None
            with contextlib.suppress(SaveRefused):
                lora_path = save_final_lora(cfg, spec, lora, run.out, at, run.data_hash, name)
            raise refused_kept(refused, run.out, at, lora_path) from None
        try:
            return save_final_lora(cfg, spec, lora, run.out, at, run.data_hash, name)
        except SaveRefused as refused:
            raise refused_kept(refused, run.out, at, None) from None

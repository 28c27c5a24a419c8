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

from ..formats.atomic import atomic_path
from ..formats.lora_file import lora_metadata, save_lora
from .batches import load_items
from .cache import dataset_hash
from ..formats.fingerprint import weights_fingerprint
from .checkpoint import (DiskFull, check_same_run, disk_full, full_disk_kept, header_digest, latest_checkpoint,
                         remove_leftovers, save_checkpoint)
from .config import TrainConfig
from .errors import RunExists, TrainingError
from ..lora import LoraSet, lora_targets
from .stopping import saving

RUN_FILES = ("metrics.jsonl", "checkpoints", "plan.json", "samples")


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


def open_run(cfg: TrainConfig, spec, out: Path, resume: bool, overwrite: bool, log=print) -> OpenedRun:
    """The run folder made ready and the run's data read, before any work: leftovers of an interrupted
    save removed; for `resume` the checkpoint to continue (only the same run), else the folder checked
    free of an earlier run (replaced only with `overwrite`)."""
    out.mkdir(parents=True, exist_ok=True)
    removed = remove_leftovers(out, cfg.cache_dir)
    if removed:
        log(f"removed {len(removed)} temporary file(s) an interrupted save left in {out}")
    items = load_items(cfg, log)
    data_hash = dataset_hash(items)
    identity = run_identity(cfg, spec, data_hash)
    if resume:
        checkpoint, start = resume_point(out, cfg, identity, log)
    else:
        checkpoint, start = None, 0
        held = earlier_run(out, cfg)
        if held and not overwrite:
            raise RunExists(f"{out} holds an earlier run ({held}); continue it with --resume {out}, train into "
                            "another folder, or pass --overwrite to replace it")
        clear_earlier_run(out, cfg)                      # (what a run that never stepped left, or --overwrite)
        if held:
            log(f"replacing the earlier run in {out} (overwrite)")
    return OpenedRun(out, items, data_hash, identity, checkpoint, start)


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
    metrics = out / "metrics.jsonl"
    found = [f"metrics of {len(metrics.read_text().splitlines())} step(s)"] \
        if metrics.is_file() and metrics.stat().st_size else []
    checkpoint = latest_checkpoint(out)
    found += [f"checkpoint {checkpoint.name}"] if checkpoint else []
    found += sorted(p.name for p in out.glob(f"{cfg.output_name}*.safetensors"))
    return ", ".join(found) or None


def clear_earlier_run(out: Path, cfg: TrainConfig) -> None:
    """--overwrite: remove an earlier run's files (the feature cache stays: it is keyed by content)."""
    for name in RUN_FILES:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    for path in out.glob(f"{cfg.output_name}*.safetensors"):
        path.unlink()


def logged_steps(out: Path) -> list[int] | None:
    """The steps metrics.jsonl records, in order; None when it cannot be read as this engine writes it."""
    metrics = out / "metrics.jsonl"
    try:
        return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    except (ValueError, KeyError, TypeError):
        return None


def resume_point(out: Path, cfg: TrainConfig, identity: dict, log) -> tuple[Path, int]:
    """The checkpoint a resume continues from and its step, after checking it is this run's, lies
    within the run's steps and agrees with the metrics; a sentence otherwise."""
    folder = latest_checkpoint(out, log)                  # (a damaged newer one is skipped, and said so)
    if folder is None:
        raise TrainingError(f"--resume {out}: no intact checkpoint in {out / 'checkpoints'}; start a new run")
    state = json.loads((folder / "state.json").read_text())
    check_same_run(state.get("identity") or {}, identity, folder)
    step = state["step"]
    if step == cfg.steps and (out / f"{cfg.output_name}.safetensors").is_file():
        raise RunFinished(f"--resume {out}: the run is finished ({step} of {cfg.steps} steps trained, "
                          f"{cfg.output_name}.safetensors written); nothing is left to train: to train longer, "
                          f"resume with more steps (--steps {2 * step})")
    if not 0 < step <= cfg.steps:
        more = f"; set steps above {step} to train on" if step > cfg.steps else ""
        raise TrainingError(f"--resume {out}: its checkpoint is at step {step}, outside this run's 1..{cfg.steps}{more}")
    logged = logged_steps(out)
    if logged is None or logged[:step] != list(range(1, step + 1)):
        raise TrainingError(f"--resume {out}: metrics.jsonl does not record steps 1..{step} of its checkpoint "
                            "(edited or from another run); it cannot be trusted: start a new run in another folder")
    log(f"resumed from {folder} at step {step}")
    return folder, step


def keep_metrics_until(out: Path, step: int) -> None:
    """A resumed run trains the steps after its checkpoint again: their metrics lines go."""
    metrics = out / "metrics.jsonl"
    kept = metrics.read_text().splitlines()[:step] if metrics.is_file() else []
    with atomic_path(metrics) as tmp:                  # a full disk or a kill never leaves half of it
        tmp.write_text("".join(line + "\n" for line in kept))


def save_final_lora(cfg: TrainConfig, spec, lora: LoraSet, out: Path, steps: int, data_hash: str, name: str) -> Path:
    meta = lora_metadata(architecture=f"{spec.title}/lora", base_model=spec.id, title=cfg.output_name,
                         target_modules=sorted({path for path, _ in lora.items()}),
                         steps=steps, resolution=cfg.resolution, dataset_hash=data_hash, implementation="ugpum")
    tensors = {path: (a.A.detach().cpu(), a.B.detach().cpu()) for path, a in lora.items()}
    try:
        return save_lora(out / name, tensors, cfg.rank, cfg.alpha, meta, dtype=torch.float32)
    except Exception as err:
        full = disk_full(err, f"the LoRA {name}", out, sum(a.A.numel() + a.B.numel() for _, a in lora.items()) * 4)
        if full is err:
            raise
        raise full from err


def save_run(run: OpenedRun, cfg: TrainConfig, spec, lora: LoraSet, optimizer, at: int, name: str,
             stopping: bool = False, log=print) -> Path:
    """A checkpoint and the LoRA at step `at`, neither cut short by a signal."""
    log(f"saving checkpoint and LoRA at step {at}")
    with saving(log, stopping):
        try:
            save_checkpoint(run.out, at, lora, optimizer, {"model": spec.id, "identity": run.identity,
                                                           "interrupted": stopping})
        except DiskFull as full:                 # the LoRA is smaller: keep it when it fits, say what is kept
            lora_path = None
            with contextlib.suppress(DiskFull):
                lora_path = save_final_lora(cfg, spec, lora, run.out, at, run.data_hash, name)
            raise full_disk_kept(full, run.out, at, lora_path) from full
        try:
            return save_final_lora(cfg, spec, lora, run.out, at, run.data_hash, name)
        except DiskFull as full:
            raise full_disk_kept(full, run.out, at, None) from full

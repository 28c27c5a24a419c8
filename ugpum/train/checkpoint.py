"""Training state on disk: LoRA, optimizer state and step, written atomically; exact resume.

Layout: <out>/checkpoints/step_000040/{lora.safetensors, optimizer.safetensors, state.json} and
<out>/checkpoints/latest.json naming the newest complete one. A checkpoint folder is written under a
temporary name and renamed, so an interruption never leaves a half-written checkpoint in use; the
pointer is a convenience: a resume finds the newest complete folder without it (`latest_checkpoint`).
Randomness needs no saved state: every step draws from generators seeded by (seed, step).

state.json also records the run's identity (`run_identity`): its whole TrainConfig, the dataset's
content hash, the model file's header digest and the LoRA's shapes. A resume compares them
(`check_same_run`) and continues only the same run.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..formats.atomic import honour_umask, write_json_atomic
from .lora import LoraSet

LATEST = "latest.json"


class CheckpointError(ValueError):
    pass


class DiskFull(OSError):
    """No space left for a checkpoint or a LoRA; the message says how much is needed."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = errno.ENOSPC


# Settings that may change between a run and its resume: how long, how it is watched and saved,
# where it runs. Every other TrainConfig field changes what is trained.
MAY_CHANGE = frozenset({"steps", "sample_every", "sample_prompt", "sample_steps", "sample_seed", "sample_guidance",
                        "save_every", "save_every_minutes", "output_name", "cache_dir", "devices", "schedule",
                        "checkpointing", "dataset", "dataset_root", "model_file"})
# compared through the dataset's content hash and the model file's header digest instead of paths


def header_digest(path: str | Path) -> str:
    """sha256 of a safetensors file's header (names, shapes, dtypes, offsets): which model file it is,
    without reading its weights."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return hashlib.sha256(f.read(min(length, 100 * 2**20))).hexdigest()


def check_same_run(saved: dict, now: dict, folder: Path) -> None:
    """Refuse a resume whose settings, data, model or LoRA differ from the checkpoint's run, naming
    what differs; allow what may change (more steps, samples, devices)."""
    if not saved:
        raise CheckpointError(f"{folder}: the checkpoint records no run identity (written by an older UGPUM), "
                              "so it cannot be checked; start a new run in another folder")
    different = [f"{name} ({saved['config'].get(name)!r} in the checkpoint, {value!r} now)"
                 for name, value in now["config"].items()
                 if name not in MAY_CHANGE and saved["config"].get(name, value) != value]
    for name, key in (("model", "id"), ("model file", "header_digest")):
        if saved["model"].get(key) != now["model"].get(key):
            different.append(f"{name} ({saved['model'].get(key)} in the checkpoint, {now['model'].get(key)} now)")
    if saved["dataset_hash"] != now["dataset_hash"]:
        different.append("dataset (its images, clips or captions changed)")
    if not different and saved["lora_shapes"] != now["lora_shapes"]:
        different.append("LoRA shapes (targets or rank)")
    if different:
        raise CheckpointError(f"{folder.parent.parent}: cannot resume: this run was trained with other "
                              f"settings: {'; '.join(different)}; resume with the run's settings, or start a "
                              "new run in another folder")


def _params(lora: LoraSet) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"{path}.{name}", p) for path, a in lora.items() for name, p in (("A", a.A), ("B", a.B))]


def checkpoint_bytes(lora: LoraSet, optimizer: torch.optim.Optimizer) -> int:
    """About what one checkpoint takes on disk: the LoRA plus the optimizer's state."""
    weights = sum(p.numel() * p.element_size() for _, p in _params(lora))
    state = sum(torch.as_tensor(v).numel() * torch.as_tensor(v).element_size()
                for st in optimizer.state.values() for v in st.values())
    return weights + (state or 2 * weights)            # before the first step: AdamW's two moments


FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(err: Exception, what: str, folder: Path, needed: int) -> Exception:
    """A full disk (ENOSPC/EDQUOT, also as safetensors reports it) as one sentence with the space
    needed; other errors as they are."""
    full = getattr(err, "errno", None) in FULL or any(f"os error {n})" in str(err) for n in FULL)
    if not full:
        return err
    free = shutil.disk_usage(folder).free if folder.exists() else 0
    return DiskFull(f"no space left on the disk holding {folder} for {what}: it needs about "
                               f"{needed / 2**20:.0f} MiB and {free / 2**20:.0f} MiB are free; free some space "
                               "and resume the run (what was trained is kept in its last complete checkpoint)")


def save_checkpoint(out: Path, step: int, lora: LoraSet, optimizer: torch.optim.Optimizer, extra: dict) -> Path:
    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write_checkpoint(tmp, final, step, lora, optimizer, extra)
    except Exception as err:                  # safetensors reports a full disk as its own error type
        shutil.rmtree(tmp, ignore_errors=True)
        full = disk_full(err, f"the checkpoint at step {step}", root, checkpoint_bytes(lora, optimizer))
        if full is err:
            raise
        raise full from err
    write_json_atomic(root / LATEST, {"step": step, "folder": final.name})
    return final


def _write_checkpoint(tmp: Path, final: Path, step: int, lora: LoraSet, optimizer: torch.optim.Optimizer,
                      extra: dict) -> None:
    try:
        params = _params(lora)
        save_file({name: p.detach().cpu().contiguous() for name, p in params}, str(tmp / "lora.safetensors"))
        index = {id(p): name for name, p in params}
        opt_tensors = {}
        for p, state in optimizer.state.items():
            for k, v in state.items():
                # a copy each: optimizers may share a tensor between parameters (bitsandbytes' qmaps),
                # which safetensors refuses to write
                opt_tensors[f"{index[id(p)]}::{k}"] = torch.as_tensor(v).detach().to("cpu", copy=True).contiguous()
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        (tmp / "state.json").write_text(json.dumps({"step": step, "param_groups": groups, **extra}, indent=1))
        honour_umask(tmp / "lora.safetensors", tmp / "optimizer.safetensors")     # safetensors writes 0600
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


CHECKPOINT_FILES = ("lora.safetensors", "optimizer.safetensors", "state.json")


def _complete_step(folder: Path) -> int | None:
    """The step of a complete checkpoint folder (all its files, a readable state.json), else None."""
    try:
        if not all((folder / name).is_file() for name in CHECKPOINT_FILES):
            return None
        step = json.loads((folder / "state.json").read_text())["step"]
        return step if isinstance(step, int) and folder.name == f"step_{step:06d}" else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint of a run folder: the one latest.json names, or, when that
    pointer is missing, corrupt or stale, the complete step_* folder of the highest step."""
    root = Path(out) / "checkpoints"
    try:
        named = root / json.loads((root / LATEST).read_text())["folder"]
        if _complete_step(named) is not None and named.parent == root:
            newer = [f for f in root.glob("step_*") if (_complete_step(f) or 0) > _complete_step(named)]
            if not newer:
                return named
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = [(step, f) for f in root.glob("step_*") if (step := _complete_step(f)) is not None]
    return max(found)[1] if found else None


def remove_leftovers(out: Path) -> list[Path]:
    """Delete what an interrupted save left behind (temporary checkpoint folders and atomic-write
    temporaries) in a run folder; returns what was removed."""
    out = Path(out)
    gone = [p for p in (out / "checkpoints").glob(".tmp_step_*")] + \
        [p for folder in (out, out / "checkpoints", out / "samples") for p in folder.glob(".*.tmp")]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return gone


def load_checkpoint(folder: Path, lora: LoraSet, optimizer: torch.optim.Optimizer) -> dict:
    """Restore LoRA weights and optimizer state in place; returns state.json's content."""
    try:
        state = json.loads((folder / "state.json").read_text())
        weights = load_file(str(folder / "lora.safetensors"))
        opt = load_file(str(folder / "optimizer.safetensors"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: cannot read the checkpoint ({e})") from None
    params = _params(lora)
    if set(weights) != {name for name, _ in params} or any(weights[n].shape != p.shape for n, p in params):
        raise CheckpointError(f"{folder}: its LoRA does not match this run's (other model, rank or targets)")
    with torch.no_grad():
        for name, p in params:
            p.copy_(weights[name].to(p.device, p.dtype))
    by_name = dict(params)
    for key, value in opt.items():
        name, _, k = key.partition("::")
        p = by_name[name]
        optimizer.state[p][k] = value.to(p.device) if value.dim() else value.clone()
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        group.update(saved)
    return state

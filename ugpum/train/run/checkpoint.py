"""Training state on disk: LoRA, optimizer state and step, written atomically; exact resume.

Layout: <out>/checkpoints/step_000040/{lora.safetensors, optimizer.safetensors, state.json} and
<out>/checkpoints/latest.json naming the newest complete one. A checkpoint folder is written under a
temporary name and renamed, so an interruption never leaves a half-written checkpoint in use; the
pointer is a convenience: a resume finds the newest complete folder without it (`latest_checkpoint`).
Randomness needs no saved state: every step draws from generators seeded by (seed, step).

state.json also records the run's identity (`run_identity`): its whole TrainConfig, the dataset's
content hash, the model file's header digest and weights fingerprint, and the LoRA's shapes. A resume
compares them (`check_same_run`) and continues only the same run.

A checkpoint is never written with a NaN or an infinity in it, nor started on a disk it cannot fit on;
a resume skips a damaged checkpoint (a file cut short or emptied) for the newest intact one before it,
saying so (`usable_checkpoint`).
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
from safetensors.torch import load_file

from ...formats.atomic import remove_abandoned, write_json_atomic
from ...formats.disk_space import DiskFull, check_space, raise_refused
from ...formats.refused import SaveRefused
from ...formats.safetensors_writer import write_tensors
from ...formats.finite import NonFinite, non_finite, shown
from ...formats.safetensors_header import HeaderError, check_file
from ...compute.lora import LoraSet
from ..cache import FeatureCache
from .layout import RunFolder
from ...wording import EngineError, setting

LATEST = "latest.json"
CHECKPOINT_FILES = ("lora.safetensors", "optimizer.safetensors", "state.json")


class CheckpointError(ValueError, EngineError):
    pass


__all__ = ["DiskFull", "NonFinite", "SaveRefused"]       # (re-exported: what a save here raises)


# Settings that may change between a run and its resume: how long, how it is watched and saved,
# where it runs, which blocks recompute in backward (the same gradients). Every other TrainConfig field
# changes what is trained.
MAY_CHANGE = frozenset({"steps", "sample_every", "sample_prompt", "sample_steps", "sample_seed", "sample_guidance",
                        "save_every", "save_every_minutes", "output_name", "cache_dir", "devices", "schedule",
                        "recompute", "replicas", "dataset", "dataset_root", "model_file", "desktop_gib"})
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
    for name, key in (("model", "id"), ("model file", "header_digest"), ("base weights", "weights_fingerprint")):
        if key == "weights_fingerprint" and key not in saved["model"]:
            continue                       # (a checkpoint from before fingerprints: its header digest decides)
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


def refused_kept(refused: SaveRefused, out: Path, at: int, lora_path: Path | None) -> SaveRefused:
    """`refused` (the system refused a save at step `at`: a full disk, a file-size limit, a quota, a
    read-only disk, an I/O error) with what is on disk after it, truly: the LoRA of that step when it was
    saved, the newest intact checkpoint (which a resume continues from), or none."""
    if refused.errno == errno.EIO:             # the disk cannot be read either: claim nothing about it
        return SaveRefused(f"{refused}; what was saved before stays on that disk, which cannot be read now: once "
                           f"it can, {setting('resume', out)} continues from its newest intact checkpoint", errno.EIO)
    checkpoint = latest_checkpoint(out)
    kept = [f"the LoRA of step {at} ({lora_path.name})"] if lora_path else []
    kept += [f"the checkpoint {checkpoint.name}, which {setting('resume', out)} continues from"] if checkpoint else []
    said = ("kept: " + " and ".join(kept) + "; ") if kept else ""
    said += "" if checkpoint else "no checkpoint of this run is on disk, so a resume cannot continue it"
    message = f"{refused}; {said.removesuffix('; ')}"
    return DiskFull(message) if isinstance(refused, DiskFull) else SaveRefused(message, refused.errno)


def check_finite_lora(lora: LoraSet, what: str) -> None:
    """Refuse to save a LoRA holding a NaN or an infinity (the last good save stays as it is)."""
    bad = non_finite((name, p.detach()) for name, p in _params(lora))
    if bad:
        raise NonFinite(f"{what}: not saved, the LoRA holds NaN or infinite values ({shown(bad)}); training "
                        "diverged: lower lr or turn on gradient clipping (max_grad_norm), and resume from the "
                        "last good checkpoint")


def save_checkpoint(out: Path, step: int, lora: LoraSet, optimizer: torch.optim.Optimizer, extra: dict,
                    kept: str | None = None) -> Path:
    """Write the checkpoint of step `step` (never one with non-finite values, never one the disk cannot
    hold: DiskFull says how much it needs, how much is free, and `kept`; a write the system refuses
    otherwise is a SaveRefused naming the file). Nothing of it is left when it fails."""
    root = RunFolder(out).checkpoints
    what = f"the checkpoint at step {step}"
    check_finite_lora(lora, what)
    if non_finite((k, torch.as_tensor(v)) for st in optimizer.state.values() for k, v in st.items()):
        raise NonFinite(f"{what}: not saved, the optimizer's state holds NaN or infinite values; training "
                        "diverged: lower lr or turn on gradient clipping (max_grad_norm), and resume from the last "
                        "good checkpoint")
    root.mkdir(parents=True, exist_ok=True)
    needed = checkpoint_bytes(lora, optimizer)
    check_space(root, needed, what, kept)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    writing: list[str] = []                   # what is being written: named in a refusal's sentence
    try:
        tmp.mkdir()
        _write_checkpoint(tmp, final, step, lora, optimizer, extra, writing)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        named = f"{final.name}/{writing[-1]}" if writing else final.name
        raise_refused(err, root, f"{what} ({named})", needed, kept)
    try:
        write_json_atomic(root / LATEST, {"step": step, "folder": final.name})
    except OSError:
        pass                                  # a convenience: a resume finds the newest folder without it
    return final


def _write_checkpoint(tmp: Path, final: Path, step: int, lora: LoraSet, optimizer: torch.optim.Optimizer,
                      extra: dict, writing: list[str]) -> None:
    try:
        params = _params(lora)
        writing.append(CHECKPOINT_FILES[0])                       # (atomic=False: tmp is a temporary folder)
        write_tensors(tmp / CHECKPOINT_FILES[0], {name: p for name, p in params}, atomic=False)
        index = {id(p): name for name, p in params}
        opt_tensors = {}
        for p, state in optimizer.state.items():
            for k, v in state.items():
                # a copy each: optimizers may share a tensor between parameters (bitsandbytes' qmaps),
                # which safetensors refuses to write
                opt_tensors[f"{index[id(p)]}::{k}"] = torch.as_tensor(v).detach().to("cpu", copy=True).contiguous()
        writing.append(CHECKPOINT_FILES[1])
        write_tensors(tmp / CHECKPOINT_FILES[1], opt_tensors, atomic=False)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        writing.append(CHECKPOINT_FILES[2])
        (tmp / "state.json").write_text(json.dumps({"step": step, "param_groups": groups, **extra}, indent=1))
        for name in CHECKPOINT_FILES:
            writing.append(name)
            with open(tmp / name, "rb") as handle:                 # on disk before the folder takes its name
                os.fsync(handle.fileno())
        writing.clear()                                            # (now the folder itself)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_state(folder: Path) -> dict:
    """A checkpoint's state.json: its step, the optimizer's param groups, the run's identity and inputs."""
    return json.loads((folder / CHECKPOINT_FILES[2]).read_text())
# Optimizer state shaped as its parameter (AdamW's moments, SGD's momentum, bitsandbytes' 8-bit states).
SHAPED_AS_PARAMETER = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "state1", "state2"})


def state_mismatch(lora: dict[str, tuple[int, ...]], optimizer: dict[str, tuple[int, ...]]) -> str | None:
    """What makes an optimizer state (name::key -> shape) not the state of a LoRA (name -> shape), or None:
    a state for a tensor the LoRA has not, or a moment of another shape (another rank or other targets)."""
    for key, shape in optimizer.items():
        name, _, k = key.partition("::")
        if name not in lora:
            return f"optimizer.safetensors holds the state of {name}, which the LoRA has not (it is another run's)"
        if k in SHAPED_AS_PARAMETER and tuple(shape) != tuple(lora[name]):
            return (f"optimizer.safetensors does not fit the LoRA ({k} of {name} is {list(shape)}, the LoRA's "
                    f"{list(lora[name])}: it is the state of a run of another rank or other targets)")
    return None


def damage(folder: Path, deep: bool = False) -> str | None:
    """What makes a checkpoint folder unusable (a file missing, empty, cut short or damaged; state.json
    unreadable or of another step; an optimizer state that is not the LoRA's; with `deep`, a NaN or an
    infinity in its tensors), or None for an intact one. Without `deep`: headers and sizes, no weights."""
    for name in CHECKPOINT_FILES:
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size == 0:
            return f"{name} is empty"
    try:
        step = read_state(folder)["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return "state.json is damaged"
    if not isinstance(step, int) or folder.name != f"step_{step:06d}":
        return f"state.json names step {step!r}, not this folder's"
    headers = {}
    for name in CHECKPOINT_FILES[:2]:
        try:
            headers[name] = check_file(folder / name)
        except (HeaderError, OSError):
            return f"{name} is cut short or damaged"
    mismatch = state_mismatch(headers["lora.safetensors"].shapes(), headers["optimizer.safetensors"].shapes())
    return mismatch or (_non_finite_files(folder) if deep else None)


def _non_finite_files(folder: Path) -> str | None:
    """Which checkpoint file holds a NaN or an infinity (naming the tensors), or None."""
    for name in CHECKPOINT_FILES[:2]:
        try:
            bad = non_finite(load_file(str(folder / name)).items())
        except Exception:  # noqa: BLE001 - safetensors' own error type: the file changed since its header was read
            return f"{name} is cut short or damaged"
        if bad:
            return f"{name} holds NaN or infinite values ({shown(bad)})"
    return None


def _folder_step(folder: Path) -> int | None:
    digits = folder.name.removeprefix("step_")
    return int(digits) if folder.name.startswith("step_") and digits.isdigit() else None


def latest_checkpoint(out: Path, log=None, deep: bool = False) -> Path | None:
    """The newest intact checkpoint of a run folder (latest.json is a convenience: a pointer missing,
    corrupt or stale changes nothing). A newer one that is damaged is skipped; `log`, when given, hears
    which and why, so a fallback is never silent. `deep` (a resume): its tensors read, and one holding
    a NaN or an infinity skipped as well."""
    root = RunFolder(out).checkpoints
    folders = sorted(((step, f) for f in root.glob("step_*") if (step := _folder_step(f)) is not None
                      and f.is_dir()), reverse=True)
    skipped = []
    for _, folder in folders:
        problem = damage(folder, deep)
        if problem is None:
            if skipped and log:
                log(f"checkpoint{'s' if len(skipped) > 1 else ''} {'; '.join(skipped)}: continuing from the "
                    f"newest intact one, {folder.name}, instead")
            return folder
        skipped.append(f"{folder.name} cannot be used ({problem})")
    if skipped and log:
        log(f"checkpoint{'s' if len(skipped) > 1 else ''} {'; '.join(skipped)}")
    return None


def remove_leftovers(out: Path, cache_dir: str | Path | None = None) -> list[Path]:
    """Delete what an interrupted save left behind (temporary checkpoint folders, and atomic-write
    temporaries whose writer is gone) in a run folder, its samples and feature cache (`cache_dir`
    when the cache lives elsewhere); returns what was removed."""
    run = RunFolder(out, cache_dir)
    folders = run.written_folders()
    for cache in {RunFolder(out).cache, run.cache}:
        folders += [cache / kind for kind in FeatureCache.KINDS]
    gone = list(run.checkpoints.glob(".tmp_step_*"))
    for p in gone:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return gone + [p for folder in folders for p in remove_abandoned(folder)]


def load_checkpoint(folder: Path, lora: LoraSet, optimizer: torch.optim.Optimizer) -> dict:
    """Restore LoRA weights and optimizer state in place; returns state.json's content."""
    problem = damage(folder)
    if problem:
        raise CheckpointError(f"{folder}: cannot resume from it: {problem}")
    try:
        state = read_state(folder)
        weights = load_file(str(folder / "lora.safetensors"))
        opt = load_file(str(folder / "optimizer.safetensors"))
    except Exception as e:  # noqa: BLE001 - safetensors' own error type too (a file changed since `damage`)
        raise CheckpointError(f"{folder}: cannot read the checkpoint ({e}); resume again to fall back to "
                              "the checkpoint before it") from None
    params = _params(lora)
    if set(weights) != {name for name, _ in params} or any(weights[n].shape != p.shape for n, p in params):
        raise CheckpointError(f"{folder}: its LoRA does not match this run's (other model, rank or targets)")
    mismatch = state_mismatch({n: tuple(p.shape) for n, p in params}, {k: tuple(v.shape) for k, v in opt.items()})
    if mismatch:
        raise CheckpointError(f"{folder}: cannot resume from it: {mismatch}; resume again to fall back to the "
                              "checkpoint before it, or start a new run")
    with torch.no_grad():
        for name, p in params:
            p.copy_(weights[name].to(p.device, p.dtype))
    by_name, states = dict(params), {}
    for key, value in opt.items():
        name, _, k = key.partition("::")
        states.setdefault(by_name[name], {})[k] = value
    restore_optimizer(optimizer, states, state["param_groups"])
    return state


# How an optimizer computes, not what it trains: a checkpoint written with one way resumes with another (the
# run keeps its own: `make_optimizer` takes the fused kernel where torch has it; checkpoints before it had none).
_HOW = ("fused", "foreach", "capturable", "differentiable")


def restore_optimizer(optimizer: torch.optim.Optimizer, states: dict, saved_groups: list[dict]) -> None:
    """The saved param groups' settings and each parameter's saved state (`states`: parameter -> its state)
    into `optimizer`, every tensor where it keeps them: on the parameter's device, and the step count
    there too where it is fused or capturable (elsewhere on the host, as torch keeps it)."""
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k not in _HOW})
        steps_on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            if p in states:
                optimizer.state[p] = {k: v.to(p.device) if v.dim() or steps_on_device else v.clone()
                                      for k, v in states[p].items()}

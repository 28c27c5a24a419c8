"""Training state on disk: LoRA, optimizer state and step, written atomically; exact resume.

Layout: <out>/checkpoints/step_000040/{lora.safetensors, optimizer.safetensors, state.json} and
<out>/checkpoints/latest.json naming the newest complete one. A checkpoint folder is written under a
temporary name and renamed, so an interruption never leaves a half-written checkpoint in use.
Randomness needs no saved state: every step draws from generators seeded by (seed, step).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..formats.atomic import write_json_atomic
from .lora import LoraSet

LATEST = "latest.json"


class CheckpointError(ValueError):
    pass


def _params(lora: LoraSet) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"{path}.{name}", p) for path, a in lora.items() for name, p in (("A", a.A), ("B", a.B))]


def save_checkpoint(out: Path, step: int, lora: LoraSet, optimizer: torch.optim.Optimizer, extra: dict) -> Path:
    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
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
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_json_atomic(root / LATEST, {"step": step, "folder": final.name})
    return final


def latest_checkpoint(out: Path) -> Path | None:
    pointer = Path(out) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    folder = pointer.parent / json.loads(pointer.read_text())["folder"]
    return folder if (folder / "state.json").is_file() else None


def load_checkpoint(folder: Path, lora: LoraSet, optimizer: torch.optim.Optimizer) -> dict:
    """Restore LoRA weights and optimizer state in place; returns state.json's content."""
    try:
        state = json.loads((folder / "state.json").read_text())
        weights = load_file(str(folder / "lora.safetensors"))
        opt = load_file(str(folder / "optimizer.safetensors"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: cannot read the checkpoint ({e})") from None
    params = _params(lora)
    if set(weights) != {name for name, _ in params}:
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

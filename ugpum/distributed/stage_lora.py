"""The LoRA of a rank's stages, initialised exactly as the single process initialises the whole
model's, and the whole LoRA on the rank that saves it."""
from __future__ import annotations

import torch
from torch import nn

from ..compute.lora import LoraAdapter, LoraSet, lora_targets
from ..train.config import TrainConfig
from ..train.prepare import make_optimizer
from .stages import StageRange


def _targets(cfg: TrainConfig, spec) -> list[tuple[str, int, int, int]]:
    """(path, block index, in, out) of every LoRA target, in attach_lora's order."""
    out = []
    for i, block in enumerate(spec.blocks):
        for lin in block.linears:
            for path in lora_targets([block.path], [(lin,)], tuple(cfg.targets)):
                out.append((path, i, lin.in_features, lin.out_features))
    return out


def stage_lora(model: nn.Module, cfg: TrainConfig, spec, ranges: StageRange | list[StageRange]) -> LoraSet:
    """The adapters of the blocks of a rank's stage(s), initialised exactly as `attach_lora` initialises
    them on the whole model (one generator drawn in target order: the other stages' draws are made
    and dropped)."""
    ranges = [ranges] if isinstance(ranges, StageRange) else list(ranges)
    for p in model.parameters():
        p.requires_grad_(False)
    lora = LoraSet()
    g = torch.Generator().manual_seed(cfg.seed)
    for path, i, fan_in, fan_out in _targets(cfg, spec):
        if any(r.start <= i < r.end for r in ranges):
            lora.add(model, path, cfg.rank, cfg.alpha, torch.float32, g)
        else:
            LoraAdapter(fan_in, fan_out, cfg.rank, cfg.alpha, torch.device("meta"), torch.float32, g)
    return lora


def stage_adapters(lora: LoraSet, cfg: TrainConfig, spec, rng: StageRange) -> list[LoraAdapter]:
    """The adapters of `lora` on the blocks of stage `rng`."""
    block = {path: i for path, i, _, _ in _targets(cfg, spec)}
    return [a for path, a in lora.items() if rng.start <= block[path] < rng.end]


def lora_params(lora: LoraSet) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) as checkpoints name them: '<linear path>.A' / '.B'."""
    return [(f"{path}.{name}", p) for path, a in lora.items() for name, p in (("A", a.A), ("B", a.B))]


def full_lora(cfg: TrainConfig, spec) -> tuple[LoraSet, torch.optim.Optimizer]:
    """Every adapter of the model on the CPU (no model: a skeleton of Linears on meta carries the
    paths) and an optimizer over them: what rank 0 saves and reads checkpoints and LoRA files with."""
    skeleton = nn.Module()
    lora = LoraSet()
    for path, _, fan_in, fan_out in _targets(cfg, spec):
        parent = skeleton
        for part in path.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(path.rsplit(".", 1)[1], nn.Linear(fan_in, fan_out, bias=False, device="meta"))
        lora.add(skeleton, path, cfg.rank, cfg.alpha)
    lora.remove()                                         # no forward ever runs through the skeleton
    lora.to_empty(device="cpu")
    with torch.no_grad():
        for _, p in lora_params(lora):
            p.zero_()
    return lora, make_optimizer(cfg, [p for _, p in lora_params(lora)])

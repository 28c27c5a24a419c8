"""A rank's pipeline stages: which blocks each stage runs (`stage_ranges`), the family's stage module
for a range (`stage_module`; the glue itself lives with the family, ugpum/arch/<family>/stage.py, and
ugpum/arch/stage.py says what a stage is), and a model cut down to what a rank's stages run
(`keep_only`), so a rank loads, streams and holds only its share."""
from __future__ import annotations

from torch import nn

from ..arch.stage import Stage, StageRange


def stage_ranges(bounds: list[tuple[int, int]]) -> list[StageRange]:
    """StageRanges from consecutive [start, end) block ranges."""
    return [StageRange(a, b, i == 0, i == len(bounds) - 1) for i, (a, b) in enumerate(bounds)]


def stage_module(model: nn.Module, spec, rng: StageRange, autocast: bool = False, weight_dtype: str = "fp32") -> Stage:
    """The stage module of `spec`'s family for blocks `rng` of `model` (autocast as `ugpum.compute.dtypes.bf16_autocast`)."""
    return spec.stage_class(model, spec, rng, autocast, weight_dtype)


def needed(spec, rng: StageRange) -> tuple[str, ...]:
    """Module paths (besides blocks) that stage `rng` runs: the last stage also its tail modules."""
    stage = spec.stage_class
    return stage.every_stage_modules + (stage.first_stage_modules if rng.first else ()) + \
        (tuple(spec.tail_modules) if rng.last else ())


def keep_only(model: nn.Module, spec, ranges: StageRange | list[StageRange]) -> None:
    """Drop from `model` every block and top-level module the stage(s) `ranges` of one rank do not
    run (each becomes an empty `nn.Identity`), so a rank loads, streams and holds only its share."""
    ranges = [ranges] if isinstance(ranges, StageRange) else list(ranges)
    own = {spec.blocks[i].path for rng in ranges for i in range(rng.start, rng.end)}
    keep = {name for rng in ranges for name in needed(spec, rng)}
    for b in spec.blocks:
        if b.path not in own:
            parent, _, index = b.path.rpartition(".")
            model.get_submodule(parent)[int(index)] = nn.Identity()
    block_lists = {b.path.rpartition(".")[0] for b in spec.blocks}
    for name, child in list(model.named_children()):
        if name not in keep and name not in block_lists and any(True for _ in child.parameters()):
            setattr(model, name, nn.Identity())

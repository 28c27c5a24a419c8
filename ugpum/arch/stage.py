"""One pipeline stage of a ComfyUI DiT as a module of its own: what `torch.distributed.pipelining`
runs on a rank (ugpum/distributed/stages.py makes them, one or two per rank: `schedules.py`).

ComfyUI's `Flux.forward` and `WanModel.forward` are one loop over all blocks with glue around it
(patchify, RoPE tables, the timestep's modulation computed once and shared by every block), so a
stage cannot be "blocks[a:b]" alone. A stage is `blocks[a:b]` of the model's own modules with that
glue: the first stage embeds the input, the last one runs the final layer and gives the model's
output (the loss is taken from it by the caller, as `ugpum.diffusion.flow.flow_loss`). Each family
writes its glue as a subclass of `Stage` (ugpum/arch/<family>/stage.py, named by
`ArchSpec.stage_class`); this module holds what they share.

What travels between stages is only what carries a gradient, the hidden state. What every block also
needs and no LoRA parameter influences (RoPE tables, the timestep's modulation, embedded text) is
recomputed on each stage from the micro-batch's inputs (every rank holds the micro-batch: the latent,
timestep and text context), so nothing without a gradient crosses a link and the schedules see plain
tensors. The cost: each stage keeps the small embedders that make them (`Stage.every_stage_modules`).

The model's layout is known by attribute names only; the few ComfyUI functions the glue needs are
taken from the model's own module (`model_namespace`), so the stage always runs the installed
ComfyUI's code. `tests/integration/test_distributed.py` checks stage chains against the model's own
forward (loss and LoRA gradients, fp32, 1e-6).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..compute.dtypes import bf16_autocast


@dataclass(frozen=True)
class StageRange:
    """Blocks [start, end) of the spec's block order (FLUX.2: double blocks, then single blocks)."""
    start: int
    end: int
    first: bool
    last: bool


def model_namespace(model: nn.Module):
    """The module ComfyUI's model class is defined in: where the glue finds ComfyUI's helper functions."""
    return sys.modules[type(model).__module__]


class Stage(nn.Module):
    """Common to every family: the model (not registered as a submodule: its parameters are the
    model's), the range, autocast as the single-process loop applies it. A family's subclass sets
    which of the model's top-level modules its stages run besides the blocks (attribute names; absent
    ones skipped) and writes `forward(*hidden, x, timestep, context, guidance=None)`."""

    every_stage_modules: ClassVar[tuple[str, ...]] = ()     # run by each stage
    first_stage_modules: ClassVar[tuple[str, ...]] = ()     # run by the first stage only (input embedders)

    def __init__(self, model: nn.Module, spec, rng: StageRange, autocast: bool = False, weight_dtype: str = "fp32"):
        super().__init__()
        object.__setattr__(self, "model", model)      # keep the model out of this module's tree
        self.spec, self.rng, self.autocast, self.weight_dtype = spec, rng, autocast, weight_dtype
        # register the blocks this stage runs, so `parameters()` of the stage is its share
        self.own = nn.ModuleList([model.get_submodule(spec.blocks[i].path) for i in range(rng.start, rng.end)])

    def adopt(self, adapters) -> Stage:
        """Register the LoRA adapters of this stage's blocks as its own parameters (they stay the
        LoraSet's too): a schedule finds the weights it computes gradients for through
        `parameters()` (zero-bubble splits each backward into the input's and the weights')."""
        self.adapters = nn.ModuleList(adapters)
        return self

    def _autocast(self, device: torch.device):
        return bf16_autocast(self.autocast, self.weight_dtype, device)

"""Everything a run needs before its first step, for both engines: the plan, the blocks made
trainable (8-bit base, in-place guard, compiled, recomputed blocks wrapped), the optimizer and its learning rate.
A setting an engine cannot honour is refused here, by name, before any weight is loaded."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..arch import ArchSpec, get_spec
from ..compute.base_compute import QuantiseAsLoaded, check_devices, takes_lora, use_base_compute
from ..compute.modes import mode_named
from ..compute.recompute import recompute_blocks
from ..compute import kernels
from ..compute.compile import compile_blocks
from ..planning.devices import resolve_devices
from ..planning.forecast import recompute_line
from ..compute.dtypes import TORCH_DTYPES
from ..compute.inplace_guard import guard_inplace_residuals
from ..placement.place import place_by_plan
from ..planning.plan import Plan
from ..planning.space import best_plan, host_limit
from ..placement.schedules import DISTRIBUTED_ONLY
from .config import TrainConfig
from .errors import TrainingError
from ..wording import setting
from ..compute.lora import LoraSet, attach_lora, lora_targets


def plan_for(cfg: TrainConfig, spec: ArchSpec | None = None) -> Plan:
    """The plan a single-process run with these settings uses (what the Partition Planner node and
    `plan` show); `spec`: the model's (None: `cfg.model`'s)."""
    if cfg.schedule in DISTRIBUTED_ONLY:
        raise TrainingError(f"schedule {cfg.schedule} runs two pipeline stages on each rank of a distributed run "
                            f"({setting('distributed')} under torchrun, README \"Past one machine\"); one process "
                            "runs auto, sequential, gpipe or 1f1b")
    spec = spec or get_spec(cfg.model)
    devices = resolve_devices(cfg.devices, spec, training=True, desktop_gib=cfg.desktop_gib)
    return best_plan(spec, devices, cfg.workload(), grad_accum=cfg.grad_accum, schedule=cfg.schedule,
                     replicas=cfg.replicas, host_available=host_limit(devices))


def base_linear_paths(spec, block_paths: list[str]) -> list[str]:
    """The frozen base Linears of `block_paths` (what 8-bit base compute quantises)."""
    linears = {b.path: b.linears for b in spec.blocks}
    return lora_targets(block_paths, [linears[p] for p in block_paths])


def quantiser(plan: Plan, spec, block_paths: list[str], devices, model) -> QuantiseAsLoaded | None:
    """For a model streamed from its file in 8-bit (the plan's base compute): the hook that quantises
    each Linear as its weight arrives (the bf16 base never lands whole); None otherwise. Refuses devices
    without the tensor cores, before anything loads."""
    on_meta = any(p.is_meta for p in model.parameters())
    if not on_meta or not mode_named(plan.base_compute).quantises:
        return None
    check_devices(plan.base_compute, devices)
    model.requires_grad_(False)               # the base is frozen anyway (attach_lora); 8-bit needs it now
    return QuantiseAsLoaded(base_linear_paths(spec, block_paths), plan.base_compute)


def recomputed_paths(plan: Plan, spec, block_paths: list[str]) -> list[str]:
    """The blocks of `block_paths` that the plan recomputes in backward (all but its kept activations)."""
    kept = {spec.blocks[i].path for i in plan.kept_activations}
    return [p for p in block_paths if p not in kept]


def make_trainable(cfg: TrainConfig, plan: Plan, spec, model, block_paths: list[str],
                   quantised: QuantiseAsLoaded | None, lora: LoraSet, log=print) -> Callable[[], None]:
    """After `lora` is attached to `block_paths`: the measured kernels on (CUDA), the base in the plan's base
    compute (unless quantised as it loaded) with the LoRA in its kernel where that kernel takes it, residuals safe
    to differentiate, the blocks compiled (`compile`), then the ones the plan recomputes wrapped to recompute in
    backward (around the compiled forward). Returns undo() (the LoRA's `remove` takes back what it handed)."""
    turned_on = kernels.turn_on_measured(s.torch_device for c in plan.copies for s in c.stages if s.torch_device)
    if turned_on:
        log(f"kernels: {', '.join(turned_on)} (Triton)")
    if quantised is not None:
        log(quantised.summary())
        undo_8bit = lambda: None                 # noqa: E731 - nothing to put back: the model is dropped after
    else:
        undo_8bit = use_base_compute(model, base_linear_paths(spec, block_paths), plan.base_compute, log, keep="cpu")
    in_kernels = lora.hand_to_kernels(model, takes_lora)
    if in_kernels:
        log(f"LoRA: the up-projection added by the {plan.base_compute} kernel in {in_kernels} layers")
    recomputed = recomputed_paths(plan, spec, block_paths)
    guards = guard_inplace_residuals(model, include_rms=False)
    undo_compile = compile_blocks(model, block_paths, cfg.compile, log)
    on_host, attention = (plan.workload.get(k, False) for k in ("inputs_on_host", "attention_kept"))
    undo_recompute = recompute_blocks(model, recomputed, inputs_on_host=on_host, keep_attention=attention)
    log((f"recompute: {len(recomputed)} of {len(block_paths)} blocks recomputed in backward, the rest keep their "
         "activations" if len(recomputed) < len(block_paths) else "recompute: every block recomputed in backward")
        + (", the recomputed blocks' inputs waiting in host memory" if on_host else "")
        + (", keeping their self-attention outputs" if attention and recomputed else ""))

    def undo():
        undo_recompute()
        undo_compile()
        for g in guards:
            g.remove()
        undo_8bit()
    return undo


@dataclass
class Placed:
    """A model placed by its plan, not yet trainable (`place_for_training`)."""
    plan: Plan
    model: torch.nn.Module
    placement: object               # ugpum.placement.place.Placement or SwapPlacement
    quantise: QuantiseAsLoaded | None
    on_meta: bool

    @property
    def swaps(self) -> list:
        """The block swap handles of the placement (one per device that swaps; none without swap)."""
        return list(getattr(self.placement, "swaps", []))


def place_for_training(cfg: TrainConfig, spec, plan: Plan, model, key_prefix: str = "", share=()) -> Placed:
    """Place the DiT by the plan, streaming it from its file when built on meta (8-bit layers quantised as
    they arrive). `share`: another replica's swap handles, whose host copies of the blocks this one swaps too
    it streams (`ugpum.placement.place.share_swapped_blocks`). Settings the plan resolved (base compute,
    schedule, devices) are read from the plan, never from `cfg`."""
    on_meta = any(p.is_meta for p in model.parameters())     # streamed from its file: dropped after
    if mode_named(plan.base_compute).quantises and plan.offloaded_blocks and not on_meta:
        raise TrainingError(f"base_compute = {plan.base_compute} with block swap quantises each layer as it streams "
                            "from the model file: build the model on the meta device (as train and the nodes do)")
    block_paths = [b.path for b in spec.blocks]
    quantise = quantiser(plan, spec, block_paths, [s.torch_device for s in plan.stages], model)
    placement = place_by_plan(model, plan, spec.tail_modules, cfg.model_file, key_prefix,
                              TORCH_DTYPES[cfg.weight_dtype], on_weight=quantise, share=share)
    return Placed(plan, model, placement, quantise, on_meta)


def make_placed_trainable(cfg: TrainConfig, spec, placed: Placed, log=print, drop: bool = False):
    """Attach the LoRA to a placed model and make it trainable. Returns (model, lora, layout, release);
    release() discards the weights where the model was streamed from its file, or `drop` (a replica's copy)."""
    plan, model = placed.plan, placed.model
    block_paths = [b.path for b in spec.blocks]
    lora = attach_lora(model, lora_targets(block_paths, [b.linears for b in spec.blocks], tuple(cfg.targets)),
                       cfg.rank, cfg.alpha, seed=cfg.seed)
    log(recompute_line(plan))                            # the forecast's line; make_trainable says what it did
    undo_trainable = make_trainable(cfg, plan, spec, model, block_paths, placed.quantise, lora, log)

    def release():
        undo_trainable()
        lora.remove()
        placed.placement.undo("meta" if placed.on_meta or drop else None)     # (streamed from its file: dropped)
    return model, lora, placed.placement.layout, release


def prepare_model(cfg: TrainConfig, spec, plan: Plan, model, key_prefix: str = "", log=print):
    """Place the DiT by the plan (streaming it from its file when built on meta), attach the LoRA and
    make it trainable. Returns (model, lora, layout, release)."""
    return make_placed_trainable(cfg, spec, place_for_training(cfg, spec, plan, model, key_prefix), log)


def make_optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise TrainingError("optimizer 'adamw8bit' needs bitsandbytes (pip install bitsandbytes)") from None
        return bnb.optim.AdamW8bit(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    # fused: one kernel a device for the whole LoRA, its step counts kept there. Unfused, the per-tensor ops and
    # 448 host reads of the step counts (klein 9B) kept the GPU waiting 3-5 ms a step (bench/results/README.md)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)

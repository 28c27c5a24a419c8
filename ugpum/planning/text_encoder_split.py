"""Caption caching with a text encoder that one GPU cannot hold: its layers spread over the GPUs.

FLUX.2 [dev]'s Mistral Small 3.x 24B (42.7 GiB in bf16) is larger than any consumer GPU. Captions are
encoded once, before the DiT is placed (ugpum/train/cache.py), so for that step every GPU is free.
`split_text_encoder` puts the encoder's transformer layers on the GPUs in contiguous ranges, runs
whatever encoding the caller does inside the `with` block, then moves everything back and removes
every hook; nothing of the encoder stays on a GPU when the DiT is placed.

    with split_text_encoder(clip, devices) as te_plan:     # a ComfyUI CLIP object or the bare module
        conds = [clip.encode_from_tokens(clip.tokenize(c)) for c in captions]

How it is split. Inference encodes one caption after another, so the time is the sum of the layers
wherever they run, and there is nothing to balance (the DiT planner, `ugpum.planning.plan`, balances stage
times because training pipelines micro-batches). What costs is each GPU crossing, so the encoder
takes as few GPUs as possible: the first GPU gets the embedding, final norm and as many layers as
fit its budget (`plan.budget_bytes`), the next GPU the following layers, and so on. An encoder that
fits the first GPU is left alone (ComfyUI loads it there as usual); one that does not fit even over
all of them is left to ComfyUI too, which streams its weights from host memory layer by layer on
one GPU: slower, never out of memory, and a warning says so.

How it runs split (`ugpum.placement.place` and `ugpum.placement.route`, as for the DiT). Everything but the layers lives
on the first device ("home"). The router moves each layer's inputs to its device; the mask and RoPE
tables, the same for every layer, cross once per device and caption. After each layer the hidden
state goes back home: the encoders' own forward collects intermediate hidden states (FLUX.2 hands
the DiT layers 10/20/30 of Mistral, 9/18/27 of Qwen3) with `torch.cat`, which needs them on one
device. That is two copies of tokens x hidden x 4 bytes (10 MiB for Mistral at 512 tokens) per
layer away from home: milliseconds per caption. ComfyUI's layers (comfy.ops) cast their weights to
the input's device when they differ; here weights and inputs share a device, so nothing is cast
across devices. ComfyUI's `CLIP.load_model` (which would move the whole encoder onto one GPU) is
bypassed while split, and the encoder's forward runs under `torch.no_grad`.

Layer lists are found by attribute path, never by importing ComfyUI: `model.layers` (ComfyUI's
Llama-style encoders: Qwen3, Mistral) and `encoder.block` (T5, umT5).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..placement.copy import move
from .devices import Device, parse_device_specs
from ..placement.place import Layout, place
from .plan import GIB, PlanError, budget_bytes

log = logging.getLogger("ugpum")

# Where each encoder family keeps its transformer layers (a ModuleList), as a path suffix.
LAYER_LISTS = {"llama": "model.layers", "t5": "encoder.block"}
DEFAULT_TOKENS = 512          # FLUX.2 pads captions to 512 tokens; umT5 and Qwen3 tokenize at least 512
ACTIVATION_BYTES = 4          # ComfyUI runs its text encoders in fp32 whatever the weights' dtype


# ---------------------------------------------------------------------------------------------
# What the planner needs to know

@dataclass(frozen=True)
class EncoderSizes:
    """A text encoder as the planner sees it: bytes per layer and everything else."""
    name: str
    layer_bytes: tuple[int, ...]
    rest_bytes: int               # embedding(s), final norm, ...: kept on the first device
    hidden: int                   # width of the hidden state between layers
    widest: int                   # widest activation inside a layer (the MLP's inner width)
    tokens: int = DEFAULT_TOKENS

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes) + self.rest_bytes

    def working_bytes(self, layers_here: int) -> int:
        """Activations on one device while a caption is encoded: the inputs the router keeps for its
        layers (one hidden state each), a few more (the collected intermediate states, the mask), a
        layer's MLP temporaries and plain attention's scores (one head per 64 channels at most)."""
        t = self.tokens
        states = (layers_here + 8) * t * self.hidden
        temporaries = 3 * t * self.widest + t * t * max(self.hidden // 64, 1)
        return ACTIVATION_BYTES * (states + temporaries)

    @classmethod
    def from_arch(cls, arch, dtype: str, tokens: int | None = None) -> "EncoderSizes":
        """From the catalog's description (ugpum/arch/text_encoders.py), before anything is loaded."""
        return cls(arch.title, (arch.layer_bytes(dtype),) * arch.layers, arch.other_bytes(dtype),
                   arch.hidden, arch.ffn, tokens or arch.tokens)

    @classmethod
    def from_module(cls, module: nn.Module, tokens: int = DEFAULT_TOKENS) -> "EncoderSizes":
        """Measured from a built encoder (the bytes its tensors hold in their own dtypes)."""
        path, layers = find_layers(module)
        per_layer = tuple(_tensor_bytes(layer) for layer in layers)
        first = layers[0]
        hidden = max((p.numel() for p in first.parameters() if p.dim() == 1), default=1)   # norm widths
        widest = max((max(p.shape) for p in first.parameters() if p.dim() == 2), default=hidden)
        return cls(type(module).__name__, per_layer, _tensor_bytes(module) - sum(per_layer), hidden, widest,
                   tokens)


def _tensor_bytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def find_layers(module: nn.Module) -> tuple[str, nn.ModuleList]:
    """(path, ModuleList) of the encoder's transformer layers: the largest layer list whose path
    ends like one of LAYER_LISTS (a wrapper may hold a small CLIP beside a large T5)."""
    found = [(name, m) for name, m in module.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 0
             and any(name == s or name.endswith("." + s) for s in LAYER_LISTS.values())]
    if not found:
        raise ValueError(f"{type(module).__name__}: no transformer layer list found (looked for "
                         f"{' or '.join(LAYER_LISTS.values())}); this text encoder cannot be split")
    return max(found, key=lambda item: _tensor_bytes(item[1]))


# ---------------------------------------------------------------------------------------------
# Plan

@dataclass(frozen=True)
class Slot:
    """A device as the text-encoder step sees it: the memory it may fill."""
    label: str
    torch_device: str | None
    budget_bytes: float


def gpus_for_caching(devices=None) -> list[Device]:
    """The GPUs a text encoder may be split over while captions are cached: `Device`s as given;
    specs ("auto", "cuda:1"; None: every GPU) measured now, keeping only this machine's GPUs."""
    if devices and all(isinstance(d, Device) for d in devices):
        return list(devices)
    specs = [s for s in (devices or ["auto"]) if str(s).strip().lower() != "cpu"]
    return [d for d in parse_device_specs(specs, probe=False) if (d.torch_device or "").startswith("cuda")]


def slots_for_devices(devices: list[Device]) -> list[Slot]:
    return [Slot(d.label, d.torch_device, budget_bytes(d)) for d in devices]


def slots_from_plan(plan) -> list[Slot]:
    """The devices of a DiT plan (`ugpum.planning.plan.Plan`) with the budgets it planned against: caption
    caching runs before the DiT is placed, on the same free memory."""
    return [Slot(s.device, s.torch_device, s.budget_gib * GIB) for s in plan.stages]


@dataclass
class TextEncoderStage:
    label: str
    torch_device: str | None
    layers: tuple[int, int]       # [first, end_exclusive]
    forecast_bytes: int
    budget_bytes: float


@dataclass
class TextEncoderPlan:
    name: str
    total_bytes: int
    mode: str                     # "one": fits the first device; "split"; "stream": left to ComfyUI
    stages: list[TextEncoderStage] = field(default_factory=list)
    first_budget: float = 0.0
    pooled_budget: float = 0.0
    reason: str = ""              # why "stream" although the budgets would allow a split

    def summary(self, name: str = "") -> str:
        size = f"{name or self.name}, {self.total_bytes / GIB:.1f} GiB"
        if self.mode == "one":
            s = self.stages[0]
            return f"{size}: fits on {s.label} ({s.budget_bytes / GIB:.1f} GiB budget)"
        if self.mode == "split":
            ranges = ", ".join(f"layers {a}-{b - 1} on {s.label} ({s.forecast_bytes / GIB:.1f} / "
                               f"{s.budget_bytes / GIB:.1f} GiB)" for s in self.stages for a, b in [s.layers])
            return (f"{size}: more than the first GPU's {self.first_budget / GIB:.1f} GiB budget; split over "
                    f"{len(self.stages)} GPUs for caption caching: {ranges}")
        why = self.reason or (f"does not fit on these devices even split (pooled budget "
                              f"{self.pooled_budget / GIB:.1f} GiB)")
        return (f"{size}: {why}; ComfyUI encodes the captions streaming its layers from host memory to one "
                "GPU (slow)")


def plan_text_encoder(sizes: EncoderSizes, slots: list[Slot]) -> TextEncoderPlan:
    """Contiguous layer ranges over `slots`, filling each in turn (see the module docstring)."""
    if not slots:
        raise PlanError("no device to encode the captions on")
    n = len(sizes.layer_bytes)
    plan = TextEncoderPlan(sizes.name, sizes.total_bytes, "stream", first_budget=slots[0].budget_bytes,
                           pooled_budget=sum(max(s.budget_bytes, 0) for s in slots))
    whole = sizes.total_bytes + sizes.working_bytes(n)
    if whole <= slots[0].budget_bytes:
        plan.mode = "one"
        plan.stages = [TextEncoderStage(slots[0].label, slots[0].torch_device, (0, n), whole, slots[0].budget_bytes)]
        return plan
    start = 0
    for k, slot in enumerate(slots):
        held = sizes.rest_bytes if k == 0 else 0
        end = start
        while end < n and held + sizes.layer_bytes[end] + sizes.working_bytes(end + 1 - start) <= slot.budget_bytes:
            held += sizes.layer_bytes[end]
            end += 1
        if k == 0 and end == start:
            return plan                          # home cannot even hold the embedding and one layer
        if end > start:
            plan.stages.append(TextEncoderStage(slot.label, slot.torch_device, (start, end),
                                                held + sizes.working_bytes(end - start), slot.budget_bytes))
        start = end
        if start == n:
            plan.mode = "split"
            return plan
    plan.stages = []
    return plan


def forecast_for_model(model_id: str, slots: list[Slot]) -> tuple[TextEncoderPlan, str] | None:
    """The caption-caching step of a catalog model (its text encoder file's size) on `slots`, with
    the file name; None for models without a catalog entry (the tiny test models)."""
    from ..arch.text_encoders import ARCHS
    from ..catalog.models import MODELS
    entry = MODELS.get(model_id)
    arch = ARCHS.get(getattr(entry.text_encoder, "arch", "")) if entry else None
    if arch is None or not slots:
        return None
    sizes = EncoderSizes.from_arch(arch, entry.text_encoder.dtype or "bf16")
    return plan_text_encoder(sizes, slots), entry.text_encoder.filename


def forecast_line(plan) -> str | None:
    """One line for the DiT plan's text (CLI `plan`, Partition Planner node)."""
    found = forecast_for_model(plan.model, slots_from_plan(plan))
    if found is None:
        return None
    te_plan, filename = found
    text = te_plan.summary(f"{te_plan.name} ({filename})")
    tail = "; released before the DiT is placed." if te_plan.mode != "stream" else "."
    return "text encoder (captions are encoded once, before training): " + text + tail


# ---------------------------------------------------------------------------------------------
# Placing it

def _home_after(device: str):
    """Forward hook: the layer's hidden state (its output, or the first item of the tuple it
    returns) goes back to the home device; the rest (T5's position bias) stays for the next layer."""
    def hook(_module, _args, output):
        if isinstance(output, torch.Tensor):
            return move(output, device)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            return type(output)((move(output[0], device), *output[1:]))
        return output
    return hook


def _refusal(text_encoder, module: nn.Module) -> str:
    """Why this encoder must stay in ComfyUI's hands, or ''."""
    patcher = getattr(text_encoder, "patcher", None)
    if patcher is not None and getattr(patcher, "patches", None):
        return "it carries patches (a LoRA) that only ComfyUI's loader applies"
    if patcher is not None and getattr(patcher, "is_dynamic", lambda: False)():
        return "ComfyUI's DynamicVRAM holds its weights and streams them to the GPU on demand"
    if any(t.device.type == "meta" for t in list(module.parameters()) + list(module.buffers())):
        return "some of its weights are not loaded (ComfyUI loads them on demand)"
    return ""


@contextlib.contextmanager
def split_text_encoder(text_encoder, devices: list[Device], tokens: int = DEFAULT_TOKENS,
                       slots: list[Slot] | None = None):
    """Spread the encoder's layers over `devices` for the `with` block (a no-op when it fits the first
    device or cannot fit them all); yields the `TextEncoderPlan`. `text_encoder` is a ComfyUI CLIP
    object (its `cond_stage_model` is split) or the encoder module itself. `slots` replaces the
    budgets measured from `devices` (tests, the bench script)."""
    module = getattr(text_encoder, "cond_stage_model", text_encoder)
    sizes = EncoderSizes.from_module(module, tokens)
    te_plan = plan_text_encoder(sizes, slots if slots is not None else slots_for_devices(devices))
    reason = _refusal(text_encoder, module) if te_plan.mode == "split" else ""
    if reason:
        te_plan = dataclasses.replace(te_plan, mode="stream", stages=[], reason=reason)
    if te_plan.mode != "split":
        if te_plan.mode == "stream":
            log.warning("text encoder: %s", te_plan.summary())
        yield te_plan
        return

    if any(s.torch_device is None for s in te_plan.stages):
        raise ValueError("a text encoder is split over this machine's devices, not hand-described ones")
    path, layers = find_layers(module)
    runner = module.get_submodule(path.rsplit(".", 1)[0]) if "." in path else module   # runs the layers
    home = te_plan.stages[0].torch_device
    blocks = {f"{path}.{i}": s.torch_device for s in te_plan.stages for i in range(*s.layers)}
    with contextlib.ExitStack() as undo:                 # everything below is undone in reverse order
        placement = place(module, Layout(blocks, first=home, last=home))
        undo.callback(placement.undo)
        # ComfyUI calls the encoder's encode_token_weights, not its forward: forget the router's
        # per-caption copies whenever the runner of the layers starts, and bring its inputs home.
        placement.router.reset_each_call(runner)
        placement.router.route_into(runner, home)
        for layer in layers:
            undo.callback(layer.register_forward_hook(_home_after(home)).remove)
        _override(runner, "forward", torch.no_grad()(runner.forward), undo)
        if "load_model" in vars(type(text_encoder)) and hasattr(text_encoder, "patcher"):
            # ComfyUI's CLIP would load the whole encoder onto its load device before encoding, and
            # newer ComfyUI makes the tokens on that device: skip the one, make the other home.
            patcher = text_encoder.patcher
            _override(text_encoder, "load_model", lambda *args, **kwargs: patcher, undo)
            undo.callback(setattr, patcher, "load_device", patcher.load_device)
            patcher.load_device = torch.device(home)
        log.info("text encoder: %s", te_plan.summary())
        yield te_plan


def _override(obj, name: str, value, undo: contextlib.ExitStack) -> None:
    """Set an instance attribute for the duration of `undo` (then the class's, or the old one, again)."""
    own = obj.__dict__.get(name)
    setattr(obj, name, value)

    def restore():
        delattr(obj, name)
        if own is not None:
            setattr(obj, name, own)
    undo.callback(restore)

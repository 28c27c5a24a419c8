"""The frozen base Linears computed in a base-compute mode (`base_compute`, one file each in `modes/`).

The base weights never train, so their matmuls can run on 8-bit tensor cores while the LoRA (and
everything trained) stays bf16/fp32. For a mode that quantises (`ComputeMode.quantise_rows`, `matmul`):

* weights are quantised once, per output channel: `W ~= Wq * sw[:, None]`, stored on the layer's device as
  `Wq` [out, in] + `sw` (fp32);
* forward, per call: the activation is quantised per token (row absmax), `y = (xq @ Wq^T) * sx * sw + b`
  through the mode's kernel and one rescale;
* backward gives only the input gradient (weights are frozen): `grad_x = grad_y @ W = (grad_y * sw) @ Wq`,
  so the per-channel weight scale moves onto grad_y's columns and grad_y*sw is quantised per row: a
  quantised GEMM too. Hopper's fp8 GEMM wants the second operand K-major, so the backward reads a
  transposed copy of Wq made on the fly (one pass over 1 byte a weight, freed after). No weight gradient
  is ever formed.

On a device without the mode's tensor cores (the CPU) `emulate=True` runs the *reference emulation*: the
same quantisation, dequantised and multiplied in fp32, so tests check the numerics path everywhere;
without it such devices are refused with one sentence. LoRA forward hooks on the layer keep working
(they run in `Module.__call__` after our forward). Pure torch; nothing here imports ComfyUI.
"""
from __future__ import annotations

import torch
from torch import nn

from ..wording import EngineError
from .modes import EXACT, ComputeMode, fastest_mode_for, mode_named

__all__ = ["use_base_compute", "QuantiseAsLoaded", "quantise_weight", "quantised_linear", "supports",
           "check_devices", "BaseComputeError", "takes_lora"]

# Whether each quantised layer also keeps Wq^T (one more byte a weight) so the backward reads it instead of
# transposing Wq at every call; off until a GPU run measures it (bench/cards.py --experiment transpose-kept). The
# planner does not count the copy: an experiment for a card with room to spare.
KEEP_TRANSPOSED = False


class BaseComputeError(RuntimeError, EngineError):
    pass


def supports(mode: str, device) -> str | None:
    """None when `device` runs `mode`'s kernels, else one sentence saying why not."""
    device, chosen = torch.device(device), mode_named(mode)
    if chosen.min_capability is None:
        return None
    if device.type != "cuda":
        return (f"base_compute={mode} needs an NVIDIA GPU with {mode} tensor cores; {device.type} has none "
                f"(use base_compute={EXACT.name})")
    capability = torch.cuda.get_device_capability(device)
    if chosen.runs_on(capability):
        return None
    other = fastest_mode_for([capability]) or EXACT
    return (f"base_compute={mode} needs {chosen.needs}; {torch.cuda.get_device_name(device)} is "
            f"{capability[0]}.{capability[1]}: use base_compute={other.name}")


def check_devices(mode: str, devices) -> None:
    """Raise BaseComputeError (one sentence) unless every device runs `mode`'s kernels."""
    for dev in sorted({str(d) for d in devices}):
        reason = supports(mode, dev)
        if reason:
            raise BaseComputeError(reason)


def quantise_weight(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear weight [out, in] -> (Wq [out, in], sw [out] fp32), per output channel."""
    q, s = mode_named(mode).quantise_rows(w.detach())
    return q, s.reshape(-1)


def _matmul(a: torch.Tensor, sa: torch.Tensor, b_t: torch.Tensor, sb: torch.Tensor | None, mode: ComputeMode,
            out_dtype: torch.dtype, emulate: bool, lora: tuple | None = None) -> torch.Tensor:
    """(a * sa) @ (b_t^T * sb) (+ a LoRA's scale * h @ B^T) on the mode's kernel, or in fp32 (`emulate`)."""
    if emulate:
        y = (a.float() @ b_t.float().t()) * sa
        y = y if sb is None else y * sb
        if lora is not None:
            h, b, scale = lora
            y = y + (h.float() @ b.float().t()) * scale
        return y.to(out_dtype)
    if lora is None:                     # (a mode whose kernel never takes the LoRA may leave `lora` out)
        return mode.matmul(a, sa, b_t, sb, out_dtype)
    return mode.matmul(a, sa, b_t, sb, out_dtype, lora)


class _QuantisedBase(torch.autograd.Function):
    """y = x @ W^T (+ b) with W frozen and quantised (+ scale * h @ B^T, a LoRA's up-projection in the mode's
    kernel: `takes_lora`); backward returns grad_x (and the LoRA's grad_h, grad_B), never W's."""

    @staticmethod
    def forward(ctx, x2, wq, sw, bias, mode, emulate, out_dtype, h=None, b=None, scale=0.0, wq_t=None):
        chosen = mode_named(mode)
        xq, sx = chosen.quantise_rows(x2)
        y = _matmul(xq, sx, wq, sw, chosen, out_dtype, emulate, None if h is None else (h, b, scale))
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(wq, sw, h, b, wq_t)
        ctx.mode, ctx.emulate, ctx.x_dtype, ctx.scale = mode, emulate, x2.dtype, scale
        return y

    @staticmethod
    def backward(ctx, gy):
        wq, sw, h, b, wq_t = ctx.saved_tensors
        gx = gh = gb = None
        if ctx.needs_input_grad[0]:
            chosen = mode_named(ctx.mode)
            g = gy.float() * sw                                 # the channel scale moves onto grad_y's columns
            gq, sg = chosen.quantise_rows(g)
            w_t = wq_t if wq_t is not None else wq.t() if ctx.emulate else wq.t().contiguous()   # [in, out]
            gx = _matmul(gq, sg, w_t, None, chosen, ctx.x_dtype, ctx.emulate)
        if h is not None:                                    # the up-projection's two small matmuls, scaled after
            g = gy.to(h.dtype)
            gh = (g @ b) * ctx.scale if ctx.needs_input_grad[7] else None
            gb = (g.t() @ h) * ctx.scale if ctx.needs_input_grad[8] else None
        return gx, None, None, None, None, None, None, gh, gb, None, None


def quantised_linear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None, mode: str,
                     emulate: bool = False, lora=None, wq_t: torch.Tensor | None = None) -> torch.Tensor:
    """The quantised base Linear: x [..., in] -> [..., out] in the compute dtype (autocast's, else x's). `lora`:
    a LoRA adapter (`ugpum.compute.lora.LoraAdapter`) whose up-projection the mode's kernel adds; `wq_t`: Wq^T
    contiguous, kept (`KEEP_TRANSPOSED`) for the backward."""
    dev = x.device.type
    compute = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    if not emulate:
        x2 = x2.to(torch.bfloat16)
    with torch.autocast(dev, enabled=False):
        up = (None, None, 0.0) if lora is None else (x2 @ lora.A.to(x2.dtype).t(), lora.B.to(x2.dtype), lora.scale)
        rows = 0 if emulate else mode_named(mode).min_rows
        if x2.shape[0] < rows:                               # a kernel that takes no fewer rows: padded
            x2p, hp = (None if t is None else torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])
                       for t in (x2, up[0]))
            y = _QuantisedBase.apply(x2p, wq, sw, bias, mode, emulate, compute, hp, *up[1:], wq_t)
            y = y[: x2.shape[0]]
        else:
            y = _QuantisedBase.apply(x2, wq, sw, bias, mode, emulate, compute, *up, wq_t)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def takes_lora(layer: nn.Module) -> bool:
    """Whether a layer is an 8-bit base whose kernel adds a LoRA's up-projection itself (`ComputeMode.takes_lora`;
    `ugpum.compute.lora.LoraSet.hand_to_kernels`)."""
    return hasattr(type(layer), "_ugpum_base_class") and mode_named(layer.ugpum_mode).takes_lora()


def _forward_quantised(self, x: torch.Tensor) -> torch.Tensor:
    lora = getattr(self, "ugpum_lora_in_kernel", None)      # (set by LoraSet.hand_to_kernels where takes_lora)
    return quantised_linear(x, self.ugpum_wq, self.ugpum_sw, self.bias, self.ugpum_mode, self.ugpum_emulate, lora,
                            getattr(self, "ugpum_wq_t", None))


_classes: dict[type, type] = {}


def _quantised_class(cls: type) -> type:
    """A subclass of the layer's class whose forward is the quantised one. The layer's class is swapped (not
    its `forward` attribute): one code object for every layer, so a compiled block traces it once instead
    of guarding on each layer's own forward object (a recompile per block, measured on the H200)."""
    if cls not in _classes:
        _classes[cls] = type(f"{cls.__name__}Quantised", (cls,),
                             {"forward": _forward_quantised, "_ugpum_base_class": cls})
    return _classes[cls]


def _effective_weight(layer: nn.Module) -> torch.Tensor:
    """The weight the layer computes with: ComfyUI's ops apply their `weight_function`s (e.g. the scale
    of a scaled fp8 file, `ugpum.placement.stream_load.ScaledWeight`) to the stored tensor at every call."""
    w = layer.weight.detach()
    w = w if w.dtype in (torch.float32, torch.bfloat16, torch.float16) else w.float()
    for fn in getattr(layer, "weight_function", None) or ():
        w = fn(w)
    return w


def _quantise_layer(path: str, layer: nn.Module, mode: str, emulate: bool, keep: str):
    """Make one frozen Linear quantised (class swapped, Wq and sw as buffers); returns what undo needs."""
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"base_compute target {path} is a {type(layer).__name__}, not a Linear")
    if hasattr(type(layer), "_ugpum_base_class"):
        raise ValueError(f"base_compute: {path} is already quantised; undo first")
    w = layer.weight
    if w.requires_grad:
        raise ValueError(f"base_compute: {path}'s weight is trainable; only frozen base weights are quantised")
    wq, sw = quantise_weight(_effective_weight(layer), mode)
    layer.register_buffer("ugpum_wq", wq, persistent=False)
    layer.register_buffer("ugpum_sw", sw, persistent=False)
    if KEEP_TRANSPOSED:
        layer.register_buffer("ugpum_wq_t", wq.t().contiguous(), persistent=False)
    layer.ugpum_mode, layer.ugpum_emulate = mode, emulate
    original = w.data
    if keep == "cpu":
        saved = original.to("cpu", copy=True)
    else:
        saved = None if keep == "none" else original
    if keep != "device":
        w.data = torch.empty(0, device=original.device, dtype=original.dtype)
    stash = (layer, type(layer), saved, original.device)
    layer.__class__ = _quantised_class(type(layer))
    return stash, wq.numel()


def _undo_layers(stash: list) -> None:
    for layer, cls, saved, device in stash:
        layer.weight.data = saved.to(device) if saved.device != device else saved
        layer.__class__ = cls
        for name in ("ugpum_wq", "ugpum_sw", "ugpum_wq_t"):
            layer._buffers.pop(name, None)
        for name in ("ugpum_mode", "ugpum_emulate"):
            layer.__dict__.pop(name, None)


def _check_keep(keep: str) -> None:
    if keep not in ("cpu", "device", "none"):
        raise ValueError(f"keep {keep!r}: use cpu, device or none")


def _summary(mode: str, emulate: bool, layers: int, weights: int) -> str:
    return (f"base_compute={mode}{' (emulated in fp32)' if emulate else ''}: {layers} frozen Linears "
            f"({weights / 1e9:.2f} B weights) quantised per output channel, activations per token")


def use_base_compute(model: nn.Module, linear_paths: list[str], mode: str, log=print, *, emulate: bool = False,
                     keep: str = "cpu"):
    """Run the frozen Linears at `linear_paths` in `mode` (the exact base changes nothing). Returns `undo()`,
    which puts back the exact original weights.

    keep: where the original weights wait for `undo` meanwhile: 'cpu' (host memory; the GPU then holds
    only the quantised weights), 'device' (stays, no saving, fastest undo) or 'none' (dropped; `undo` then
    refuses). emulate: run the fp32 reference emulation instead of the mode's kernels (any device, tests)."""
    quantises = mode_named(mode).quantises
    _check_keep(keep)
    if not quantises or not linear_paths:
        return lambda: None
    layers = [model.get_submodule(p) for p in linear_paths]
    if not emulate:                                  # refuse before any layer changes
        check_devices(mode, {layer.weight.device for layer in layers})
    stash, n_params = [], 0
    for path, layer in zip(linear_paths, layers):
        entry, n = _quantise_layer(path, layer, mode, emulate, keep)
        stash.append(entry)
        n_params += n
    log(_summary(mode, emulate, len(stash), n_params))

    def undo():
        if keep == "none":
            raise BaseComputeError("base_compute: the original weights were dropped (keep='none'); reload the model")
        _undo_layers(stash)
    return undo


class QuantiseAsLoaded:
    """`on_weight` for `ugpum.placement.place.place`: each target Linear is quantised (original dropped) the
    moment its weight arrives from the file, so the GPU never holds the bf16 base, only one layer of it at a
    time; what the planner forecasts for the mode is then also the loading peak."""

    def __init__(self, linear_paths: list[str], mode: str, *, emulate: bool = False):
        self.quantises = mode_named(mode).quantises
        self.targets, self.mode, self.emulate = set(linear_paths), mode, emulate
        self.layers = self.weights = 0

    def __call__(self, path: str, module: nn.Module) -> None:
        if self.quantises and path in self.targets:
            _, n = _quantise_layer(path, module, self.mode, self.emulate, "none")
            self.layers += 1
            self.weights += n

    def summary(self) -> str:
        return _summary(self.mode, self.emulate, self.layers, self.weights)

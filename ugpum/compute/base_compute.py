"""8-bit compute for the frozen base Linears: `base_compute = bf16 | fp8 | int8`.

The base weights never train, so their matmuls can run on 8-bit tensor cores while the LoRA (and
everything trained) stays bf16/fp32:

* weights are quantised once, per output channel: `W ~= Wq * sw[:, None]` (fp8 e4m3, or int8 with a
  symmetric absmax scale), stored on the layer's device as `Wq` [out, in] (1 byte a weight) + `sw` (fp32);
* forward, per call: the activation is quantised per token (row absmax), `y = (xq @ Wq^T) * sx * sw + b`
  through `torch._scaled_mm` (fp8, rowwise scales, bf16 out; CUDA compute capability >= 8.9) or
  `torch._int_mm` (int8 -> int32, Ampere+) and one rescale;
* backward gives only the input gradient (weights are frozen): `grad_x = grad_y @ W = (grad_y * sw) @ Wq`,
  so the per-channel weight scale moves onto grad_y's columns and grad_y*sw is quantised per row: an 8-bit
  GEMM too. Hopper's fp8 GEMM wants the second operand K-major, so the backward reads a transposed copy
  of Wq made on the fly (one pass over 1 byte a weight, freed after). No weight gradient is ever formed.

On a device without 8-bit tensor cores (the CPU) `emulate=True` runs the *reference emulation*: the same
quantisation, dequantised and multiplied in fp32, so tests check the numerics path everywhere; without it
such devices are refused with one sentence. LoRA forward hooks on the layer keep working (they run in
`Module.__call__` after our forward). Pure torch; nothing here imports ComfyUI.
"""
from __future__ import annotations

import torch
from torch import nn

from ..wording import EngineError

__all__ = ["MODES", "SETTINGS", "use_8bit_base", "QuantiseAsLoaded", "quantise_weight",
           "quantise_rows", "supports", "check_devices", "eight_bit_mode", "QUALITY_CHECK", "BaseComputeError"]

MODES = ("bf16", "fp8", "int8")
SETTINGS = ("auto",) + MODES       # auto: the planner picks (ugpum.planning.plan.plan_training)
# What the H200 showed for each 8-bit mode at full size (klein 9B, three blocks: first, middle, last;
# bench/results/speed.md): the LoRA gradient of a block with the 8-bit base against the bf16 base.
QUALITY_CHECK = {"fp8": "LoRA gradients vs the bf16 base: cosine 0.9985 per block (klein 9B, H200)",
                 "int8": "LoRA gradients vs the bf16 base: cosine 0.9997 per block (klein 9B, H200)"}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0


class BaseComputeError(RuntimeError, EngineError):
    pass


def supports(mode: str, device) -> str | None:
    """None when `device` has tensor cores for `mode`, else one sentence saying why not."""
    device = torch.device(device)
    if mode == "bf16":
        return None
    if device.type != "cuda":
        return (f"base_compute={mode} needs an NVIDIA GPU with {mode} tensor cores; {device.type} has none "
                "(use base_compute=bf16)")
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if mode == "fp8" and (major, minor) < (8, 9):
        return (f"base_compute=fp8 needs fp8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); "
                f"{name} is {major}.{minor}: use base_compute=int8" + ("" if major >= 8 else " or bf16"))
    if mode == "int8" and major < 8:
        return f"base_compute=int8 needs compute capability 8.0+ (Ampere or newer); {name} is {major}.{minor}"
    return None


def eight_bit_mode(capability: tuple[int, int] | None) -> str | None:
    """The 8-bit base mode a GPU of this compute capability runs on tensor cores: fp8 from 8.9 (Ada,
    Hopper, Blackwell), int8 on Ampere (8.x), None before Ampere or without a capability (the CPU)."""
    if capability is None:
        return None
    if tuple(capability) >= (8, 9):
        return "fp8"
    return "int8" if capability[0] >= 8 else None


def check_devices(mode: str, devices) -> None:
    """Raise BaseComputeError (one sentence) unless every device has tensor cores for `mode`."""
    for dev in sorted({str(d) for d in devices}):
        reason = supports(mode, dev)
        if reason:
            raise BaseComputeError(reason)


def _qmax(mode: str) -> float:
    return FP8_MAX if mode == "fp8" else INT8_MAX


def _to_q(t: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "fp8":
        return t.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return t.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def quantise_rows(t: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantisation of a 2-D tensor: (q, scale [rows, 1] fp32), t ~= q * scale."""
    amax = t.detach().abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / _qmax(mode)
    return _to_q(t.float() / scale, mode), scale


def quantise_weight(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear weight [out, in] -> (Wq [out, in], sw [out] fp32), per output channel."""
    q, s = quantise_rows(w.detach(), mode)
    return q, s.reshape(-1)


def _deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s


def _mm8(a: torch.Tensor, sa: torch.Tensor, b_t: torch.Tensor, sb: torch.Tensor | None, mode: str,
         out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """(a * sa) @ (b_t^T * sb): a [M, K] quantised per row with sa [M, 1]; b_t [N, K] (rows = output
    columns) quantised with sb [N] (or None for 1). Result [M, N] in out_dtype."""
    if emulate:
        y = (a.float() @ b_t.float().t()) * sa
        return (y if sb is None else y * sb).to(out_dtype)
    if mode == "fp8":
        ones = sb if sb is not None else torch.ones(b_t.shape[0], device=a.device, dtype=torch.float32)
        return torch._scaled_mm(a, b_t.t(), scale_a=sa.float().contiguous(),
                                scale_b=ones.float().reshape(1, -1).contiguous(), out_dtype=out_dtype)
    y = torch._int_mm(a, b_t.t()).float() * sa
    return (y if sb is None else y * sb).to(out_dtype)


class _Base8(torch.autograd.Function):
    """y = x @ W^T (+ b) with W frozen and 8-bit; backward returns grad_x only."""

    @staticmethod
    def forward(ctx, x2, wq, sw, bias, mode, emulate, out_dtype):
        xq, sx = quantise_rows(x2, mode)
        y = _mm8(xq, sx, wq, sw, mode, out_dtype, emulate)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(wq, sw)
        ctx.mode, ctx.emulate, ctx.x_dtype = mode, emulate, x2.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        wq, sw = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        g = gy.float() * sw                                 # the channel scale moves onto grad_y's columns
        gq, sg = quantise_rows(g, ctx.mode)
        w_t = wq.t() if ctx.emulate else wq.t().contiguous()     # [in, out]: rows = grad_x's columns
        gx = _mm8(gq, sg, w_t, None, ctx.mode, ctx.x_dtype, ctx.emulate)
        return gx, None, None, None, None, None, None


def linear_8bit(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None, mode: str,
                emulate: bool = False) -> torch.Tensor:
    """The 8-bit base Linear: x [..., in] -> [..., out] in the compute dtype (autocast's, else x's)."""
    dev = x.device.type
    compute = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    if not emulate:
        x2 = x2.to(torch.bfloat16)
        if mode == "int8" and x2.shape[0] <= 16:             # _int_mm needs more than 16 rows
            pad = torch.zeros(17 - x2.shape[0], x2.shape[1], device=x2.device, dtype=x2.dtype)
            y = _Base8.apply(torch.cat([x2, pad]), wq, sw, bias, mode, emulate, compute)[: x2.shape[0]]
            return y.reshape(*x.shape[:-1], y.shape[-1])
    with torch.autocast(dev, enabled=False):
        y = _Base8.apply(x2, wq, sw, bias, mode, emulate, compute)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _forward_8bit(self, x: torch.Tensor) -> torch.Tensor:
    return linear_8bit(x, self.ugpum_wq, self.ugpum_sw, self.bias, self.ugpum_mode, self.ugpum_emulate)


_classes: dict[type, type] = {}


def _class_8bit(cls: type) -> type:
    """A subclass of the layer's class whose forward is the 8-bit one. The layer's class is swapped (not
    its `forward` attribute): one code object for every layer, so a compiled block traces it once instead
    of guarding on each layer's own forward object (a recompile per block, measured on the H200)."""
    if cls not in _classes:
        _classes[cls] = type(f"{cls.__name__}Base8", (cls,), {"forward": _forward_8bit, "_ugpum_base_class": cls})
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
    """Make one frozen Linear 8-bit (class swapped, Wq and sw as buffers); returns what undo needs."""
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"base_compute target {path} is a {type(layer).__name__}, not a Linear")
    if hasattr(type(layer), "_ugpum_base_class"):
        raise ValueError(f"base_compute: {path} is already 8-bit; undo first")
    w = layer.weight
    if w.requires_grad:
        raise ValueError(f"base_compute: {path}'s weight is trainable; only frozen base weights go 8-bit")
    wq, sw = quantise_weight(_effective_weight(layer), mode)
    layer.register_buffer("ugpum_wq", wq, persistent=False)
    layer.register_buffer("ugpum_sw", sw, persistent=False)
    layer.ugpum_mode, layer.ugpum_emulate = mode, emulate
    original = w.data
    if keep == "cpu":
        saved = original.to("cpu", copy=True)
    else:
        saved = None if keep == "none" else original
    if keep != "device":
        w.data = torch.empty(0, device=original.device, dtype=original.dtype)
    stash = (layer, type(layer), saved, original.device)
    layer.__class__ = _class_8bit(type(layer))
    return stash, wq.numel()


def _undo_layers(stash: list) -> None:
    for layer, cls, saved, device in stash:
        layer.weight.data = saved.to(device) if saved.device != device else saved
        layer.__class__ = cls
        for name in ("ugpum_wq", "ugpum_sw"):
            layer._buffers.pop(name, None)
        for name in ("ugpum_mode", "ugpum_emulate"):
            layer.__dict__.pop(name, None)


def _check_mode(mode: str, keep: str = "none") -> None:
    if mode not in MODES:
        raise ValueError(f"base_compute {mode!r}: use one of {', '.join(MODES)}")
    if keep not in ("cpu", "device", "none"):
        raise ValueError(f"keep {keep!r}: use cpu, device or none")


def _summary(mode: str, emulate: bool, layers: int, weights: int) -> str:
    return (f"base_compute={mode}{' (emulated in fp32)' if emulate else ''}: {layers} frozen Linears "
            f"({weights / 1e9:.2f} B weights) quantised per output channel, activations per token")


def use_8bit_base(model: nn.Module, linear_paths: list[str], mode: str, log=print, *, emulate: bool = False,
                  keep: str = "cpu"):
    """Run the frozen Linears at `linear_paths` in `mode` (bf16 changes nothing). Returns `undo()`, which
    puts back the exact original weights.

    keep: where the original weights wait for `undo` meanwhile: 'cpu' (host memory; the GPU then holds 1
    byte a weight), 'device' (stays, no saving, fastest undo) or 'none' (dropped; `undo` then refuses).
    emulate: run the fp32 reference emulation instead of 8-bit kernels (any device, tests)."""
    _check_mode(mode, keep)
    if mode == "bf16" or not linear_paths:
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
    """`on_weight` for `ugpum.placement.place.place`: each target Linear goes 8-bit (original dropped) the moment
    its weight arrives from the file, so the GPU never holds the bf16 base, only one layer of it at a time;
    what the planner forecasts for 8-bit (1 byte a weight) is then also the loading peak."""

    def __init__(self, linear_paths: list[str], mode: str, *, emulate: bool = False):
        _check_mode(mode)
        self.targets, self.mode, self.emulate = set(linear_paths), mode, emulate
        self.layers = self.weights = 0

    def __call__(self, path: str, module: nn.Module) -> None:
        if self.mode != "bf16" and path in self.targets:
            _, n = _quantise_layer(path, module, self.mode, self.emulate, "none")
            self.layers += 1
            self.weights += n

    def summary(self) -> str:
        return _summary(self.mode, self.emulate, self.layers, self.weights)

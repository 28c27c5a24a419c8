"""In-place residuals vs autograd: the failure, the guard, and exact gradients.

ComfyUI's FLUX.2 blocks do ``x += f(norm(x))``; with trainable LoRA parameters in the blocks,
backward fails unless the norms get a private copy of their input (ugpum.compute.inplace_guard). These
tests show the failure on ComfyUI's real modules (tiny, fp64, CPU), then check the guarded
gradients against central finite differences, plainly and with per-block checkpointing, for
FLUX.2 and Wan 2.1. The pure-torch tests at the top need no ComfyUI.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # tests/ (support)
if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from support import comfy_models as cm  # noqa: E402
from ugpum.compute.inplace_guard import guard_inplace_residuals, recompute_block  # noqa: E402

F64 = torch.float64
FD_TOL = 1e-6


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------

def add_lora(model: torch.nn.Module, style: str = "hook", rank: int = 2, seed: int = 1):
    """Rank-r adapters on every Linear inside the blocks; returns the trainable parameters."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for name, mod in model.named_modules():
        if not (isinstance(mod, torch.nn.Linear) and "blocks." in name):
            continue
        w = mod.weight
        a = torch.nn.Parameter(0.2 * torch.randn(rank, mod.in_features, generator=g, dtype=F64).to(w.dtype))
        b = torch.nn.Parameter(0.2 * torch.randn(mod.out_features, rank, generator=g, dtype=F64).to(w.dtype))
        params += [a, b]
        if style == "hook":
            mod.register_forward_hook(lambda m, args, out, a=a, b=b: out + (args[0] @ a.t()) @ b.t())
        else:  # ComfyUI's own mechanism; a new list per module (the class attribute is shared)
            mod.weight_function = [lambda weight, a=a, b=b: weight + b @ a]
    return params


def checkpoint_each(blocks, wrapper):
    for blk in blocks:
        blk.forward = functools.partial(wrapper, blk.forward)


def bare_checkpoint(fn, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def make_loss(model, inputs, seed: int = 2):
    with torch.no_grad():
        out = model(**inputs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(out.dtype)
    return lambda: (model(**inputs) * weights).sum()


def autograd_grads(loss, params):
    for p in params:
        p.grad = None
    loss().backward()
    return [p.grad.clone() for p in params]


def max_fd_error(loss, params, grads, which=(0, 1, None, -2, -1), h: float = 1e-5) -> float:
    """Worst relative error of autograd vs central differences on a few scalars.

    For each chosen parameter tensor (first/last adapters, one in the middle) the entry with
    the largest gradient is checked, so the comparison is well conditioned.
    """
    idx = [len(params) // 2 if i is None else i for i in which]
    worst = 0.0
    with torch.no_grad():
        for i in idx:
            p, g = params[i], grads[i]
            flat = int(g.abs().argmax())
            pos = tuple(int(v) for v in torch.unravel_index(torch.tensor(flat), g.shape))
            old = p[pos].item()
            p[pos] = old + h
            up = loss().item()
            p[pos] = old - h
            down = loss().item()
            p[pos] = old
            fd = (up - down) / (2 * h)
            worst = max(worst, abs(fd - g[pos].item()) / max(abs(fd), 1e-12))
    return worst


# ------------------------------------------------------------------------------------------
# pure torch: the mechanism without ComfyUI
# ------------------------------------------------------------------------------------------

class _InplaceBlock(torch.nn.Module):
    """x += W(norm1(x)); x += V(norm2(x)) -- the FLUX.2 double-block pattern in miniature."""

    def __init__(self, dim: int, g: torch.Generator):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(dim, elementwise_affine=False, dtype=F64)
        self.norm2 = torch.nn.LayerNorm(dim, elementwise_affine=False, dtype=F64)
        self.w = torch.nn.Parameter(torch.randn(dim, dim, generator=g, dtype=F64) / dim**0.5)
        self.v = torch.nn.Parameter(torch.randn(dim, dim, generator=g, dtype=F64) / dim**0.5)

    def forward(self, x, inplace: bool = True):
        if inplace:
            x += torch.tanh(self.norm1(x) @ self.w)
            x += torch.tanh(self.norm2(x) @ self.v)
            return x
        x = x + torch.tanh(self.norm1(x) @ self.w)
        return x + torch.tanh(self.norm2(x) @ self.v)


def _toy(n_blocks=3, dim=8):
    g = torch.Generator().manual_seed(0)
    blocks = torch.nn.ModuleList(_InplaceBlock(dim, g) for _ in range(n_blocks))
    x0 = torch.randn(5, dim, generator=g, dtype=F64)
    return blocks, x0


def _toy_grads(blocks, x0, inplace=True, ckpt=None):
    for p in blocks.parameters():
        p.grad = None
    x = x0 * 1.0
    for blk in blocks:
        x = ckpt(blk, x, inplace=inplace) if ckpt else blk(x, inplace=inplace)
    (x ** 2).sum().backward()
    return [p.grad.clone() for p in blocks.parameters()]


def test_toy_inplace_fails_and_guard_restores_exact_gradients():
    blocks, x0 = _toy()
    reference = _toy_grads(blocks, x0, inplace=False)
    with pytest.raises(RuntimeError, match="inplace operation"):
        _toy_grads(blocks, x0)
    handles = guard_inplace_residuals(blocks)
    assert len(handles) == 2 * len(blocks)
    assert guard_inplace_residuals(blocks) == []  # idempotent
    for got, want in zip(_toy_grads(blocks, x0), reference):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for got, want in zip(_toy_grads(blocks, x0, ckpt=recompute_block), reference):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match="inplace operation"):
        _toy_grads(blocks, x0, ckpt=bare_checkpoint)
    for h in handles:
        h.remove()
    with pytest.raises(RuntimeError, match="inplace operation"):
        _toy_grads(blocks, x0)


def test_toy_checkpoint_with_copies_but_no_guard_is_silently_wrong():
    blocks, x0 = _toy()
    reference = _toy_grads(blocks, x0, inplace=False)
    got = _toy_grads(blocks, x0, ckpt=recompute_block)  # no error raised ...
    err = max(float((a - b).abs().max()) for a, b in zip(got, reference))
    assert err > 1e-6  # ... but the gradients are wrong


def test_guard_copies_only_while_recording_gradients():
    blocks, x0 = _toy(n_blocks=1)
    guard_inplace_residuals(blocks)
    seen = []
    blocks[0].norm2.register_forward_pre_hook(lambda m, args: seen.append(args[0]))  # runs after the guard
    x = x0 * 1.0
    with torch.no_grad():
        blocks[0](x)
    assert seen[-1] is x  # no copy when nothing is recorded
    x = x0 * 1.0
    blocks[0](x)
    assert seen[-1] is not x and seen[-1].data_ptr() != x.data_ptr()


# ------------------------------------------------------------------------------------------
# ComfyUI: FLUX.2 and Wan 2.1
# ------------------------------------------------------------------------------------------



def _flux2(style="hook"):
    model = cm.build_tiny_flux2(dtype=F64, depth=2, depth_single=2)
    params = add_lora(model, style)
    return model, params, make_loss(model, cm.flux2_inputs(model, height_latent=4, width_latent=4))


def _wan():
    model = cm.build_tiny_wan(dtype=F64, num_layers=2)
    params = add_lora(model)
    return model, params, make_loss(model, cm.wan_inputs(model, frames=2, height_latent=4, width_latent=4))


@pytest.mark.parametrize("style", ["hook", "weight_function"])
def test_flux2_backward_fails_without_guard(comfy, style):
    model, params, loss = _flux2(style)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        autograd_grads(loss, params)


def test_flux2_bare_checkpoint_fails_even_with_guard(comfy):
    model, params, loss = _flux2()
    guard_inplace_residuals(model)
    checkpoint_each(list(model.double_blocks) + list(model.single_blocks), bare_checkpoint)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        autograd_grads(loss, params)


def test_flux2_checkpoint_without_guard_gives_wrong_gradients(comfy):
    model, params, loss = _flux2()
    guard_inplace_residuals(model)
    reference = autograd_grads(loss, params)
    assert max_fd_error(loss, params, reference) < FD_TOL

    model, params, loss = _flux2()  # same seeds, fresh modules, no guard
    checkpoint_each(list(model.double_blocks) + list(model.single_blocks), recompute_block)
    got = autograd_grads(loss, params)  # runs without error ...
    scale = max(float(g.abs().max()) for g in reference)
    err = max(float((a - b).abs().max()) for a, b in zip(got, reference))
    assert err > 1e-6 * scale  # ... and is wrong


def test_flux2_whole_model_checkpoint_is_silently_wrong_without_guard(comfy):
    """Checkpointing the whole diffusion model (what ComfyUI 0.33's TrainLoraNode does at its
    default checkpoint_depth=1) hides the in-place error and returns wrong gradients; the guard
    makes it exact."""
    def whole(model):
        forward = model.forward
        model.forward = lambda *a, **k: bare_checkpoint(forward, *a, **k)

    model, params, loss = _flux2()
    guard_inplace_residuals(model)
    reference = autograd_grads(loss, params)
    scale = max(float(g.abs().max()) for g in reference)
    for guarded in (False, True):
        model, params, loss = _flux2()
        if guarded:
            guard_inplace_residuals(model)
        whole(model)
        got = autograd_grads(loss, params)
        err = max(float((a - b).abs().max()) for a, b in zip(got, reference))
        if guarded:
            assert err <= 1e-12 * scale
            assert max_fd_error(loss, params, got) < FD_TOL
        else:
            assert err > 1e-6 * scale


@pytest.mark.parametrize("style", ["hook", "weight_function"])
@pytest.mark.parametrize("mode", ["plain", "checkpoint"])
def test_flux2_guarded_gradients_match_finite_differences(comfy, mode, style):
    model, params, loss = _flux2(style)
    handles = guard_inplace_residuals(model)
    assert handles
    if mode == "checkpoint":
        checkpoint_each(list(model.double_blocks) + list(model.single_blocks), recompute_block)
    grads = autograd_grads(loss, params)
    assert all(float(g.abs().max()) > 0 for g in grads)
    assert max_fd_error(loss, params, grads) < FD_TOL


@pytest.mark.parametrize("mode", ["plain", "checkpoint"])
def test_flux2_layer_norms_alone_suffice(comfy, mode):
    """FLUX.2's RMSNorms only see fresh q/k, so include_rms=False (cheaper) is exact too."""
    model, params, loss = _flux2()
    handles = guard_inplace_residuals(model, include_rms=False)
    assert len(handles) == 4 * len(model.double_blocks) + len(model.single_blocks) + 1  # + final norm
    if mode == "checkpoint":
        checkpoint_each(list(model.double_blocks) + list(model.single_blocks), recompute_block)
    grads = autograd_grads(loss, params)
    assert max_fd_error(loss, params, grads) < FD_TOL


@pytest.mark.parametrize("mode", ["plain", "bare_checkpoint"])
def test_wan_has_no_inplace_problem(comfy, mode):
    model, params, loss = _wan()
    if mode == "bare_checkpoint":
        checkpoint_each(model.blocks, bare_checkpoint)
    grads = autograd_grads(loss, params)
    assert max_fd_error(loss, params, grads) < FD_TOL


@pytest.mark.parametrize("mode", ["plain", "checkpoint"])
def test_wan_guarded_gradients_match_finite_differences(comfy, mode):
    model, params, loss = _wan()
    assert guard_inplace_residuals(model)
    if mode == "checkpoint":
        checkpoint_each(model.blocks, recompute_block)
    grads = autograd_grads(loss, params)
    assert max_fd_error(loss, params, grads) < FD_TOL

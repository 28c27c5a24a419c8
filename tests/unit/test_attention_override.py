"""Training attention (ugpum.arch.attention): ComfyUI's attention contract computed by torch's own SDPA choice,
equal to ComfyUI's attention_pytorch on every layout the FLUX.2 and Wan blocks use, handed to the blocks through
ComfyUI's optimized_attention_override, and ComfyUI's own function where a call needs what it covers (a mask)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import comfy_models as cm  # noqa: E402
from ugpum.arch import attention  # noqa: E402


@pytest.fixture(scope="module")
def comfy_attention():
    cm.import_comfy(cm.find_comfyui())
    import comfy.ldm.modules.attention as comfy_attention
    return comfy_attention


@pytest.mark.parametrize("skip_reshape, skip_output_reshape", [(True, False), (False, False), (False, True)])
def test_same_as_comfyui_attention(comfy_attention, skip_reshape, skip_output_reshape):
    g = torch.Generator().manual_seed(0)
    heads, dim = 3, 8
    shape = (2, heads, 10, dim) if skip_reshape else (2, 10, heads * dim)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    theirs = comfy_attention.attention_pytorch(q, k, v, heads, skip_reshape=skip_reshape,
                                               skip_output_reshape=skip_output_reshape)
    ours = attention.torch_attention(comfy_attention.attention_pytorch, q, k, v, heads, skip_reshape=skip_reshape,
                                     skip_output_reshape=skip_output_reshape, transformer_options={})
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_masked_call_goes_to_comfyui(comfy_attention):
    calls = []

    def comfy_function(*args, **kwargs):
        calls.append(kwargs["mask"])
        return "comfy's answer"
    q = torch.randn(1, 4, 6)
    mask = torch.zeros(6, 6)
    assert attention.torch_attention(comfy_function, q, q, q, 2, mask=mask) == "comfy's answer"
    assert calls and calls[0] is mask


def test_blocks_are_handed_the_override(comfy_attention, monkeypatch):
    """ComfyUI's optimized_attention, given the stages' transformer_options, runs ours (and ours' result)."""
    seen = []
    real = attention.torch_attention

    def counting(comfy_function, *args, **kwargs):
        seen.append(comfy_function.__name__)
        return real(comfy_function, *args, **kwargs)
    monkeypatch.setattr(attention, "torch_attention", counting)
    q = torch.randn(1, 5, 4 * 8)
    out = comfy_attention.optimized_attention(q, q, q, 4, transformer_options=attention.training_options())
    assert seen and out.shape == q.shape
    torch.testing.assert_close(out, real(comfy_attention.attention_pytorch, q, q, q, 4))


def test_training_loss_runs_through_the_override(comfy_attention, monkeypatch):
    """The one-process engine's loss (train.objective.loss_at) hands the override to ComfyUI's model, whose
    blocks then attend through it: every block of a tiny FLUX.2, forward."""
    from comfy_bridge import build_random, comfy_training_mode
    from ugpum.arch import get_spec
    from ugpum.train.config import TrainConfig
    from ugpum.train.objective import loss_at
    spec = get_spec("tiny-flux2")
    model = build_random(spec, torch.float32)
    calls = []
    real = attention.torch_attention
    monkeypatch.setattr(attention, "torch_attention", lambda f, *a, **k: calls.append(1) or real(f, *a, **k))
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, spec.latent_channels, 4, 4, generator=g)
    context = torch.randn(1, 8, spec.context_dim, generator=g)
    with comfy_training_mode():
        loss = loss_at(model, spec, TrainConfig(model=spec.id), x0, torch.randn(x0.shape, generator=g),
                       torch.tensor([0.5]), context, "cpu", "none")
    assert torch.isfinite(loss) and len(calls) == len(spec.blocks)

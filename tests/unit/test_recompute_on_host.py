"""The recomputed blocks' inputs in host memory (`Workload.inputs_on_host`): where the GPU cannot hold them
(Wan 2.1 14B's 81-frame clips on a 24 GiB card), the planner keeps them in pinned host memory until each
block's backward, and training gives the same gradients (real autograd; on the CPU the 'host' copy is a copy
in CPU memory, the same path as the GPU's pinned one)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from ugpum.compute import recompute
from ugpum.planning.devices import parse_device_specs
from ugpum.planning.forecast import format_plan, plan_for_config
from ugpum.train.config import load_config


class Block(nn.Module):
    """Two streams by keyword and a shared vector, as ComfyUI's FLUX.2 double blocks are called."""

    def __init__(self):
        super().__init__()
        self.img, self.txt = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, img, txt=None, vec=None):
        return torch.tanh(self.img(img) + vec), torch.tanh(self.txt(txt) + img.mean())


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, img, txt, vec):
        for block in self.blocks:
            img, txt = block(img=img, txt=txt, vec=vec)
        return img.square().sum() + txt.sum()


def test_blocks_recomputed_from_host_copies_give_the_same_gradients(monkeypatch):
    monkeypatch.setattr(recompute, "HOST_MIN_BYTES", 0)
    torch.manual_seed(0)
    plain, offloaded = Model(), Model()
    offloaded.load_state_dict(plain.state_dict())
    inputs = [torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True), torch.randn(8)]
    plain(*inputs).backward()
    expected = [p.grad.clone() for p in plain.parameters()] + [inputs[0].grad.clone(), inputs[1].grad.clone()]
    inputs[0].grad = inputs[1].grad = None
    recompute.recompute_blocks(offloaded, [f"blocks.{i}" for i in range(3)], inputs_on_host=True,
                               device_types=("cpu",))
    offloaded(*inputs).backward()
    got = [p.grad for p in offloaded.parameters()] + [inputs[0].grad, inputs[1].grad]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("on_host", [False, True])
def test_a_checkpointed_input_is_saved_as_its_own_copy(monkeypatch, on_host):
    """Under `inputs_to_host` the input autograd keeps for recompute is a copy: what the caller does with its
    own buffer afterwards does not reach the backward (without it, torch refuses the changed input)."""
    monkeypatch.setattr(recompute, "HOST_MIN_BYTES", 0)
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    torch.tanh(layer(x)).sum().backward()
    expected, layer.weight.grad = layer.weight.grad.clone(), None
    buffer = x * 1                                        # a hidden state: it carries a gradient
    with recompute.inputs_to_host(("cpu",)) if on_host else contextlib.nullcontext():
        y = torch.utils.checkpoint.checkpoint(lambda h: torch.tanh(layer(h)).sum(), buffer, use_reentrant=False)
    with torch.no_grad():
        buffer.mul_(3)
    if not on_host:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
        return
    y.backward()
    torch.testing.assert_close(layer.weight.grad, expected)


def _wan_plan(frames: int):
    cfg = load_config("wan14b-480-clip", overrides={"resolution": 832, "frames": frames, "base_compute": "auto"})
    return plan_for_config(cfg, parse_device_specs(["rtx4090"], probe=False), bucket=(832, 480))


def test_81_frame_clips_fit_a_24gb_card_with_the_inputs_in_host_memory():
    """Wan 14B at 832x480: 33 frames fit with block swap alone; 81 frames' 40 fp32 hidden states (640 MiB each)
    do not fit even with every block swapped, and wait in host memory, which the plan counts and says."""
    short, long = _wan_plan(33), _wan_plan(81)
    assert not short.workload["inputs_on_host"] and short.inputs_on_host_gib == 0
    assert long.workload["inputs_on_host"] and long.stages[0].forecast_gib <= long.stages[0].budget_gib
    assert long.inputs_on_host_gib == pytest.approx(40 * 639.8 / 1024, rel=0.01)
    assert long.forecast_host_gib > long.inputs_on_host_gib + long.swap_bytes_per_step / 2 / 1024 ** 3
    text = format_plan(long)
    assert "its input waiting in host memory until then (25.0 GiB" in text
    assert "25.0 the recomputed blocks' inputs" in text

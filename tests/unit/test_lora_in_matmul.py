"""The LoRA added in a plain base matmul (`LoraSet.add_in_base_matmuls`): `addmm(b + h @ (s B)^T, x, W^T)` gives
the forward hook's values and gradients, in eager and compiled blocks; layers that are not a plain matmul keep
the hook, and `remove` gives the model back as it was."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ugpum.compute.base_compute import use_base_compute
from ugpum.compute.lora import attach_lora


class _Block(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.up, self.down = nn.Linear(24, 40, bias=bias), nn.Linear(40, 24, bias=bias)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _model(dtype=torch.float32, bias=True):
    torch.manual_seed(0)
    model = nn.Sequential(_Block(bias), _Block(bias)).to(dtype)
    lora = attach_lora(model, ["0.up", "0.down", "1.up"], rank=4, alpha=2.0, seed=3)
    for _, a in lora.items():                       # B starts at zero: give it values, so the LoRA counts
        nn.init.normal_(a.B, std=0.5)
    return model, lora


def _run(model, lora, dtype, compiled=False):
    x = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    fn = torch.compile(model, backend="inductor") if compiled else model
    y = fn(x)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = [a.A.grad.clone() for _, a in lora.items()] + [a.B.grad.clone() for _, a in lora.items()] + [x.grad]
    return y.detach().float(), [g.float() for g in grads]


@pytest.mark.parametrize("dtype, bias, compiled, tol", [(torch.float32, True, False, 1e-5),
                                                        (torch.float32, False, True, 1e-5),
                                                        (torch.bfloat16, True, False, 2e-2)])
def test_the_lora_in_the_matmul_gives_the_hooks_values_and_gradients(dtype, bias, compiled, tol):
    model, lora = _model(dtype, bias)
    want = _run(model, lora, dtype)
    model, lora = _model(dtype, bias)
    assert lora.add_in_base_matmuls(model) == 3
    assert type(model[0].up).__name__ == "LinearWithLora" and type(model[1].down) is nn.Linear   # (no LoRA there)
    got = _run(model, lora, dtype, compiled)
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]]):
        assert (g - w).norm() <= tol * w.norm()


def test_strength_still_scales_the_lora_and_remove_gives_the_model_back():
    model, lora = _model()
    x = torch.randn(3, 24)
    with_lora = model(x).detach()
    lora.set_strength(0.0)
    base = model(x).detach()
    keys = list(model.state_dict())
    lora.add_in_base_matmuls(model)
    assert list(model.state_dict()) == keys                      # the adapters are not the model's submodules
    torch.testing.assert_close(model(x), base)
    lora.set_strength(1.0)
    torch.testing.assert_close(model(x), with_lora)
    lora.remove()
    assert type(model[0].up) is nn.Linear and "_ugpum_lora" not in vars(model[0].up)
    torch.testing.assert_close(model(x), base)


def test_layers_that_are_not_a_plain_matmul_keep_the_hook():
    model, lora = _model()
    want = model(torch.ones(1, 24)).detach()
    model[0].up.weight_function = [lambda w: w * 2]              # ComfyUI patches this weight at every call
    model[0].down.comfy_cast_weights = True                      # ComfyUI casts this one
    use_base_compute(model, ["1.up"], "int8", log=lambda *_: None, emulate=True)
    assert lora.add_in_base_matmuls(model) == 0
    del model[0].up.weight_function, model[0].down.comfy_cast_weights
    assert (model(torch.ones(1, 24)) - want).abs().max() < 0.5   # (1.up in emulated int8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_under_autocast_the_layer_gives_the_hooks_values(dtype):
    """Autocast in the weights' dtype (bf16 training) adds in the matmul; in another dtype the hook's form runs."""
    model, lora = _model(dtype)
    layer, x = model[0].up, torch.ones(2, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x)
        lora.add_in_base_matmuls(model)
        got = layer(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_an_8bit_base_over_the_layer_takes_the_lora_back_to_its_hook():
    model, lora = _model()
    x = torch.randn(3, 24)
    want = model(x).detach()
    lora.add_in_base_matmuls(model)
    undo = use_base_compute(model, ["0.up", "0.down", "1.up"], "int8", log=lambda *_: None, emulate=True, keep="device")
    got = model(x)
    assert (got - want).norm() <= 0.05 * want.norm()            # the LoRA is there (B is not small: see _model)
    undo()
    torch.testing.assert_close(model(x), want)

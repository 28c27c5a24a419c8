"""Two Linears with a LoRA each (B drawn, so the LoRA counts): the small model the tests of the LoRA's compute paths
run, and the output and gradients they compare."""
from __future__ import annotations

import torch

from ugpum.compute.lora import attach_lora


def two_linears_with_lora():
    """(model, its LoraSet, an input): Linear 32 -> 48, GELU, Linear 48 -> 16, rank 4, alpha 2."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 16))
    lora = attach_lora(model, ["0", "2"], rank=4, alpha=2.0, seed=1)
    for _, a in lora.items():
        torch.nn.init.normal_(a.B, std=0.3)
    return model, lora, torch.randn(2, 20, 32)


def output_and_gradients(model, lora, x, compiled: bool, autocast: bool = False) -> list[torch.Tensor]:
    """The output (fp32) and the gradients of x, then of each adapter's A and B, of a weighted sum of the output;
    compiled with aot_eager (a fresh trace), under bf16 autocast where asked. The LoRA's gradients are cleared."""
    torch._dynamo.reset()
    xi = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = (torch.compile(model, backend="aot_eager") if compiled else model)(xi)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = [xi.grad] + [t.grad.clone() for _, a in lora.items() for t in (a.A, a.B)]
    for _, a in lora.items():
        a.A.grad = a.B.grad = None
    return [y.detach().float(), *grads]

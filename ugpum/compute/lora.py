"""LoRA adapters on a model's Linear layers, added as forward hooks (the base module is untouched).

Each adapter lives on its layer's device, keeps fp32 master weights, and adds
`(alpha / rank) * B(A(x))` to the layer's output. B starts at zero, so a fresh LoRA changes nothing.

The lean path (issue 16): per call, two kernels beyond the base matmul and no extra pass over the
activation or the output. `h = x @ A^T` reads the activation once (the [tokens, rank] result is tiny),
then ONE `addmm(out, h, B^T, alpha=scale)` does the second matmul, the scale and the residual add in the
GEMM's epilogue (before: matmul, matmul, mul, add, and two casts: every one a pass over
[tokens, out_features]). Autograd needs nothing cached: addmm's backward is two small GEMMs (grad_h =
scale * grad @ B, grad_B = scale * grad^T @ h) and the A matmul's backward the usual two; the masters
stay fp32 parameters (under autocast the casts to bf16 are autograd ops, so their gradients land in
fp32). Inside a block compiled by `ugpum.compute.compile`, the hook is traced into the block's graph (Dynamo
inlines module hooks of inbuilt nn.Modules) and the up-projection is a plain matmul instead: inductor adds it
into the kernel that next reads the layer's output, which the GPU measured cheaper than the addmm.
"""
from __future__ import annotations

import math

import torch
from torch import nn

# On CUDA, the up-projection added in one Triton pass by this op (`ugpum.compute.kernels.lora_up`, set by
# `kernels.turn_on`, which a CUDA run calls); None: the two-op forms below.
FUSED_UP_PROJECTION = None
# Compiled, the up-projection written as a sum over the rank (instead of FUSED_UP_PROJECTION's pass or a matmul),
# which inductor can compute inside the kernel that reads the layer's output: no [tokens, out] product written and
# read again. Off until a GPU run measures it (bench/cards.py --experiment lora-as-sum).
UP_PROJECTION_AS_SUM = False


class _UpProjectionAsSum(torch.autograd.Function):
    """h [M, r] @ b [N, r]^T in h's dtype, as a broadcast product summed over r (summed in fp32); backward the
    same two small matmuls as the matmul's."""

    @staticmethod
    def forward(ctx, h, b):
        ctx.save_for_backward(h, b)
        return (h.float().unsqueeze(-1) * b.float().t().unsqueeze(0)).sum(1).to(h.dtype)

    @staticmethod
    def backward(ctx, grad):
        h, b = ctx.saved_tensors
        return (grad @ b.to(grad.dtype)).to(h.dtype), (grad.t() @ h.to(grad.dtype)).to(b.dtype)


class LoraAdapter(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float,
                 device: torch.device, dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None):
        super().__init__()
        self.rank, self.alpha = rank, alpha
        a = torch.empty(rank, in_features, dtype=dtype)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)   # drawn on the CPU: same on any device
        self.A = nn.Parameter(a.to(device))
        self.B = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=dtype))
        self.strength = 1.0

    @property
    def scale(self) -> float:
        return self.strength * self.alpha / self.rank

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        compute = x.dtype if not torch.is_autocast_enabled(x.device.type) else None
        a = self.A if compute is None else self.A.to(compute)
        b = self.B if compute is None else self.B.to(compute)
        return (x @ a.t()) @ b.t() * self.scale

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out + scale * B(A(x))` in two kernels: x @ A^T, then one addmm (matmul, scale and add)."""
        autocast = torch.is_autocast_enabled(x.device.type)
        a = self.A if autocast or self.A.dtype == x.dtype else self.A.to(x.dtype)
        b = self.B if autocast or self.B.dtype == out.dtype else self.B.to(out.dtype)
        h = x.reshape(-1, x.shape[-1]) @ a.t()
        if not autocast and h.dtype != out.dtype:
            h = h.to(out.dtype)
        if UP_PROJECTION_AS_SUM and torch.compiler.is_compiling():
            return out + _UpProjectionAsSum.apply(h, b).view(out.shape) * self.scale
        if FUSED_UP_PROJECTION is not None and out.is_cuda:          # one pass over the output
            return FUSED_UP_PROJECTION(out.reshape(-1, out.shape[-1]), h, b.to(h.dtype), self.scale).view(out.shape)
        if torch.compiler.is_compiling():
            # Compiled, a plain matmul whose scale and add inductor fuses into the kernel that reads the layer's
            # output: addmm with a rank-16 K re-reads and rewrites the whole output (41.8 against 12 ms a step,
            # klein 9B on an H100, bench/results/README.md)
            return out + (h @ b.t()).view(out.shape) * self.scale
        y = torch.addmm(out.reshape(-1, out.shape[-1]), h, b.t(), alpha=self.scale)
        return y.view(out.shape)


class _Hook:
    """The forward hook of one adapter (a small object, not a lambda: it pickles and names itself)."""

    def __init__(self, adapter: LoraAdapter):
        self.adapter = adapter

    def __call__(self, module, args, out):
        if getattr(module, "ugpum_lora_in_kernel", None) is self.adapter and hasattr(type(module), "_ugpum_base_class"):
            return out                          # the 8-bit base's kernel added it (`LoraSet.hand_to_kernels`)
        return self.adapter.add_to(args[0], out)


class LoraSet(nn.Module):
    """All adapters of one model, keyed by the Linear's module path (ComfyUI's names)."""

    def __init__(self):
        super().__init__()
        self.adapters = nn.ModuleDict()
        self._paths: dict[str, str] = {}
        self._handles: list = []
        self._in_kernels: list[nn.Module] = []

    @staticmethod
    def _key(path: str) -> str:
        return path.replace(".", "__")          # ModuleDict keys may not contain dots

    def add(self, model: nn.Module, path: str, rank: int, alpha: float, dtype=torch.float32,
            generator: torch.Generator | None = None) -> LoraAdapter:
        layer = model.get_submodule(path)
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"LoRA target {path} is a {type(layer).__name__}, not a Linear")
        adapter = LoraAdapter(layer.in_features, layer.out_features, rank, alpha, layer.weight.device, dtype,
                              generator)
        self.adapters[self._key(path)] = adapter
        self._paths[self._key(path)] = path
        self._handles.append(layer.register_forward_hook(_Hook(adapter)))
        return adapter

    def items(self):
        for key, adapter in self.adapters.items():
            yield self._paths[key], adapter

    def set_strength(self, strength: float) -> None:
        for _, a in self.items():
            a.strength = strength

    def hand_to_kernels(self, model: nn.Module, takes) -> int:
        """Give each adapter to its layer where `takes(layer)` (`ugpum.compute.base_compute.takes_lora`: an 8-bit
        base whose kernel adds the up-projection in its epilogue, reading no [tokens, out] term); its hook stands
        aside there. Returns how many; `remove` takes them back."""
        for key, adapter in self.adapters.items():
            layer = model.get_submodule(self._paths[key])
            if takes(layer):
                layer.__dict__["ugpum_lora_in_kernel"] = adapter     # (not a submodule: the state dict is unchanged)
                self._in_kernels.append(layer)
        return len(self._in_kernels)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for layer in self._in_kernels:
            del layer.__dict__["ugpum_lora_in_kernel"]
        self._in_kernels.clear()

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        return {p: {"A": a.A.detach(), "B": a.B.detach(), "alpha": a.alpha} for p, a in self.items()}


def lora_targets(block_paths: list[str], linears_by_block: list[tuple], include: tuple[str, ...] = ()) -> list[str]:
    """Full module paths of every LoRA target; `include` filters by substring of the relative path."""
    out = []
    for block, linears in zip(block_paths, linears_by_block):
        for lin in linears:
            if not include or any(s in lin.path for s in include):
                out.append(f"{block}.{lin.path}")
    return out


def attach_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, dtype=torch.float32,
                seed: int = 0) -> LoraSet:
    """Freeze the model and add one adapter per target, each on its layer's device, initialised
    from `seed` (the same LoRA whatever the placement)."""
    for p in model.parameters():
        p.requires_grad_(False)
    lora = LoraSet()
    g = torch.Generator().manual_seed(seed)
    for path in targets:
        lora.add(model, path, rank, alpha, dtype, g)
    return lora

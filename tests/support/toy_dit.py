"""A plain-torch DiT in miniature: two block lists, shared per-step inputs (one in a dataclass),
an in-place residual like ComfyUI's blocks, and a tail module. No ComfyUI needed."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Mod:
    shift: torch.Tensor
    scale: torch.Tensor


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mod: Mod, pe):
        h = self.norm(x) * (1 + mod.scale) + mod.shift
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        attn = torch.softmax((q * pe) @ (k * pe).transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        return x + self.proj(attn)


class ToyDiT(nn.Module):
    def __init__(self, dim: int = 16, n_double: int = 3, n_single: int = 3):
        super().__init__()
        self.img_in = nn.Linear(8, dim)
        self.mod_in = nn.Linear(4, 2 * dim)
        self.double_blocks = nn.ModuleList(Block(dim) for _ in range(n_double))
        self.single_blocks = nn.ModuleList(Block(dim) for _ in range(n_single))
        self.final_layer = nn.Linear(dim, 8)

    def forward(self, x, t):
        h = self.img_in(x)
        shift, scale = self.mod_in(t).unsqueeze(1).chunk(2, dim=-1)
        mod = Mod(shift.detach(), scale.detach())     # shared, gradient-free per-step inputs
        pe = torch.cos(torch.arange(h.shape[-1], dtype=h.dtype, device=h.device))
        for block in self.double_blocks:
            h = block(h, mod=mod, pe=pe)
        for block in self.single_blocks:
            h = block(h, mod=mod, pe=pe)
        return self.final_layer(h)

    def block_paths(self) -> list[str]:
        return [f"double_blocks.{i}" for i in range(len(self.double_blocks))] + \
               [f"single_blocks.{i}" for i in range(len(self.single_blocks))]

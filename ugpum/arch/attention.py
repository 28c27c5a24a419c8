"""Attention while training: PyTorch's own scaled-dot-product kernel choice, whatever ComfyUI would pick.

ComfyUI's model classes call attention through `optimized_attention(q, k, v, heads, ...)`, which honours an
``optimized_attention_override`` in ``transformer_options`` (ComfyUI 0.3.75 and 0.33 alike). The stages pass
`torch_attention` there, for two reasons:

* speed: ComfyUI 0.33 wraps PyTorch's attention in ``sdpa_kernel([FLASH, CUDNN, ...], set_priority=True)`` on
  NVIDIA GPUs, where 0.3.75 (and the peers, diffusers included) leave the choice to PyTorch (each kernel's
  forward+backward at our shapes: bench/results/attention_backends_2026-12-07_h100.jsonl);
* autograd: a ComfyUI started with ``--use-sage-attention`` or another inference-only kernel would otherwise
  train through a kernel that has no backward.

Calls this function does not cover (a mask, grouped heads) go to ComfyUI's own function unchanged. Knows
ComfyUI's calling convention by its argument names only; nothing here imports ComfyUI.
"""
from __future__ import annotations

import torch.nn.functional as F

__all__ = ["torch_attention", "training_options"]


def torch_attention(comfy_attention, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                    skip_output_reshape=False, **kwargs):
    """ComfyUI's attention contract: q, k, v as [batch, tokens, heads * dim] (or [batch, heads, tokens, dim]
    with skip_reshape); the result as [batch, tokens, heads * dim] (or per head with skip_output_reshape)."""
    if mask is not None or kwargs.get("enable_gqa"):
        return comfy_attention(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                               skip_output_reshape=skip_output_reshape, **kwargs)
    if skip_reshape:
        batch, dim = q.shape[0], q.shape[-1]
    else:
        batch, dim = q.shape[0], q.shape[-1] // heads
        q, k, v = (t.view(batch, -1, heads, dim).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=kwargs.get("scale"))
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(batch, -1, heads * dim)


def training_options() -> dict:
    """The ``transformer_options`` a stage hands its blocks while training."""
    return {"optimized_attention_override": torch_attention}

"""Wan 2.1 text-to-video as ComfyUI builds it (`comfy.ldm.wan.model.WanModel`), its latent format, its
text encoder type and what ComfyUI's source must hold to load its text encoder (umT5-XXL)."""
from __future__ import annotations

from ..comfyui import ComfyModel

_WAN_TYPE = ("comfy/sd.py", r"^\s+WAN\s*=", "it has no Wan text encoder type (CLIPType.WAN)")


def wan_kwargs(spec, module) -> dict:
    """`WanModel`'s text-to-video configuration for a spec."""
    return dict(model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=spec.hidden,
                ffn_dim=spec.ffn, freq_dim=256, text_dim=spec.context_dim, out_dim=16, num_heads=spec.heads,
                num_layers=len(spec.blocks), window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)


COMFY = ComfyModel(
    module="comfy.ldm.wan.model", model_class="WanModel", kwargs=wan_kwargs, latent_format="Wan21", clip_type="WAN",
    text_encoders={"wan2.1-14b": ("umT5-XXL", (_WAN_TYPE,)), "wan2.1-1.3b": ("umT5-XXL", (_WAN_TYPE,))})

"""FLUX.2 as ComfyUI builds it (`comfy.ldm.flux.model.Flux` with the FLUX.2 switches, as
comfy/model_detection.py derives them), its latent format, its text encoder type and what ComfyUI's source
must hold to load each model's text encoder (FLUX.2 [klein]'s Qwen3 encoders arrived in ComfyUI in 2026)."""
from __future__ import annotations

import dataclasses

from ..comfyui import ComfyModel

_FLUX2_TYPE = ("comfy/sd.py", r"^\s+FLUX2\s*=", "it has no FLUX.2 text encoder type (CLIPType.FLUX2)")
_KLEIN_TE = ("comfy/text_encoders/flux.py", r"^def klein_te\b",
             "it predates FLUX.2 [klein]: no klein_te in comfy/text_encoders/flux.py")
_QWEN3_8B = ("comfy/sd.py", r"^\s+QWEN3_8B\s*=", "it cannot detect a Qwen3-8B file (no TEModel.QWEN3_8B)")
_FLUX2_TE = ("comfy/text_encoders/flux.py", r"^def flux2_te\b", "no flux2_te in comfy/text_encoders/flux.py")


def flux_kwargs(spec, module) -> dict:
    """`Flux`'s configuration for a spec, limited to the switches `module`'s FluxParams knows."""
    known = {f.name for f in dataclasses.fields(module.FluxParams)}
    config = dict(in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=spec.context_dim,
                  hidden_size=spec.hidden, mlp_ratio=3.0, num_heads=spec.heads,
                  depth=sum(b.kind == "double" for b in spec.blocks),
                  depth_single_blocks=sum(b.kind == "single" for b in spec.blocks),
                  axes_dim=[spec.head_dim // 4] * 4, theta=2000, patch_size=1, qkv_bias=False,
                  guidance_embed=spec.guidance, txt_ids_dims=[3], global_modulation=True, mlp_silu_act=True,
                  ops_bias=False, default_ref_method="index", ref_index_scale=10.0)
    return {k: v for k, v in config.items() if k in known}


COMFY = ComfyModel(
    module="comfy.ldm.flux.model", model_class="Flux", kwargs=flux_kwargs, latent_format="Flux2", clip_type="FLUX2",
    text_encoders={
        "flux2-klein-9b": ("Qwen3-8B", (_KLEIN_TE, _QWEN3_8B, _FLUX2_TYPE)),
        "flux2-klein-base-9b": ("Qwen3-8B", (_KLEIN_TE, _QWEN3_8B, _FLUX2_TYPE)),
        "flux2-klein-4b": ("Qwen3-4B", (_KLEIN_TE, _FLUX2_TYPE)),
        "flux2-klein-base-4b": ("Qwen3-4B", (_KLEIN_TE, _FLUX2_TYPE)),
        "flux2-dev": ("Mistral Small 3 24B", (_FLUX2_TYPE, _FLUX2_TE)),
    })

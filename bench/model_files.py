"""Full-size model files with random weights, in the layouts real checkpoints have (no weights can be downloaded
here): what every GPU case of bench/session.sh trains on.

    python bench/model_files.py dit --model flux2-klein-9b --path /tmp/k9.safetensors [--dtype bf16|fp8]
    COMFYUI_PATH=<ComfyUI 0.33> python bench/model_files.py klein-folder MODELS_DIR [--only dit,te,vae]

`dit`: one DiT of any catalogued model as a ComfyUI checkpoint holds it ('model.diffusion_model.' keys, FLUX.2's
q/k norms as '.scale'), shapes from ComfyUI's own module built on the meta device; `--dtype fp8` stores matrices
as float8_e4m3fn and vectors in bf16, as fp8 DiT files do. `klein-folder`: FLUX.2 [klein] 9B's three files in a
ComfyUI models folder, under the names `ugpum download klein-9b-1024` uses, so the stock loaders and UGPUM's find
them: the base DiT (bare keys, 16.9 GiB; hard-linked as the distilled name the workflow renders with), Qwen3-8B
as ComfyUI's CLIPLoader detects it for klein (matrices plain float8_e4m3fn, embeddings and norms bf16: 8.6 GiB;
named as the scaled "fp8mixed" file so the Loader's checks and the workflows match) and ComfyUI's FLUX.2 VAE.
Tensors are made one at a time on the GPU (else the CPU) and streamed to the file, fan-in scaled so
activations stay finite.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ugpum.formats.safetensors_writer import write_streaming  # noqa: E402

GIB = 1024 ** 3
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
KLEIN_FILES = {"dit": "diffusion_models/flux-2-klein-base-9b.safetensors",
               "te": "text_encoders/qwen_3_8b_fp8mixed.safetensors", "vae": "vae/flux2-vae.safetensors"}
KLEIN_DISTILLED = "diffusion_models/flux-2-klein-9b.safetensors"


def random_maker(seed: int):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(seed)

    def make(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        r = torch.randn(shape, generator=gen, device=dev)
        if len(shape) >= 2 and "embed_tokens" not in name:
            r = r / math.sqrt(math.prod(shape[1:]))
        elif "norm" in name or name.endswith(".scale"):
            r = 1 + 0.1 * r
        else:
            r = 0.02 * r                                          # biases, modulation tables
        return r.to(dtype)
    return make


def dit_shapes(model_id: str, dtype: torch.dtype, prefix: str = "") -> dict:
    from comfy_bridge import build_meta
    from ugpum.arch import get_spec
    shapes = {}
    for key, value in build_meta(get_spec(model_id), torch.bfloat16).state_dict().items():
        if key.endswith(("query_norm.weight", "key_norm.weight")):          # FLUX.2 files say '.scale'
            key = key[: -len("weight")] + "scale"
        shape = tuple(value.shape)
        shapes[prefix + key] = (shape, dtype if len(shape) >= 2 or dtype != torch.float8_e4m3fn else torch.bfloat16)
    return shapes


def qwen3_8b_shapes() -> dict:
    """Qwen3-8B (comfy.text_encoders.llama.Qwen3_8BConfig) under the HF key names ComfyUI's Llama2 reads."""
    from comfy.text_encoders.llama import Qwen3_8BConfig
    c = Qwen3_8BConfig()
    h, hd = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    shapes = {"model.embed_tokens.weight": ((c.vocab_size, h), bf16), "model.norm.weight": ((h,), bf16)}
    per_layer = {"input_layernorm.weight": ((h,), bf16), "post_attention_layernorm.weight": ((h,), bf16),
                 "self_attn.q_proj.weight": ((q, h), fp8), "self_attn.k_proj.weight": ((kv, h), fp8),
                 "self_attn.v_proj.weight": ((kv, h), fp8), "self_attn.o_proj.weight": ((h, q), fp8),
                 "self_attn.q_norm.weight": ((hd,), bf16), "self_attn.k_norm.weight": ((hd,), bf16),
                 "mlp.gate_proj.weight": ((c.intermediate_size, h), fp8),
                 "mlp.up_proj.weight": ((c.intermediate_size, h), fp8),
                 "mlp.down_proj.weight": ((h, c.intermediate_size), fp8)}
    for i in range(c.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def write_flux2_vae(path: Path) -> None:
    """ComfyUI's own FLUX.2 VAE module (its config as comfy.sd.VAE derives it), with set values, saved."""
    from comfy.ldm.models.autoencoder import AutoencoderKL
    ddconfig = {"double_z": True, "z_channels": 32, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
                "batch_norm_latent": True}
    state = {}
    g = torch.Generator().manual_seed(0)
    for key, v in AutoencoderKL(ddconfig=ddconfig, embed_dim=32).state_dict().items():   # ComfyUI skips init
        if v.dim() >= 2 and v.is_floating_point():
            v = torch.randn(v.shape, generator=g) / math.sqrt(math.prod(v.shape[1:]))
        elif key == "bn.running_var" or ("norm" in key and key.endswith("weight")):
            v = torch.ones_like(v)
        else:
            v = torch.zeros_like(v)                               # biases, running means, counters
        state[key] = v
    shapes = {k: (tuple(v.shape), torch.float32 if v.is_floating_point() else v.dtype) for k, v in state.items()}
    write_streaming(path, shapes, lambda name, shape, dtype: state[name])


def timed_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    write(path)
    print(f"wrote {path} ({path.stat().st_size / GIB:.2f} GiB) in {time.time() - started:.1f} s", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    dit = sub.add_parser("dit", help="one DiT file, ComfyUI checkpoint keys")
    dit.add_argument("--model", required=True, help="a catalogued model id (ugpum download --list)")
    dit.add_argument("--path", type=Path, required=True)
    dit.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    folder = sub.add_parser("klein-folder", help="klein 9B's DiT, text encoder and VAE in a ComfyUI models folder")
    folder.add_argument("models", type=Path)
    folder.add_argument("--only", default="dit,te,vae")
    a = p.parse_args(argv)
    from comfy_bridge import find_comfyui_or_raise, import_comfy
    import_comfy(find_comfyui_or_raise(), cpu=not torch.cuda.is_available())
    if a.what == "dit":
        shapes = dit_shapes(a.model, DTYPES[a.dtype], "model.diffusion_model.")
        timed_write(a.path, lambda path: write_streaming(path, shapes, random_maker(0)))
        return 0
    for part in a.only.split(","):
        path = a.models / KLEIN_FILES[part]
        if part == "vae":
            timed_write(path, write_flux2_vae)
        else:
            shapes = dit_shapes("flux2-klein-9b", torch.bfloat16) if part == "dit" else qwen3_8b_shapes()
            timed_write(path, lambda path: write_streaming(path, shapes, random_maker(0 if part == "dit" else 1)))
        if part == "dit":
            (a.models / KLEIN_DISTILLED).unlink(missing_ok=True)
            os.link(path, a.models / KLEIN_DISTILLED)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

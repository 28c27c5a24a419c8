"""GPU check for caption caching with a split text encoder (issue 8): FLUX.2 [dev]'s Mistral Small 3.x
24B text encoder, built from ComfyUI's own classes at full size with random bf16 weights, encodes
captions whole on one GPU, then split over GPUs whose budgets are set as if they were smaller cards;
the embeddings (layers 10/20/30) are compared, the time per caption and each device's allocator peak
recorded against the split's forecast, and the encoder must leave every GPU when the split ends.

  python bench/text_encoder_split.py --devices cuda:0,cuda:1 --budget-gib 24 \
      --out bench/results/te_split_mistral24b.json        # two GPUs (45.8 GB model, ~50 GB host RAM)
  python bench/text_encoder_split.py --devices cuda:0,cuda:0 --budget-gib 24     # one GPU, two stages
  python bench/text_encoder_split.py --size tiny --devices cpu,cpu               # CPU, tiny width

The whole encoder needs one device that holds it (an H200 does) for the reference.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from comfy_bridge import find_comfyui_or_raise, import_comfy  # noqa: E402
from ugpum.planning.plan import GIB  # noqa: E402
from ugpum.planning.text_encoder_split import EncoderSizes, Slot, split_text_encoder  # noqa: E402

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1)


def build(size: str, device: str, seed: int = 0):
    """ComfyUI's FLUX.2 [dev] text encoder (Flux2TEModel, all 40 Mistral layers) with random weights
    and its CLIP object; `device` is where it is built and where ComfyUI runs it whole."""
    import comfy.model_patcher
    import comfy.sd
    import comfy.text_encoders.flux as flux
    options = {"mistral3_24b_model_config": dict(TINY, num_hidden_layers=40)} if size == "tiny" else {}
    dtype = torch.float32 if size == "tiny" else torch.bfloat16
    te = flux.Flux2TEModel(device=device, dtype=dtype, model_options=options)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in te.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
            else:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1, generator=g)
    clip = comfy.sd.CLIP(no_init=True)              # the real class; no tokenizer (token ids below)
    dev = torch.device(device)
    clip.cond_stage_model = te
    clip.patcher = comfy.model_patcher.ModelPatcher(te, load_device=dev, offload_device=torch.device("cpu"))
    clip.tokenizer, clip.layer_idx, clip.tokenizer_options = None, None, {}
    clip.use_clip_schedule, clip.apply_hooks_to_conds = False, None
    return clip, te


def captions(count: int, length: int, vocab: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"mistral3_24b": [[(1, 1.0)] + [(int(t), 1.0) for t in torch.randint(2, vocab, (length,), generator=g)]]}
            for _ in range(count)]


def sync(devices) -> None:
    for d in {torch.device(x) for x in devices}:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def encode_all(clip, tokens, devices) -> tuple[list[torch.Tensor], float]:
    out = [clip.encode_from_tokens(tokens[0]).float().cpu()]          # warm-up, not timed
    sync(devices)
    t0 = time.perf_counter()
    out += [clip.encode_from_tokens(t).float().cpu() for t in tokens[1:]]
    sync(devices)
    return out, (time.perf_counter() - t0) / max(len(tokens) - 1, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=["full", "tiny"], default="full")
    ap.add_argument("--devices", default="cuda:0,cuda:1", help="the split's devices, in order (home first)")
    ap.add_argument("--budget-gib", type=float, default=24.0, help="budget of each device (full size)")
    ap.add_argument("--captions", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--out", help="write the results as JSON")
    args = ap.parse_args()
    devices = [d.strip() for d in args.devices.split(",")]
    import_comfy(find_comfyui_or_raise(), cpu=not torch.cuda.is_available())
    import comfy.model_management as mm

    clip, te = build(args.size, devices[0])
    sizes = EncoderSizes.from_module(te, tokens=args.tokens)
    tokens = captions(args.captions, args.tokens, 300 if args.size == "tiny" else 131072)
    whole, whole_s = encode_all(clip, tokens, devices[:1])
    mm.unload_all_models()
    te.to("cpu")                                    # where ComfyUI keeps an encoder it has unloaded
    mm.soft_empty_cache()

    if args.size == "tiny":                         # the first device holds about half the layers
        half = sizes.rest_bytes + sum(sizes.layer_bytes[:20]) + sizes.working_bytes(20)
        budgets = [half] + [100 * sizes.total_bytes] * (len(devices) - 1)
    else:
        budgets = [args.budget_gib * GIB] * len(devices)
    slots = [Slot(f"{d} as {b / GIB:.1f} GiB", d, b) for d, b in zip(devices, budgets)]
    cuda = sorted({d for d in devices if d.startswith("cuda")})
    for d in cuda:
        torch.cuda.reset_peak_memory_stats(d)
    with split_text_encoder(clip, [], tokens=args.tokens, slots=slots) as te_plan:
        split, split_s = encode_all(clip, tokens, devices)
    peaks = {d: torch.cuda.max_memory_allocated(d) / GIB for d in cuda}
    left = {d: torch.cuda.memory_allocated(d) / GIB for d in cuda}

    err = max(((a - b).norm() / b.norm()).item() for a, b in zip(split, whole))
    result = dict(size=args.size, total_gib=sizes.total_bytes / GIB, mode=te_plan.mode,
                  plan=te_plan.summary(), stages=[dict(device=s.torch_device, layers=s.layers,
                                                       forecast_gib=s.forecast_bytes / GIB) for s in te_plan.stages],
                  whole_s_per_caption=whole_s, split_s_per_caption=split_s, max_relative_error=err,
                  peak_gib=peaks, left_on_gpus_gib=left, cond_shape=list(whole[0].shape),
                  params_on=sorted({str(p.device) for p in te.parameters()}),
                  hooks_left=sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in te.modules()))
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    ok = te_plan.mode == "split" and err < 1e-2 and result["hooks_left"] == 0 and result["params_on"] == ["cpu"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

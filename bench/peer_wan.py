"""A Wan 2.1 14B peer for speed rows (issue 41 item 6): what a user of diffusers and PEFT would write to train a
LoRA on Wan's transformer, timed on one GPU beside our CLI in the same device call.

    python bench/peer_wan.py --out OUT/speed.jsonl --call LABEL [--width 640 --height 640 --frames 17]

diffusers' WanTransformer3DModel at Wan 2.1 T2V 14B's size (40 blocks, width 5120, 40 heads, ffn 13824), random
bf16 weights, frozen; PEFT LoRA (rank 32, alpha 32, fp32 adapter weights) on every Linear inside the blocks;
diffusers' gradient checkpointing per block; each block `.compile()`d; bf16 autocast; MSE against a random
target; AdamW (lr 1e-4) on the LoRA alone; batch 1, one clip of `--frames` frames at width x height (latents
16 x (1 + (frames-1)/4) x height/8 x width/8, 512 text tokens). Median of `--steps` steps after the compile
step and `--warm` more. Rows carry the token count, so they can be set beside ours at the same count.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cards import Clock  # noqa: E402  (SM clock and power while the steps run)


def build(rank: int):
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig, inject_adapter_in_model
    with torch.device("cuda"):
        model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
                                      in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
                                      num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                      eps=1e-6).to(torch.bfloat16)
    model.requires_grad_(False)
    model.enable_gradient_checkpointing()
    model.train()
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("blocks.")]
    model = inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=linears), model)
    trained = []
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
            p.requires_grad_(True)
            trained.append(p)
    return model, trained


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON lines file the row is appended to")
    p.add_argument("--call", required=True, help="which GPU run the row belongs to (the same as our rows')")
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=640)
    p.add_argument("--frames", type=int, default=17)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warm", type=int, default=2)
    a = p.parse_args(argv)
    model, trained = build(a.rank)
    latent_frames = 1 + (a.frames - 1) // 4
    x = torch.randn(1, 16, latent_frames, a.height // 8, a.width // 8, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 1000, (1,), device="cuda")
    target = torch.randn_like(x, dtype=torch.float32)
    optimizer = torch.optim.AdamW(trained, lr=1e-4)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        torch.nn.functional.mse_loss(y.float(), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for block in model.blocks:
        block.compile()
    times = []
    for _ in range(1 + a.warm + a.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if len(times) == 1 + a.warm:
            torch.cuda.reset_peak_memory_stats()
            clock = Clock()
    timed = times[1 + a.warm:]
    row = {"model": "wan2.1-14b", "impl": "peer_wan", "mode": "bf16", "compiled": True,
           "s_per_step": round(statistics.median(timed), 4), "first_step_s": round(times[0], 2),
           "step_times": [round(s, 4) for s in times], "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "shape": [a.width, a.height, a.frames], "tokens": latent_frames * (a.height // 16) * (a.width // 16),
           "rank": a.rank, "lora_params": sum(p.numel() for p in trained), "call": a.call,
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, **clock.stop()}
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

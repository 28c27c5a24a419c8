"""Which of PyTorch's attention kernels trains fastest at our shapes (issue 41): forward+backward of
scaled_dot_product_attention with each backend forced, and torch's own default choice, on one GPU.

    python bench/attention_backends.py --rows OUT/attention.jsonl

Shapes: klein 9B at 1024² (32 heads, 4096 + 512 tokens), FLUX.2 [dev] at 1024² (48 heads), Wan 2.1 14B at
832x480 x 17 frames (40 heads, 7800 tokens); bf16, head size 128, batch 1, random inputs. ComfyUI 0.33's
`comfy.ops.scaled_dot_product_attention` asks for flash attention first on NVIDIA (0.3.75 left the choice to
torch); this measures what that choice costs. One JSON row per shape and backend.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"klein-9b-1024": (32, 4608), "flux2-dev-1024": (48, 4608), "wan14b-832x480x17": (40, 7800)}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def time_ms(fn, repeats: int = 20) -> float:
    """Median of `repeats` timed calls (CUDA events), after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", required=True, help="JSON lines file the rows are appended to")
    a = p.parse_args(argv)
    for label, (heads, tokens) in SHAPES.items():
        q, k, v = (torch.randn(1, heads, tokens, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)
        flop = 4 * tokens * tokens * 128 * heads * 3.5          # forward 2 matmuls, backward 2.5x the forward
        default = int(torch._fused_sdp_choice(q, k, v))
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for name, backend in [("default", None), *BACKENDS.items()]:
            def step():
                out = F.scaled_dot_product_attention(q, k, v)
                out.backward(grad)
            try:
                with sdpa_kernel([backend]) if backend is not None else torch.enable_grad():
                    ms = time_ms(step)
                    out = F.scaled_dot_product_attention(q, k, v)
                error = ((out.float() - reference).norm() / reference.norm()).item()
                row = {"shape": label, "backend": name, "ms_fwd_bwd": round(ms, 3),
                       "tflops": round(flop / ms / 1e9, 1), "rel_error": round(error, 5)}
            except RuntimeError as err:
                row = {"shape": label, "backend": name, "error": str(err).splitlines()[0][:200]}
            row.update(default_choice={int(v): n for n, v in SDPBackend.__members__.items()}.get(default, default),
                       gpu=torch.cuda.get_device_name(0), torch=torch.__version__)
            print(json.dumps(row), flush=True)
            with open(a.rows, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

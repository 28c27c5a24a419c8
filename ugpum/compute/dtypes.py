"""Weight dtypes by name: the one table the config, the planner, the loader node and placement share."""
from __future__ import annotations

import torch

# what a base weight is built and streamed as during training
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}
TRAINING_DTYPES = tuple(TORCH_DTYPES)


def training_dtype(stored: str) -> str:
    """The dtype a file stored as `stored` trains in: fp16 files train in bf16 (fp16 overflows in
    the residual stream of these models); the rest as stored."""
    return "bf16" if stored == "fp16" else stored


def bf16_autocast(enabled: bool, weight_dtype: str, device) -> torch.autocast:
    """bf16 autocast as training computes the DiT: on CUDA, and on the CPU for bf16 weights (they would
    meet fp32 inputs there; ComfyUI's ops cast fp8 weights to the input's dtype themselves)."""
    kind = torch.device(device).type
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=enabled and (kind == "cuda" or weight_dtype == "bf16"))

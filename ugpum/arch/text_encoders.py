"""The text encoders the DiTs are trained with, as the planner sees them: layers and their sizes.

Captions are encoded once, before training, and cached (ugpum/train/cache.py). A text encoder that
is larger than one GPU is then split over the GPUs for that step (ugpum/planning/text_encoder_split.py), so
the forecast needs its size per layer. Sizes are computed from the configurations ComfyUI builds
the encoders with (what actually sits in memory), not from file sizes:

- Qwen3-4B / Qwen3-8B (FLUX.2 [klein] 4B / 9B) and Mistral Small 3.x 24B (FLUX.2 [dev]):
  ``Qwen3_4BConfig``, ``Qwen3_8BConfig``, ``Mistral3Small24BConfig`` in ComfyUI's
  comfy/text_encoders/llama.py (0.33, mirrored as yzkee/ComfyUI). Qwen3-4B ties its output head to
  the embedding (no ``lm_head``), Qwen3-8B builds one, Mistral builds none. This gives 4.02 B
  parameters (8.0 GB bf16) for Qwen3-4B and 8.19 B (16.4 GB) for Qwen3-8B, matching the "4.0B"
  and "8.2B" on the Qwen3-4B / Qwen3-8B model cards (huggingface.co/Qwen). Mistral comes to
  22.9 B (45.8 GB): the 40 text layers without the vision tower and LM head; the ~48 GB quoted
  for FLUX.2 [dev]'s text encoder (e.g. vllm-project/vllm-omni pull request 1629) is the whole
  Mistral Small 3.x 24B checkpoint.
- umT5-XXL (Wan 2.1): comfy/text_encoders/umt5_config_xxl.json (encoder only, as ComfyUI's
  comfy/text_encoders/t5.py builds it; umT5 gives every layer its own relative position bias):
  5.68 B parameters, 11.4 GB bf16.

A file stored in fp8 keeps its layers' Linear weights in fp8 (ComfyUI casts them per call), its
embeddings and norms in 16 bits: umT5-XXL then comes to 6.7 GB, as umt5_xxl_fp8_e4m3fn_scaled is.
"""
from __future__ import annotations

from dataclasses import dataclass

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


@dataclass(frozen=True)
class TextEncoderArch:
    id: str
    title: str
    kind: str                   # "llama": decoder layers at model.layers; "t5": encoder.block
    layers: int
    hidden: int
    ffn: int                    # MLP inner width (gated: two input projections)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    lm_head: bool = False       # an output head ComfyUI builds beside the embedding
    qk_norm: bool = False       # Qwen3: RMSNorm on queries and keys per head
    tokens: int = 512           # what a caption is padded to (the FLUX.2 context; umT5's min length)

    def layer_params(self) -> int:
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.ffn                         # gated: gate, up, down
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        bias = 32 * self.heads if self.kind == "t5" else 0       # relative position buckets
        return attention + mlp + norms + bias

    def linear_params(self) -> int:
        """Per layer, the parameters in Linear weights (what an fp8 file stores in 8 bits)."""
        return 2 * self.hidden * (self.heads + self.kv_heads) * self.head_dim + 3 * self.hidden * self.ffn

    def other_params(self) -> int:
        """Embedding (+ output head) and final norm: they stay with the first device."""
        return self.vocab * self.hidden * (2 if self.lm_head else 1) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params() + self.other_params()

    def layer_bytes(self, dtype: str) -> int:
        linear = self.linear_params()
        return linear * BYTES[dtype] + (self.layer_params() - linear) * max(BYTES[dtype], 2)

    def other_bytes(self, dtype: str) -> int:
        return self.other_params() * max(BYTES[dtype], 2)

    def total_bytes(self, dtype: str) -> int:
        return self.layers * self.layer_bytes(dtype) + self.other_bytes(dtype)


ARCHS: dict[str, TextEncoderArch] = {a.id: a for a in (
    TextEncoderArch("qwen3-4b", "Qwen3-4B", "llama", layers=36, hidden=2560, ffn=9728, heads=32, kv_heads=8,
                    head_dim=128, vocab=151936, qk_norm=True),
    TextEncoderArch("qwen3-8b", "Qwen3-8B", "llama", layers=36, hidden=4096, ffn=12288, heads=32, kv_heads=8,
                    head_dim=128, vocab=151936, lm_head=True, qk_norm=True),
    TextEncoderArch("mistral-small-3-24b", "Mistral Small 3.x 24B", "llama", layers=40, hidden=5120, ffn=32768,
                    heads=32, kv_heads=8, head_dim=128, vocab=131072),
    TextEncoderArch("umt5-xxl", "umT5-XXL", "t5", layers=24, hidden=4096, ffn=10240, heads=64, kv_heads=64,
                    head_dim=64, vocab=256384),
)}

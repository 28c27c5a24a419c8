"""The Wan 2.1 text-to-video models (1.3B, 14B) the planner knows by id, and any other Wan size
recognised from a checkpoint's header: their blocks and sizes in ComfyUI's module layout."""
from __future__ import annotations

from ..base import BlockSpec, LinearSpec
from ..header import count_blocks
from .spec import FREQ_DIM, MODULATIONS, WanSpec

NAME = "wan"
TEXT_DIM = 4096

# id: (dim, blocks, ffn, text dim, head dim, title)
VARIANTS = {
    "wan2.1-1.3b": (1536, 30, 8960, TEXT_DIM, 128, "Wan2.1-T2V-1.3B"),
    "wan2.1-14b": (5120, 40, 13824, TEXT_DIM, 128, "Wan2.1-T2V-14B"),
    "tiny-wan": (64, 3, 128, 96, 16, "Wan2.1-tiny"),
}


def _linears(d: int, f: int) -> tuple[LinearSpec, ...]:
    attn = tuple(LinearSpec(f"{a}.{p}", d, d) for a in ("self_attn", "cross_attn") for p in "qkvo")
    return attn + (LinearSpec("ffn.0", d, f), LinearSpec("ffn.2", f, d))


def make_spec(id: str, dim: int, blocks: int, ffn: int, text_dim: int, head_dim: int, title: str,
              in_dim: int = 16, notes: tuple[str, ...] = ()) -> WanSpec:
    lin = _linears(dim, ffn)
    weights = sum(l.in_features * l.out_features for l in lin)
    biases = sum(l.out_features for l in lin)
    norms = 2 * dim * 2 + 2 * dim                            # q/k RMSNorms of both attentions, norm3
    block_params = weights + biases + norms + 6 * dim         # + per-block modulation table
    specs = tuple(BlockSpec(f"blocks.{i}", "wan", block_params, lin) for i in range(blocks))
    patch = in_dim * 4 * dim + dim                            # Conv3d with a (1, 2, 2) kernel
    head = patch + (text_dim * dim + dim * dim) + (FREQ_DIM * dim + dim * dim) + dim * MODULATIONS * dim
    tail = dim * 4 * in_dim + 2 * dim                         # head.head + head.modulation
    return WanSpec(id=id, family=NAME, title=title, hidden=dim, heads=dim // head_dim, blocks=specs,
                   head_params=head, tail_params=tail, context_dim=text_dim, ffn=ffn, tail_modules=("head",),
                   timestep_scale=1000.0, stream_bytes=4, notes=notes)


def spec(id: str) -> WanSpec:
    dim, blocks, ffn, text_dim, head_dim, title = VARIANTS[id]
    return make_spec(id, dim, blocks, ffn, text_dim, head_dim, title)


def recognise(shapes: dict[str, tuple[int, ...]], filename: str = "") -> WanSpec | None:
    """Wan 2.1 from its state-dict shapes (prefix already stripped), or None if not Wan."""
    if "head.modulation" not in shapes or "blocks.0.ffn.0.weight" not in shapes:
        return None
    dim = shapes["head.modulation"][-1]
    ffn = shapes["blocks.0.ffn.0.weight"][0]
    blocks = count_blocks(shapes, "blocks.")
    text_dim = shapes["text_embedding.0.weight"][1]
    in_dim = shapes["patch_embedding.weight"][1]
    head_dim = 128 if dim % 128 == 0 else VARIANTS["tiny-wan"][4]  # ComfyUI: heads = dim // 128
    for id, (d, b, f, t, hd, title) in VARIANTS.items():
        if (d, b, f, t) == (dim, blocks, ffn, text_dim):
            return make_spec(id, d, b, f, t, hd, title, in_dim)
    return make_spec("wan-custom", dim, blocks, ffn, text_dim, head_dim, "Wan2.1-custom", in_dim, notes=("unknown Wan size: planned from its shapes",))

"""The FLUX.2 models ([klein] 4B/9B, base and distilled, and [dev]) the planner knows by id, and any
other FLUX.2 size recognised from a checkpoint's header: their blocks and sizes in ComfyUI's module
layout."""
from __future__ import annotations

from ..base import BlockSpec, LinearSpec
from ..header import count_blocks
from .spec import MODULATIONS, TIME_DIM, Flux2Spec

NAME = "flux2"
MLP_RATIO = 3

# id: (hidden, double blocks, single blocks, context dim, guidance embedding, distilled, title)
VARIANTS = {
    "flux2-klein-4b": (3072, 5, 20, 7680, False, True, "Flux.2-klein-4b"),
    "flux2-klein-9b": (4096, 8, 24, 12288, False, True, "Flux.2-klein-9b"),
    "flux2-klein-base-4b": (3072, 5, 20, 7680, False, False, "Flux.2-klein-base-4b"),
    "flux2-klein-base-9b": (4096, 8, 24, 12288, False, False, "Flux.2-klein-base-9b"),
    "flux2-dev": (6144, 8, 48, 15360, True, False, "Flux.2-dev"),
    # for tests: the same code paths at a size that trains on a CPU in seconds
    "tiny-flux2": (64, 2, 3, 96, False, True, "Flux.2-tiny"),
    "tiny-flux2-dev": (64, 2, 3, 96, True, False, "Flux.2-dev-tiny"),     # with the guidance embedder
}
TINY_HEAD_DIM = 16


def _double_linears(h: int) -> tuple[LinearSpec, ...]:
    m = MLP_RATIO * h
    out = []
    for stream in ("img", "txt"):
        out += [
            LinearSpec(f"{stream}_attn.qkv", h, 3 * h),
            LinearSpec(f"{stream}_attn.proj", h, h),
            LinearSpec(f"{stream}_mlp.0", h, 2 * m),   # gate and value of the SwiGLU, fused
            LinearSpec(f"{stream}_mlp.2", m, h),
        ]
    return tuple(out)


def _single_linears(h: int) -> tuple[LinearSpec, ...]:
    m = MLP_RATIO * h
    return (LinearSpec("linear1", h, 3 * h + 2 * m), LinearSpec("linear2", h + m, h))


def make_spec(id: str, hidden: int, double: int, single: int, context_dim: int, guidance: bool,
              distilled: bool, title: str, head_dim: int = 128, notes: tuple[str, ...] = ()) -> Flux2Spec:
    h = hidden
    qk_norm = 2 * head_dim                                   # query/key RMSNorm scales per attention
    dl, sl = _double_linears(h), _single_linears(h)
    double_params = sum(l.in_features * l.out_features for l in dl) + 2 * qk_norm
    single_params = sum(l.in_features * l.out_features for l in sl) + qk_norm
    blocks = tuple(BlockSpec(f"double_blocks.{i}", "double", double_params, dl) for i in range(double))
    blocks += tuple(BlockSpec(f"single_blocks.{i}", "single", single_params, sl) for i in range(single))
    in_channels = 128
    embed = TIME_DIM * h + h * h                              # time_in (an MLP embedder)
    head = in_channels * h + context_dim * h + embed + MODULATIONS * h * h  # img_in, txt_in, modulations
    if guidance:
        head += embed
    tail = h * 2 * h + h * in_channels                        # final_layer: adaLN + linear
    return Flux2Spec(id=id, family=NAME, title=title, hidden=h, heads=h // head_dim, blocks=blocks,
                     head_params=head, tail_params=tail, context_dim=context_dim, guidance=guidance,
                     distilled=distilled, tail_modules=("final_layer",), notes=notes)


def spec(id: str) -> Flux2Spec:
    hidden, double, single, ctx, guidance, distilled, title = VARIANTS[id]
    head_dim = TINY_HEAD_DIM if id.startswith("tiny") else 128
    return make_spec(id, hidden, double, single, ctx, guidance, distilled, title, head_dim)


def recognise(shapes: dict[str, tuple[int, ...]], filename: str = "") -> Flux2Spec | None:
    """FLUX.2 from its state-dict shapes (prefix already stripped), or None if not FLUX.2."""
    if "double_stream_modulation_img.lin.weight" not in shapes or "img_in.weight" not in shapes:
        return None
    hidden = shapes["img_in.weight"][0]
    context_dim = shapes["txt_in.weight"][1]
    double = count_blocks(shapes, "double_blocks.")
    single = count_blocks(shapes, "single_blocks.")
    guidance = any(k.startswith("guidance_in.") for k in shapes)
    query_norm = "double_blocks.0.img_attn.norm.query_norm."         # files: .scale; ComfyUI 0.33: .weight
    head_dim = (shapes.get(query_norm + "scale") or shapes.get(query_norm + "weight") or (128,))[0]
    base = "base" in filename.lower()
    for id, (h, d, s, c, g, distilled, title) in VARIANTS.items():
        if (h, d, s, c, g) == (hidden, double, single, context_dim, guidance):
            if id.startswith("flux2-klein") and ("base" in id) != base:
                continue                     # base and distilled klein differ only in their weights
            return make_spec(id, h, d, s, c, g, distilled, title, head_dim)
    return make_spec("flux2-custom", hidden, double, single, context_dim, guidance, not guidance,
                     "Flux.2-custom", head_dim, notes=("unknown FLUX.2 size: planned from its shapes",))

"""One pipeline stage of a ComfyUI DiT as a module of its own: what `torch.distributed.pipelining`
runs on a rank (one stage per rank, or two: `schedules.py`).

ComfyUI's `Flux.forward` and `WanModel.forward` are one loop over all blocks with glue around it
(patchify, RoPE tables, the timestep's modulation computed once and shared by every block), so a
stage cannot be "blocks[a:b]" alone. A stage here is `blocks[a:b]` of the model's own modules with
that glue: the first stage embeds the input, the last one runs the final layer and gives the
model's output (the loss is taken from it by the caller, as `ugpum.diffusion.flow.flow_loss`).

What travels between stages is only what carries a gradient, the hidden state: FLUX.2's image and
text streams while inside the double blocks, the joined single stream after them; Wan's `x`. What
every block also needs and no LoRA parameter influences (RoPE `pe`, the modulation `vec`, Wan's
`e0` and embedded text) is recomputed on each stage from the micro-batch's inputs (every rank holds
the micro-batch: the latent, timestep and text context), so nothing without a gradient crosses a
link and the schedules see plain tensors. The cost: each stage keeps the small embedders that make
them (FLUX.2: time_in and the three modulations; Wan: time and text embedding), see `needed`.

The model's layout is known by attribute names only (as `ugpum.arch` knows it); the few ComfyUI
functions the glue needs (`timestep_embedding`, `sinusoidal_embedding_1d`, `pad_to_patch_size`) are
taken from the model's own module, so the stage always runs the installed ComfyUI's code.
`tests/test_distributed.py` checks stage chains against the model's own forward (loss and LoRA
gradients, fp32, 1e-6).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from ..dtypes import bf16_autocast


@dataclass(frozen=True)
class StageRange:
    """Blocks [start, end) of the spec's block order (FLUX.2: double blocks, then single blocks)."""
    start: int
    end: int
    first: bool
    last: bool


def stage_ranges(bounds: list[tuple[int, int]]) -> list[StageRange]:
    """StageRanges from consecutive [start, end) block ranges."""
    return [StageRange(a, b, i == 0, i == len(bounds) - 1) for i, (a, b) in enumerate(bounds)]


def _model_namespace(model: nn.Module):
    return sys.modules[type(model).__module__]


class _Stage(nn.Module):
    """Common to both families: the model (not registered as a submodule: its parameters are the
    model's), the range, autocast as the single-process loop applies it."""

    def __init__(self, model: nn.Module, spec, rng: StageRange, autocast: bool = False, weight_dtype: str = "fp32"):
        super().__init__()
        object.__setattr__(self, "model", model)      # keep the model out of this module's tree
        self.spec, self.rng, self.autocast, self.weight_dtype = spec, rng, autocast, weight_dtype
        # register the blocks this stage runs, so `parameters()` of the stage is its share
        self.own = nn.ModuleList([model.get_submodule(spec.blocks[i].path) for i in range(rng.start, rng.end)])

    def adopt(self, adapters) -> _Stage:
        """Register the LoRA adapters of this stage's blocks as its own parameters (they stay the
        LoraSet's too): a schedule finds the weights it computes gradients for through
        `parameters()` (zero-bubble splits each backward into the input's and the weights')."""
        self.adapters = nn.ModuleList(adapters)
        return self

    def _autocast(self, device: torch.device):
        return bf16_autocast(self.autocast, self.weight_dtype, device)


class Flux2Stage(_Stage):
    """Blocks [start, end) of ComfyUI's `Flux` (FLUX.2 layout) with the glue of `Flux._forward` /
    `forward_orig` around them. Inputs: the hidden state received from the previous stage (none on
    the first), and per micro-batch `x` (the model's input latent [B, C, h, w]), `timestep`,
    `context` and `guidance` (models with the embedder). Output: (img, txt) inside the double
    blocks, the joined stream after them, the model's output [B, C, h, w] on the last stage."""

    def __init__(self, model, spec, rng: StageRange, autocast: bool = False, weight_dtype: str = "fp32"):
        super().__init__(model, spec, rng, autocast, weight_dtype)
        self.double = len(model.double_blocks)

    def forward(self, *hidden, x, timestep, context, guidance=None):
        m, rng, D = self.model, self.rng, self.double
        ns = _model_namespace(m)
        with self._autocast(x.device):
            bs, _, h_orig, w_orig = x.shape
            img_in, img_ids = m.process_img(x, transformer_options={})
            img_tokens = img_in.shape[1]
            txt_ids = torch.zeros((bs, context.shape[1], len(m.params.axes_dim)), device=x.device, dtype=torch.float32)
            dims = getattr(m.params, "txt_ids_dims", None)
            if dims is None:                          # ComfyUI 0.3.x: FLUX.2 is the 4-axis RoPE
                dims = [3] if len(m.params.axes_dim) == 4 else []
            for i in dims:
                txt_ids[:, :, i] = torch.linspace(0, context.shape[1] - 1, steps=context.shape[1], device=x.device,
                                                  dtype=torch.float32)
            pe = m.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))

            if rng.first:
                img = m.img_in(img_in)
                txt_norm = getattr(m, "txt_norm", None)
                txt = m.txt_in(txt_norm(context) if txt_norm is not None else context)
                streams = (img, txt)
            else:
                # the block adds into its inputs in place (FLUX.2): never into the received tensors
                streams = tuple(t.clone() for t in hidden)
            dtype = streams[0].dtype
            vec = m.time_in(ns.timestep_embedding(timestep, 256).to(dtype))
            if m.params.guidance_embed and guidance is not None:
                vec = vec + m.guidance_in(ns.timestep_embedding(guidance, 256).to(dtype))
            if getattr(m, "vector_in", None) is not None:
                y = torch.zeros((bs, m.params.vec_in_dim), device=x.device, dtype=dtype)
                vec = vec + m.vector_in(y)
            vec_orig = vec
            options: dict = {}
            if rng.start < D:
                img, txt = streams
                double_vec = (m.double_stream_modulation_img(vec_orig), m.double_stream_modulation_txt(vec_orig)) \
                    if m.params.global_modulation else vec_orig
                options.update(total_blocks=D, block_type="double")
                for i in range(rng.start, min(rng.end, D)):
                    options["block_index"] = i
                    img, txt = m.double_blocks[i](img=img, txt=txt, vec=double_vec, pe=pe, attn_mask=None,
                                                  transformer_options=options)
                if rng.end < D and not rng.last:
                    return img, txt
                if img.dtype == torch.float16:
                    img = torch.nan_to_num(img, nan=0.0, posinf=65504, neginf=-65504)
                joined = torch.cat((txt, img), 1)
            else:
                (joined,) = streams
            txt_len = joined.shape[1] - img_tokens
            if rng.end > D:
                single_vec = m.single_stream_modulation(vec_orig)[0] if m.params.global_modulation else vec_orig
                options.update(total_blocks=len(m.single_blocks), block_type="single",
                               img_slice=[txt_len, joined.shape[1]])
                for i in range(max(rng.start, D), rng.end):
                    options["block_index"] = i - D
                    joined = m.single_blocks[i - D](joined, vec=single_vec, pe=pe, attn_mask=None,
                                                    transformer_options=options)
            if not rng.last:
                return joined
            out = m.final_layer(joined[:, txt_len:, ...], vec_orig)[:, :img_tokens]
            p = m.patch_size
            h_len, w_len = (h_orig + p // 2) // p, (w_orig + p // 2) // p
            out = out.reshape(bs, h_len, w_len, -1, p, p).permute(0, 3, 1, 4, 2, 5)
            return out.reshape(bs, -1, h_len * p, w_len * p)[:, :, :h_orig, :w_orig]


class WanStage(_Stage):
    """Blocks [start, end) of ComfyUI's `WanModel` (Wan 2.1 T2V) with the glue of `_forward` /
    `forward_orig`. Per micro-batch: `x` [B, C, T, h, w], `timestep`, `context`; `x` [B, L, dim]
    travels between stages; the last stage gives the model's output [B, C, T, h, w]."""

    def forward(self, *hidden, x, timestep, context, guidance=None):
        m, rng = self.model, self.rng
        ns = _model_namespace(m)
        with self._autocast(x.device):
            bs, _, t_in, h, w = x.shape
            x = ns.comfy.ldm.common_dit.pad_to_patch_size(x, m.patch_size)
            freqs = m.rope_encode(t_in, h, w, device=x.device, dtype=x.dtype, transformer_options={})
            grid_sizes = tuple(n // p for n, p in zip(x.shape[2:], m.patch_size))
            if rng.first:
                hs = m.patch_embedding(x.float()).to(x.dtype)
                hs = hs.flatten(2).transpose(1, 2)
                dtype = hs[0].dtype
            else:
                (hs,) = hidden
                dtype = x.dtype                           # what `x[0].dtype` is in forward_orig
            e = m.time_embedding(ns.sinusoidal_embedding_1d(m.freq_dim, timestep.flatten()).to(dtype=dtype))
            e = e.reshape(timestep.shape[0], -1, e.shape[-1])
            e0 = m.time_projection(e).unflatten(2, (6, m.dim))
            ctx = m.text_embedding(context)
            options = {"grid_sizes": grid_sizes, "total_blocks": len(m.blocks), "block_type": "double"}
            for i in range(rng.start, rng.end):
                options["block_index"] = i
                hs = m.blocks[i](hs, e=e0, freqs=freqs, context=ctx, context_img_len=None,
                                 transformer_options=options)
            if not rng.last:
                return hs
            hs = m.head(hs, e)
            return m.unpatchify(hs, grid_sizes)[:, :, :t_in, :h, :w]


STAGES = {"flux2": Flux2Stage, "wan": WanStage}


def stage_module(model: nn.Module, spec, rng: StageRange, autocast: bool = False, weight_dtype: str = "fp32") -> _Stage:
    """The stage module of `spec.family` for blocks `rng` of `model` (autocast as `ugpum.dtypes.bf16_autocast`)."""
    try:
        return STAGES[spec.family](model, spec, rng, autocast, weight_dtype)
    except KeyError:
        raise ValueError(f"{spec.id}: no pipeline stages for the {spec.family!r} family") from None


# Modules of the model each stage needs besides its blocks (attribute names; absent ones skipped).
EVERY_STAGE = {"flux2": ("time_in", "guidance_in", "vector_in", "double_stream_modulation_img",
                         "double_stream_modulation_txt", "single_stream_modulation", "pe_embedder"),
               "wan": ("time_embedding", "time_projection", "text_embedding", "rope_embedder")}
FIRST_STAGE = {"flux2": ("img_in", "txt_in", "txt_norm"), "wan": ("patch_embedding",)}


def needed(spec, rng: StageRange) -> tuple[str, ...]:
    """Module paths (besides blocks) that stage `rng` runs: the last stage also its tail modules."""
    return EVERY_STAGE[spec.family] + (FIRST_STAGE[spec.family] if rng.first else ()) + \
        (tuple(spec.tail_modules) if rng.last else ())


def keep_only(model: nn.Module, spec, ranges: StageRange | list[StageRange]) -> None:
    """Drop from `model` every block and top-level module the stage(s) `ranges` of one rank do not
    run (each becomes an empty `nn.Identity`), so a rank loads, streams and holds only its share."""
    ranges = [ranges] if isinstance(ranges, StageRange) else list(ranges)
    own = {spec.blocks[i].path for rng in ranges for i in range(rng.start, rng.end)}
    keep = {name for rng in ranges for name in needed(spec, rng)}
    for b in spec.blocks:
        if b.path not in own:
            parent, _, index = b.path.rpartition(".")
            model.get_submodule(parent)[int(index)] = nn.Identity()
    block_lists = {b.path.rpartition(".")[0] for b in spec.blocks}
    for name, child in list(model.named_children()):
        if name not in keep and name not in block_lists and any(True for _ in child.parameters()):
            setattr(model, name, nn.Identity())

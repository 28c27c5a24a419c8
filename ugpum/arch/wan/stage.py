"""Wan 2.1's pipeline stage (ugpum.arch.stage): blocks [start, end) of ComfyUI's `WanModel` (T2V) with
the glue of `_forward` / `forward_orig` around them.

What travels between Wan's stages: the hidden state `x`. The time embedding `e0` and the embedded text
every block reads are recomputed on each stage, so each keeps the time and text embedders
(`every_stage_modules`)."""
from __future__ import annotations

from ..attention import training_options
from ..stage import Stage, model_namespace


class WanStage(Stage):
    """Blocks [start, end) of ComfyUI's `WanModel` (Wan 2.1 T2V) with the glue of `_forward` /
    `forward_orig`. Per micro-batch: `x` [B, C, T, h, w], `timestep`, `context`; `x` [B, L, dim]
    travels between stages; the last stage gives the model's output [B, C, T, h, w]."""

    every_stage_modules = ("time_embedding", "time_projection", "text_embedding", "rope_embedder")
    first_stage_modules = ("patch_embedding",)

    def forward(self, *hidden, x, timestep, context, guidance=None):
        m, rng = self.model, self.rng
        ns = model_namespace(m)
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
            options = {**training_options(), "grid_sizes": grid_sizes, "total_blocks": len(m.blocks),
                       "block_type": "double"}
            for i in range(rng.start, rng.end):
                options["block_index"] = i
                hs = m.blocks[i](hs, e=e0, freqs=freqs, context=ctx, context_img_len=None,
                                 transformer_options=options)
            if not rng.last:
                return hs
            hs = m.head(hs, e)
            return m.unpatchify(hs, grid_sizes)[:, :, :t_in, :h, :w]

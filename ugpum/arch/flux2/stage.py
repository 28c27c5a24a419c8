"""FLUX.2's pipeline stage (ugpum.arch.stage): blocks [start, end) of ComfyUI's `Flux` with the glue of
`Flux._forward` / `forward_orig` around them.

What travels between FLUX.2's stages: the image and text streams while inside the double blocks, the
joined single stream after them. RoPE `pe` and the modulation `vec` are recomputed on each stage, so
each keeps time_in and the three modulations (`every_stage_modules`)."""
from __future__ import annotations

import torch

from ..attention import training_options
from ..stage import Stage, StageRange, model_namespace


class Flux2Stage(Stage):
    """Blocks [start, end) of ComfyUI's `Flux` (FLUX.2 layout) with the glue of `Flux._forward` /
    `forward_orig` around them. Inputs: the hidden state received from the previous stage (none on
    the first), and per micro-batch `x` (the model's input latent [B, C, h, w]), `timestep`,
    `context` and `guidance` (models with the embedder). Output: (img, txt) inside the double
    blocks, the joined stream after them, the model's output [B, C, h, w] on the last stage."""

    every_stage_modules = ("time_in", "guidance_in", "vector_in", "double_stream_modulation_img",
                           "double_stream_modulation_txt", "single_stream_modulation", "pe_embedder")
    first_stage_modules = ("img_in", "txt_in", "txt_norm")

    def __init__(self, model, spec, rng: StageRange, autocast: bool = False, weight_dtype: str = "fp32"):
        super().__init__(model, spec, rng, autocast, weight_dtype)
        self.double = len(model.double_blocks)

    def forward(self, *hidden, x, timestep, context, guidance=None):
        m, rng, D = self.model, self.rng, self.double
        ns = model_namespace(m)
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
            options = training_options()
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

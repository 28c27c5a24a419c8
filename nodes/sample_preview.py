"""Sample Preview: render a prompt on the split model, optionally with a LoRA, before/after side by side."""
from __future__ import annotations

from comfy_api.latest import io, ui

import torch

from .errors import UGPUMError, user_errors
from .trainer import DEFAULT_SAMPLE_PROMPT
from .types import LORA_MODEL, UGPUM_MODEL, UGPUM_PLAN, UGPUMModel, UGPUMPlan

NODE = "Sample Preview"


class SamplePreview(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="UGPUMSamplePreview",
            display_name="UGPUM Sample Preview",
            category="UGPUM",
            description="Renders the prompt on the model split over the GPUs as the plan says (no single "
                        "GPU has to hold it). With a LoRA connected it renders the same seed without and "
                        "with it: before and after.",
            is_output_node=True,
            inputs=[
                UGPUM_MODEL.Input("model"),
                UGPUM_PLAN.Input("plan"),
                io.String.Input("prompt", default=DEFAULT_SAMPLE_PROMPT, multiline=True,
                                tooltip="What to render, encoded by the connected text encoder (the trigger "
                                        "word brings in what the LoRA learned)."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="The starting noise; the same seed with and without the LoRA shows "
                                     "what the LoRA changes."),
                io.Int.Input("steps", default=0, min=0, max=200,
                             tooltip="Sampling steps; 0: the model's default (4 for distilled FLUX.2 "
                                     "[klein], 50 for base models)."),
                io.Int.Input("width", default=1024, min=256, max=4096, step=16,
                             tooltip="Image width in pixels (a multiple of 16)."),
                io.Int.Input("height", default=1024, min=256, max=4096, step=16,
                             tooltip="Image height in pixels (a multiple of 16)."),
                io.Int.Input("frames", default=0, min=0, max=161, optional=True,
                             tooltip="Wan: frames of the clip (4k+1: 1, 17, 33, 81); 0: the plan's frames. "
                                     "Every frame is an image of the output batch (connect it to Create "
                                     "Video or Save Animated WEBP). FLUX.2: 0 or 1."),
                LORA_MODEL.Input("lora", optional=True, tooltip="A LoRA from the UGPUM LoRA Trainer."),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.05, optional=True,
                               tooltip="LoRA strength."),
                io.Boolean.Input("before_and_after", default=True, optional=True,
                                 display_name="before and after",
                                 tooltip="With a LoRA: also render without it, for comparison."),
                io.Clip.Input("clip", optional=True, tooltip="Stock CLIPLoader (needed for every real model)."),
                io.Vae.Input("vae", optional=True, tooltip="Stock VAELoader (needed for every real model)."),
            ],
            outputs=[io.Image.Output("IMAGE", display_name="images",
                                     tooltip="One image (or a clip's frames), then the same with the LoRA "
                                             "when one is connected and before and after is on.")],
        )

    @classmethod
    def execute(cls, model: UGPUMModel, plan: UGPUMPlan, prompt: str, seed: int, steps: int,
                width: int, height: int, frames: int = 0, lora=None, strength: float = 1.0,
                before_and_after: bool = True, clip=None, vae=None) -> io.NodeOutput:
        if plan.model.path != model.path:
            raise UGPUMError(f"{NODE}: the plan was made for {plan.model.file_name}, not {model.file_name}; "
                             "connect the same UGPUM Loader to the Partition Planner and this node.")
        frames = frames or plan.config.frames
        if model.spec.frames_error(frames):
            raise UGPUMError(f"{NODE}: frames = {frames}: {model.spec.frames_error(frames)}.")
        from ugpum.compute.dtypes import TORCH_DTYPES, training_dtype
        from ugpum.render.preview import PreviewPrompt, render_on_plan
        from ugpum.render.report import to_pil

        from .comfy_glue import build_meta_model, free_comfy_memory, pil_to_image, return_memory
        from .trainer import make_encoders

        dtype = TORCH_DTYPES[training_dtype(model.weight_dtype)]
        try:
            with user_errors(NODE), torch.inference_mode(False):
                free_comfy_memory()
                encoders = make_encoders(model, clip, vae)
                positive = encoders.encode_text([prompt])[0]
                negative = encoders.encode_text([""])[0]
                module = build_meta_model(model.spec, dtype)
                asked = PreviewPrompt(positive, negative, width, height, seed % 2**63, steps, frames)
                images = render_on_plan(model.spec, plan.plan, module, str(model.path), model.key_prefix, dtype,
                                        encoders.decode, asked, lora_tensors=lora, strength=strength,
                                        before_and_after=before_and_after)
        finally:
            encoders = module = None
            return_memory()
        batch = pil_to_image([to_pil(frame) for sample in images for frame in sample])
        return io.NodeOutput(batch, ui=ui.PreviewImage(batch, cls=cls))

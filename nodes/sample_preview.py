"""Sample Preview: render a prompt on the split model, optionally with a LoRA, before/after side by side."""
from __future__ import annotations

from comfy_api.latest import io

from .errors import UGPUMError
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
                io.Clip.Input("clip"),
                io.Vae.Input("vae"),
                io.String.Input("prompt", default=DEFAULT_SAMPLE_PROMPT, multiline=True),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True),
                io.Int.Input("steps", default=0, min=0, max=200,
                             tooltip="Sampling steps; 0: the model's default (4 for distilled FLUX.2 "
                                     "[klein], 50 for base models)."),
                io.Int.Input("width", default=1024, min=256, max=4096, step=16),
                io.Int.Input("height", default=1024, min=256, max=4096, step=16),
                LORA_MODEL.Input("lora", optional=True, tooltip="A LoRA from the UGPUM LoRA Trainer."),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.05, optional=True,
                               tooltip="LoRA strength."),
                io.Boolean.Input("before_and_after", default=True, optional=True,
                                 display_name="before and after",
                                 tooltip="With a LoRA: also render without it, for comparison."),
            ],
            outputs=[io.Image.Output("IMAGE", display_name="images",
                                     tooltip="One image, or before and after when a LoRA is connected.")],
        )

    @classmethod
    def execute(cls, model: UGPUMModel, plan: UGPUMPlan, clip, vae, prompt: str, seed: int, steps: int,
                width: int, height: int, lora=None, strength: float = 1.0,
                before_and_after: bool = True) -> io.NodeOutput:
        if plan.model.path != model.path:
            raise UGPUMError(f"{NODE}: the plan was made for {plan.model.file_name}, not {model.file_name}; "
                             "connect the same UGPUM Loader to the Partition Planner and this node.")
        raise UGPUMError(f"{NODE}: sampling on the split model is not wired into this version of the "
                         "pack yet (the engine is still being written); use the stock UNETLoader and a "
                         "sampler with Load LoRA Model meanwhile.")

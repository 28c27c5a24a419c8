"""UGPUM for ComfyUI: multi-GPU LoRA training for large diffusion transformers.

ComfyUI's entry point (V3): the node classes live in nodes/, the engine in ugpum/. Imports are
deferred so that importing this file outside ComfyUI (tools, test collectors) does nothing.
"""


async def comfy_entrypoint():
    from .nodes import UGPUMExtension
    return UGPUMExtension()

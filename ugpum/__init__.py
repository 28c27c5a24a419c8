"""UGPUM core: multi-GPU LoRA training for large diffusion transformers (no ComfyUI imports)."""

"""A test-only ComfyUI custom node: the stock UNETLoader, told the one fact a tiny FLUX.2 file does not
record. ComfyUI reads every FLUX.2 setting from a file's shapes except the head count, which it fixes
(48 heads of 128 in ComfyUI 0.3.75, hidden // 128 in newer ones): right for released models, wrong for
the tiny test model (hidden 64, heads of 16). This node lets ComfyUI detect and load the file through
its own `comfy.sd.load_diffusion_model` and only corrects that count, so what comes out is the MODEL
the stock UNETLoader would give for such a model. The journey test (tests/server/test_journey.py)
links this directory into a test server's custom_nodes; nothing outside the tests loads it."""
import comfy.model_detection
import comfy.sd
import folder_paths


class UGPUMTestUNETLoaderWithHeads:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"unet_name": (folder_paths.get_filename_list("diffusion_models"),),
                             "heads": ("INT", {"default": 4, "min": 1, "max": 256})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "ugpum tests"

    def load(self, unet_name: str, heads: int):
        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        detect = comfy.model_detection.detect_unet_config

        def detect_with_heads(state_dict, key_prefix, metadata=None):
            config = detect(state_dict, key_prefix, metadata=metadata)
            if config is not None and config.get("image_model") == "flux2":
                head_dim = config["hidden_size"] // heads        # FLUX.2 rotates four equal axes per head
                config.update(num_heads=heads, axes_dim=[head_dim // 4] * 4)
            return config
        comfy.model_detection.detect_unet_config = detect_with_heads    # prompts run one at a time
        try:
            return (comfy.sd.load_diffusion_model(path),)
        finally:
            comfy.model_detection.detect_unet_config = detect


NODE_CLASS_MAPPINGS = {"UGPUMTestUNETLoaderWithHeads": UGPUMTestUNETLoaderWithHeads}

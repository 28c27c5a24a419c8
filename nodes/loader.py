"""UGPUM Loader: pick a DiT file from ComfyUI's diffusion_models; read its header (never its weights)."""
from __future__ import annotations

import os

import folder_paths
from comfy_api.latest import io, ui

from ugpum.arch import family_titles, recognise
from ugpum.formats.fingerprint import weights_fingerprint
from ugpum.planning.devices import parse_device_specs
from ugpum.planning.plan import auto_summary

from .errors import UGPUMError, user_errors
from .types import UGPUM_MODEL, UGPUMModel

NODE = "UGPUM Loader"
AS_STORED = "as stored"
WEIGHT_DTYPES = {AS_STORED: None, "bf16": "bf16", "fp8_e4m3fn": "fp8"}   # widget -> Workload dtype


def dit_files() -> list[str]:
    """Safetensors files ComfyUI lists under diffusion_models (also models/unet)."""
    return [f for f in folder_paths.get_filename_list("diffusion_models") if f.lower().endswith(".safetensors")]


def device_specs(text: str) -> tuple[str, ...]:
    specs = tuple(s.strip() for s in text.split(",") if s.strip())
    return specs or ("auto",)


class UGPUMLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="UGPUMLoader",
            display_name="UGPUM Loader",
            category="UGPUM",
            description=f"Names a {family_titles()} diffusion model for multi-GPU LoRA training. Reads the "
                        "file's header only: the Partition Planner decides where each block goes before "
                        "any weight is loaded.",
            inputs=[
                io.Combo.Input("dit_name", options=dit_files(), display_name="diffusion model",
                               tooltip=f"A .safetensors file from models/diffusion_models ({family_titles(', ')}). "
                                       "Train on the base (undistilled) model."),
                io.Combo.Input("weight_dtype", options=list(WEIGHT_DTYPES), default=AS_STORED,
                               tooltip="How the frozen base weights are held on the GPUs. fp8 halves their "
                                       "memory; the LoRA itself always trains in fp32."),
                io.String.Input("devices", default="auto",
                                tooltip="'auto' for every CUDA GPU here, or a comma list: cuda:0, cuda:1. "
                                        "To forecast hardware you do not have: rtx4090, 16GiB@pcie4x4."),
            ],
            outputs=[UGPUM_MODEL.Output("UGPUM_MODEL", display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, dit_name: str) -> bool | str:
        """Before the graph runs: the file is in diffusion_models with a header UGPUM trains (ComfyUI shows
        the sentence at this input and runs nothing; it names every input a check reads, so this one reads
        the file alone)."""
        try:
            with user_errors(NODE, dit_name):
                recognise(model_path(dit_name))
        except UGPUMError as error:
            return str(error)
        return True

    @classmethod
    def fingerprint_inputs(cls, dit_name: str, weight_dtype: str, devices: str) -> str:
        """Which weights the file holds (a few slices of it, `ugpum.formats.fingerprint`): a file replaced
        under the same name loads again, and every node after this one runs again."""
        path = folder_paths.get_full_path("diffusion_models", dit_name)
        return weights_fingerprint(path) if path and os.path.isfile(path) else ""

    @classmethod
    def execute(cls, dit_name: str, weight_dtype: str, devices: str) -> io.NodeOutput:
        if weight_dtype not in WEIGHT_DTYPES:
            raise UGPUMError(f"{NODE}: unknown weight dtype {weight_dtype!r}; "
                             f"choose one of {', '.join(WEIGHT_DTYPES)}.")
        path = model_path(dit_name)
        specs = device_specs(devices)
        with user_errors(NODE, dit_name):
            spec, prefix, stored = recognise(path)
            found = parse_device_specs(list(specs), probe=False)   # a typo is reported here, not three nodes later
        model = UGPUMModel(family=spec.family, model_id=spec.id, title=spec.title, path=os.path.abspath(path),
                           file_name=dit_name, key_prefix=prefix, stored_dtype=stored,
                           weight_dtype=WEIGHT_DTYPES[weight_dtype] or stored, devices=specs, spec=spec)
        text = model.describe() + ("\n" + auto_summary(found) if found else "")
        hint = companion_files_hint(spec.id)
        return io.NodeOutput(model, ui=ui.PreviewText(text + ("\n" + hint if hint else "")))


def model_path(dit_name: str) -> str:
    """The full path of a file in ComfyUI's diffusion_models; UGPUMError when it is not there (any more)."""
    path = folder_paths.get_full_path("diffusion_models", dit_name)
    if path is None or not os.path.isfile(path):
        raise UGPUMError(f"{NODE}: '{dit_name}' is not in models/diffusion_models any more; "
                         "refresh the list (press R) and pick a file that exists.")
    return path


def companion_files_hint(model_id: str) -> str | None:
    """For a known model: which of its text encoder and VAE files ComfyUI's folders lack, and the
    command that fetches them (the DiT itself was just picked from the list, so it is present)."""
    from ugpum.catalog.models import MODELS
    entry = MODELS.get(model_id)
    if entry is None:
        return None
    present = set(folder_paths.get_filename_list("text_encoders")) | set(folder_paths.get_filename_list("vae"))
    missing = [f for f in (entry.text_encoder, entry.vae) if f.filename not in present]
    if not missing:
        return None
    names = ", ".join(f"{f.folder}/{f.filename}" for f in missing)
    # the nodes download nothing: the command line's download verb does, run from this pack's folder
    command = f"python -m ugpum download {model_id} --models <ComfyUI>/models"
    return f"Also needed for training and previews: {names}. Get them with: {command}"

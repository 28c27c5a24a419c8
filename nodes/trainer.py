"""LoRA Trainer: train a LoRA on the split model; output the stock LORA_MODEL, the saved file's name,
a loss curve and before/after samples. Saves into ComfyUI's loras/ugpum/."""
from __future__ import annotations

import os
from pathlib import Path

import folder_paths
from comfy_api.latest import io

from ugpum.train.dataset import IMAGE_EXTENSIONS

from .errors import UGPUMError
from .types import LORA_MODEL, UGPUM_MODEL, UGPUM_PLAN, UGPUMModel, UGPUMPlan

NODE = "LoRA Trainer"
REPO = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO / "demo_datasets"
DEMO_PREFIX = "demo/"
INPUT_PREFIX = "input/"
LORA_SUBFOLDER = "ugpum"
DEFAULT_SAMPLE_PROMPT = ("loranne, a cartoon woman with a teal bob haircut, round yellow glasses, a red scarf "
                         "and a purple coat, waving, full body, in a park")


def _has_images(folder: Path) -> bool:
    try:
        return any(p.suffix.lower() in IMAGE_EXTENSIONS for p in folder.iterdir() if p.is_file())
    except OSError:
        return False


def dataset_choices() -> list[str]:
    """The bundled demo sets, then folders of images and musubi dataset TOMLs in ComfyUI's input/."""
    choices = []
    if DEMO_DIR.is_dir():
        choices += [DEMO_PREFIX + p.name for p in sorted(DEMO_DIR.iterdir()) if p.is_dir() and _has_images(p)]
    root = Path(folder_paths.get_input_directory())
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.name.startswith("."):
                continue
            if (p.is_dir() and _has_images(p)) or (p.is_file() and p.suffix.lower() == ".toml"):
                choices.append(INPUT_PREFIX + p.name)
    return choices


def dataset_path(choice: str) -> Path:
    """The folder or TOML file a dataset choice names; never outside demo_datasets/ or input/."""
    if choice.startswith(DEMO_PREFIX):
        root, name = DEMO_DIR, choice[len(DEMO_PREFIX):]
    elif choice.startswith(INPUT_PREFIX):
        root, name = Path(folder_paths.get_input_directory()), choice[len(INPUT_PREFIX):]
    else:
        raise UGPUMError(f"{NODE}: unknown dataset {choice!r}; pick one from the list.")
    path = (root / name).resolve()
    if path.parent != root.resolve() or not path.exists():
        raise UGPUMError(f"{NODE}: dataset {choice!r} is not there any more; refresh the list (press R).")
    return path


def lora_save_path(save_name: str) -> tuple[Path, str]:
    """(absolute path, name as ComfyUI's LoRA lists show it) for loras/ugpum/<save_name>.safetensors."""
    name = save_name.strip().removesuffix(".safetensors")
    if not name or any(sep in name for sep in ("/", "\\", os.sep)) or name.startswith("."):
        raise UGPUMError(f"{NODE}: save name {save_name!r} must be a plain file name like 'loranne_klein9b'.")
    folder = Path(folder_paths.get_folder_paths("loras")[0]) / LORA_SUBFOLDER
    return folder / f"{name}.safetensors", f"{LORA_SUBFOLDER}/{name}.safetensors"


def engine_available() -> bool:
    here = REPO / "ugpum" / "train"
    return (here / "loop.py").is_file() and (here / "config.py").is_file()


class LoRATrainer(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="UGPUMLoRATrainer",
            display_name="UGPUM LoRA Trainer",
            category="UGPUM",
            description="Trains a LoRA with the model's blocks spread over the GPUs as the plan says "
                        "(weights never move; only the hidden state crosses between GPUs). Saves to "
                        "models/loras/ugpum/ and outputs the LoRA for the stock Load LoRA Model node. "
                        "Cancel saves what was trained, then stops.",
            is_output_node=True,
            inputs=[
                UGPUM_MODEL.Input("model"),
                UGPUM_PLAN.Input("plan", tooltip="From the Partition Planner; sets the LoRA rank, "
                                                 "resolution, batch and gradient accumulation."),
                io.Clip.Input("clip", tooltip="The text encoder for this model (CLIPLoader, type flux2 "
                                              "for FLUX.2, wan for Wan 2.1)."),
                io.Vae.Input("vae", tooltip="The model's VAE (FLUX.2 VAE for FLUX.2)."),
                io.Combo.Input("dataset", options=dataset_choices(),
                               tooltip="A bundled demo set, or a folder of images with same-name .txt "
                                       "captions (or a musubi-tuner dataset .toml) in ComfyUI's input folder."),
                io.String.Input("trigger_word", default="loranne",
                                tooltip="Put in front of every caption that lacks it."),
                io.Int.Input("steps", default=300, min=1, max=100000, tooltip="Optimizer steps."),
                io.Float.Input("learning_rate", default=1e-4, min=1e-7, max=1e-2, step=1e-6,
                               display_name="learning rate"),
                io.Float.Input("alpha", default=16.0, min=0.01, max=1024.0, step=0.5,
                               tooltip="LoRA alpha; the update is scaled by alpha / rank (rank is set on "
                                       "the Partition Planner)."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True),
                io.String.Input("sample_prompt", default=DEFAULT_SAMPLE_PROMPT, multiline=True,
                                display_name="sample prompt",
                                tooltip="Rendered before training and every N steps (live preview on this "
                                        "node), and after training."),
                io.Int.Input("sample_every", default=100, min=0, max=100000, display_name="sample every",
                             tooltip="Steps between preview samples; 0: only before and after."),
                io.String.Input("save_name", default="loranne_klein9b", display_name="save name",
                                tooltip="File name in models/loras/ugpum/ (an existing file is replaced)."),
            ],
            outputs=[
                LORA_MODEL.Output("LORA_MODEL", display_name="lora",
                                  tooltip="For the stock Load LoRA Model node (LoraModelLoader)."),
                io.String.Output("lora_name", display_name="lora file",
                                 tooltip="The saved file, as LoRA loaders list it (ugpum/<save name>.safetensors)."),
                io.Image.Output("loss_curve", display_name="loss curve"),
                io.Image.Output("samples", display_name="before / after",
                                tooltip="The sample prompt before and after training, side by side."),
            ],
        )

    @classmethod
    def execute(cls, model: UGPUMModel, plan: UGPUMPlan, clip, vae, dataset: str, trigger_word: str,
                steps: int, learning_rate: float, alpha: float, seed: int, sample_prompt: str,
                sample_every: int, save_name: str) -> io.NodeOutput:
        if plan.model.path != model.path:
            raise UGPUMError(f"{NODE}: the plan was made for {plan.model.file_name}, not {model.file_name}; "
                             "connect the same UGPUM Loader to the Partition Planner and the trainer.")
        dataset_path(dataset)
        lora_save_path(save_name)
        raise UGPUMError(f"{NODE}: training is not wired into this version of the pack yet "
                         "(the training engine, ugpum/train/loop.py, is still being written); the Loader "
                         "and Partition Planner work, so you can read the forecast meanwhile.")

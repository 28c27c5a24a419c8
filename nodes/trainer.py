"""LoRA Trainer: train a LoRA on the split model; output the stock LORA_MODEL, the saved file's name,
a loss curve and before/after samples. Saves into ComfyUI's loras/ugpum/."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path

import folder_paths
import torch
from comfy_api.latest import io, ui
from PIL import Image

from ugpum.arch import FAMILIES, family_of
from ugpum.planning.devices import CPU_TRAINABLE_PARAMS
from ugpum.diffusion.flow import TIMESTEP_METHODS
from ugpum.train.dataset import IMAGE_EXTENSIONS, resolve_inside
from ugpum.train.video import folder_has_clips
from ugpum.wording import for_nodes

from .errors import UGPUMError, user_errors
from .types import LORA_MODEL, UGPUM_MODEL, UGPUM_PLAN, UGPUMModel, UGPUMPlan

log = logging.getLogger("ugpum")

NODE = "LoRA Trainer"
REPO = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO / "demo_datasets"
DEMO_PREFIX = "demo/"
INPUT_PREFIX = "input/"
LORA_SUBFOLDER = "ugpum"
MAX_STEPS = 100000
DEFAULT_SAMPLE_PROMPT = ("loranne, a cartoon woman with a teal bob haircut, round yellow glasses, a red scarf "
                         "and a purple coat, waving, full body, in a park")


def _has_images(folder: Path) -> bool:
    """Images, or clips for Wan (video files or folders of numbered frames)."""
    try:
        return any(p.suffix.lower() in IMAGE_EXTENSIONS for p in folder.iterdir() if p.is_file()) \
            or folder_has_clips(folder)
    except (OSError, ValueError):                 # a folder it cannot read is not offered
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


def dataset_path(choice: str) -> tuple[Path, Path]:
    """(the folder or TOML file a dataset choice names, the folder every path it names must stay in:
    demo_datasets/ or ComfyUI's input/). A symlink pointing elsewhere is refused, saying so."""
    from ugpum.folders import too_long_name
    from ugpum.wording import quoted
    if choice.startswith(DEMO_PREFIX):
        root, name = DEMO_DIR, choice[len(DEMO_PREFIX):]
    elif choice.startswith(INPUT_PREFIX):
        root, name = Path(folder_paths.get_input_directory()), choice[len(INPUT_PREFIX):]
    else:
        raise UGPUMError(f"{NODE}: unknown dataset {quoted(choice)}; pick one from the list.")
    if too_long_name(root / name, room=0):              # no such file can exist (the system would refuse the name)
        raise UGPUMError(f"{NODE}: dataset {quoted(choice)} is no dataset in the list "
                         f"({too_long_name(root / name, 0)}); pick one from the list.")
    with user_errors(NODE):
        path = resolve_inside(root, name, f"dataset {quoted(choice)}")
    if not path.exists():
        raise UGPUMError(f"{NODE}: dataset {quoted(choice)} is not there any more; refresh the list (press R).")
    return path, root


def lora_save_path(save_name: str) -> tuple[Path, str]:
    """(absolute path, name as ComfyUI's LoRA lists show it) for loras/ugpum/<save_name>.safetensors."""
    from ugpum.train.config import file_name_problem, lora_stem
    from ugpum.wording import quoted
    name = lora_stem(save_name)
    problem = file_name_problem(name, f"_step{MAX_STEPS}.safetensors")
    if problem:
        raise UGPUMError(f"{NODE}: save name {quoted(save_name)} {problem}.")
    folder = Path(folder_paths.get_folder_paths("loras")[0]) / LORA_SUBFOLDER
    return folder / f"{name}.safetensors", f"{LORA_SUBFOLDER}/{name}.safetensors"


def run_folder(save_name: str) -> Path:
    """Where a run keeps its checkpoints, metrics, feature cache and samples: output/ugpum/<save name>/."""
    from ugpum.train.config import lora_stem
    return Path(folder_paths.get_output_directory()) / "ugpum" / lora_stem(save_name)


def check_folders(out: Path, loras: Path) -> None:
    """Before any work: the run folder (in ComfyUI's output/) and the LoRA folder can be written."""
    from ugpum.folders import check_writable
    check_writable(out, "the run folder", "start ComfyUI with --output-directory set to a folder you can write in")
    check_writable(loras, "the LoRA folder", "make it writable, or name a writable loras folder first in "
                                             "extra_model_paths.yaml")


def make_encoders(model: UGPUMModel, clip, vae, devices=None):
    """ComfyUI's CLIP and VAE; the tiny test models alone may run without them (stand-in encoders).
    A text encoder too large for the first GPU is split over `devices` while captions are cached."""
    if clip is not None and vae is not None:
        from .comfy_glue import ComfyEncoders
        return ComfyEncoders(clip, vae, model.spec, devices=devices)
    if model.spec.params <= CPU_TRAINABLE_PARAMS:
        from ugpum.train.encoders import StandInEncoders
        return StandInEncoders(model.spec)
    missing = " and ".join(n for n, v in (("clip", clip), ("vae", vae)) if v is None)
    family = family_of(model.spec)
    raise UGPUMError(f"{NODE}: connect the {missing} input(s): a CLIPLoader (type {family.comfy.clip_type.lower()}) "
                     f"and a VAELoader with the {family.title} files.")


def clip_loader_types() -> str:
    """The stock CLIPLoader's type for each family: "type flux2 for FLUX.2, type wan for Wan 2.1"."""
    return ", ".join(f"type {f.comfy.clip_type.lower()} for {f.title}" for f in FAMILIES)


def make_config(model: UGPUMModel, plan: UGPUMPlan, dataset: Path, trigger_word: str, steps: int,
                learning_rate: float, alpha: float, seed: int, sample_prompt: str, sample_every: int,
                save_name: str, frame_stride: int = 1, timesteps: str = "auto", compile: str = "auto",
                dataset_root: Path | None = None):
    """The Planner's TrainConfig (ugpum/train/config.py) with this node's settings added; every path the
    dataset names must lie inside `dataset_root` (dataset_path's root). What the plan resolved (devices,
    schedule, base compute) stays in the plan, which `train` is given: the config keeps the settings."""
    from ugpum.planning.devices import check_trainable
    check_trainable(list(plan.devices), model.spec)
    return dataclasses.replace(
        plan.config, dataset=str(dataset), trigger=trigger_word.strip(), frame_stride=frame_stride, steps=steps,
        lr=learning_rate, alpha=alpha, seed=seed % 2**32, sample_every=sample_every,
        sample_prompt=sample_prompt.strip(), output_name=save_name,          # (validate: ugpum's one rule for names)
        timesteps=timesteps, compile=compile, dataset_root=str(dataset_root) if dataset_root else None).validate()


def _publish(src: Path, dest: Path) -> None:
    """Copy a LoRA file into models/loras/ugpum/ (via a temporary name, so loaders never see half a file)."""
    from ugpum.formats.atomic import atomic_path, remove_abandoned
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(dest.parent)                    # what a killed ComfyUI left while publishing
    with atomic_path(dest, needed=src.stat().st_size, kept=f"the LoRA stays in {src.parent}") as tmp:
        shutil.copyfile(src, tmp)


def _samples_image(paths: list[Path]) -> torch.Tensor:
    from .comfy_glue import pil_to_image, text_image
    images = [Image.open(p).convert("RGB") for p in paths if Path(p).is_file()]
    if not images:
        return pil_to_image([text_image(["No samples: this engine version renders none yet,",
                                         "or 'sample every' / the sample prompt is empty."])])
    chosen = [images[0], images[-1]] if len(images) > 1 else images
    size = chosen[0].size
    return pil_to_image([im.resize(size) for im in chosen])


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
                io.Combo.Input("dataset", options=dataset_choices(),
                               tooltip="A bundled demo set, or a folder of images with same-name .txt "
                                       "captions (or a musubi-tuner dataset .toml) in ComfyUI's input folder. "
                                       "Wan: also clips (.mp4/.webm/.mkv/.mov, or folders of numbered "
                                       "frames), each giving the Planner's frames from its start."),
                io.String.Input("trigger_word", default="loranne",
                                tooltip="Put in front of every caption that lacks it."),
                io.Int.Input("steps", default=300, min=1, max=MAX_STEPS, tooltip="Optimizer steps."),
                io.Float.Input("learning_rate", default=1e-4, min=1e-7, max=1e-2, step=1e-6,
                               display_name="learning rate",
                               tooltip="AdamW's learning rate for the LoRA; 1e-4 is the usual start for FLUX.2 "
                                       "and Wan LoRAs."),
                io.Float.Input("alpha", default=16.0, min=0.01, max=1024.0, step=0.5,
                               tooltip="LoRA alpha; the update is scaled by alpha / rank (rank is set on "
                                       "the Partition Planner)."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="Seeds the LoRA's start, the data order, the noise and the timesteps: the "
                                     "same seed and settings train the same LoRA."),
                io.String.Input("sample_prompt", default=DEFAULT_SAMPLE_PROMPT, multiline=True,
                                display_name="sample prompt",
                                tooltip="Rendered before training and every N steps (live preview on this "
                                        "node), and after training."),
                io.Int.Input("sample_every", default=100, min=0, max=100000, display_name="sample every",
                             tooltip="Steps between preview samples during training; 0: none."),
                io.String.Input("save_name", default="loranne_klein9b", display_name="save name",
                                tooltip="File name in models/loras/ugpum/. A name an earlier run took is refused: "
                                        "give a new one, or turn on resume to continue that run."),
                io.Clip.Input("clip", optional=True,
                              tooltip=f"The model's text encoder (CLIPLoader, {clip_loader_types()}). Needed for "
                                      "every real model."),
                io.Vae.Input("vae", optional=True, tooltip="The model's VAE (FLUX.2 VAE for FLUX.2)."),
                io.Int.Input("frame_stride", default=1, min=1, max=16, optional=True, display_name="frame stride",
                             tooltip="Wan clips: take every Nth frame from a clip's start (2: half the frame "
                                     "rate, twice the time span; a clip then needs 1 + (frames-1) x N frames)."),
                io.Boolean.Input("resume", default=False, optional=True,
                                 tooltip="Continue from the last checkpoint of this save name's run "
                                         "(output/ugpum/<save name>/checkpoints): after Cancel or a crash, or "
                                         "to train on to a higher step count. Off: start over."),
                io.Combo.Input("timesteps", options=["auto", *TIMESTEP_METHODS], default="auto", optional=True,
                               display_name="timestep sampling",
                               tooltip="How training draws noise levels. auto: FLUX.2 flux2_shift (musubi-tuner's "
                                       "FLUX.2 default, per bucket size), Wan shift 3. flux2: BFL's sampling shift "
                                       "(noisier); uniform, logit_normal/sigmoid, shift: the classic schemes."),
                io.Combo.Input("compile", options=["auto", "on", "off"], default="auto", optional=True,
                               tooltip="Compiled transformer blocks (torch.compile, each block class once): about "
                                       "1.5x faster steps after a first step of about half a minute. auto: on "
                                       "CUDA GPUs with Triton; elsewhere it says once why it runs eagerly."),
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
    def validate_inputs(cls, dataset: str, save_name: str) -> bool | str:
        """Before the graph runs (nothing loaded, nothing planned): the dataset is one of the list and still
        there, and the save name can be a file name (ComfyUI shows the sentence at both inputs)."""
        try:
            dataset_path(dataset)
            lora_save_path(save_name)
        except UGPUMError as error:
            return str(error)
        return True

    @classmethod
    def execute(cls, model: UGPUMModel, plan: UGPUMPlan, dataset: str, trigger_word: str, steps: int,
                learning_rate: float, alpha: float, seed: int, sample_prompt: str, sample_every: int,
                save_name: str, clip=None, vae=None, frame_stride: int = 1, resume: bool = False,
                timesteps: str = "auto", compile: str = "auto") -> io.NodeOutput:
        import comfy.model_management as mm
        import comfy.utils
        from comfy_bridge import comfy_training_mode
        from ugpum.compute.dtypes import TORCH_DTYPES
        from ugpum.render.report import loss_curve
        from ugpum.train.run.checkpoint import latest_checkpoint
        from ugpum.train.loop import earlier_run, train

        from .comfy_glue import build_meta_model, free_comfy_memory, pil_to_image, return_memory

        if plan.model.path != model.path:
            raise UGPUMError(f"{NODE}: the plan was made for {plan.model.file_name}, not {model.file_name}; "
                             "connect the same UGPUM Loader to the Partition Planner and the trainer.")
        data, root = dataset_path(dataset)
        dest, lora_name = lora_save_path(save_name)
        out = run_folder(save_name)
        with user_errors(NODE):
            check_folders(out, dest.parent)
            cfg = make_config(model, plan, data, trigger_word, steps, learning_rate, alpha, seed,
                              sample_prompt, sample_every, save_name, frame_stride, timesteps, compile, root)
            encoders = make_encoders(model, clip, vae, [d.torch_device for d in plan.devices])
        resumed = resume and latest_checkpoint(out) is not None        # nothing saved yet: start over
        if not resumed:                                  # a new run never replaces an earlier one
            held = earlier_run(out, cfg) or (f"{lora_name} in the LoRA list" if dest.exists() else None)
            if held:
                raise UGPUMError(f"{NODE}: save name {cfg.output_name!r} is taken by an earlier run ({held}); "
                                 "give a new save name, or turn on resume to continue that run.")
        bar = comfy.utils.ProgressBar(steps)
        t_start = time.perf_counter()

        def report(message) -> None:                     # the engine's log, its marks as this pack's inputs
            log.info("UGPUM %.1fs: %s", time.perf_counter() - t_start, for_nodes(str(message)).strip())
        try:
            # ComfyUI runs nodes under torch.inference_mode(); training needs autograd back
            with user_errors(NODE), comfy_training_mode(), torch.inference_mode(False), torch.enable_grad():
                free_comfy_memory()
                module = build_meta_model(model.spec, TORCH_DTYPES[cfg.weight_dtype])
                hooks = dict(on_step=lambda step, total, loss: bar.update_absolute(step, total),
                             check_interrupt=mm.throw_exception_if_processing_interrupted, log=report,
                             # a run that stops early (Cancel, an error): list its LoRA so far with the LoRAs
                             on_partial_lora=lambda path: _publish(path, dest.with_name(path.name)))
                hooks["on_sample"] = lambda step, image: bar.update_absolute(     # live preview on the node
                    step, steps, preview=("JPEG", image.convert("RGB"), 512))
                result = train(cfg, out, encoders=encoders, model=module, key_prefix=model.key_prefix,
                               plan=plan.plan, resume=resumed, spec=model.spec, **hooks)
        finally:
            encoders = module = None
            return_memory()
        with user_errors(NODE):
            _publish(result.lora_path, dest)
        lora = comfy.utils.load_torch_file(str(dest), safe_load=True)
        curve = pil_to_image([loss_curve(result.losses)])
        samples = _samples_image(result.samples)
        steps_done = f"{result.steps_done} step{'' if result.steps_done == 1 else 's'}"
        if resumed:
            steps_done += f" (resumed at step {result.resumed_at})"
        elif resume:
            steps_done += " (no checkpoint to resume from: started over)"
        summary = (f"saved {lora_name}: {steps_done}, validation loss "
                   f"{result.validation_before:.4f} -> {result.validation_after:.4f}; run folder {out}")
        return io.NodeOutput(lora, lora_name, curve, samples, ui=ui.PreviewText(summary))

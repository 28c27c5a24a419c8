"""The one training configuration, shared by `python -m ugpum train`, the demo and the nodes."""
from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..arch import Workload, get_spec, model_ids
from ..arch.base import RECOMPUTE_SETTINGS
from ..placement.schedules import ALL_SETTINGS as SCHEDULE_SETTINGS
from ..compute.dtypes import TRAINING_DTYPES
from ..compute.modes import SETTINGS as BASE_COMPUTE_SETTINGS, held_dtype
from ..diffusion.flow import TIMESTEP_METHODS
from ..wording import EngineError, quoted, setting


class ConfigError(ValueError, EngineError):
    pass


MAX_RESOLUTION = 4096     # 16.8 MP per image: four times FLUX.2's 1024² and more than any preset trains at
MAX_FRAMES = 257          # Wan 2.1 makes 81-frame clips; the Partition Planner's frames input stops at 257
MAX_RANK = 1024
MAX_SEED = 2**63 - 1      # torch.Generator's seed range
# (setting, lowest, highest, what it is) for whole numbers and for numbers
_WHOLE_RANGES = (
    ("frame_stride", 1, 64, "take every Nth frame of a clip"),
    ("repeats", 1, 10_000, "times each image is used per epoch"),
    ("steps", 1, 10_000_000, "optimizer steps"),
    ("batch", 1, 256, "samples per micro-batch"),
    ("grad_accum", 1, 4096, "micro-batches per optimizer step"),
    ("replicas", 0, 64, "copies of the model side by side; 0: the planner chooses"),
    ("rank", 1, MAX_RANK, "the LoRA's rank"),
    ("warmup_steps", 0, 10_000_000, "steps of linear warmup"),
    ("seed", 0, MAX_SEED, "any whole number"),
    ("save_every", 0, 10_000_000, "steps between checkpoints; 0: by time only"),
    ("sample_every", 0, 10_000_000, "steps between samples; 0: none"),
    ("sample_steps", 0, 1000, "sampling steps; 0: the model's default"),
    ("sample_seed", 0, MAX_SEED, "any whole number"),
)
_LIST_EXAMPLES = {"devices": '["auto"], ["cuda:0", "cuda:1"] or ["cpu"]',
                  "targets": '["img_attn", "txt_attn"] (substrings of layer paths)'}
_NUMBER_RANGES = (
    ("weight_decay", 0.0, 10.0, "AdamW's decoupled weight decay"),
    ("max_grad_norm", 0.0, 1e6, "0 disables clipping"),
    ("save_every_minutes", 0.0, 1e6, "0: no timed checkpoints"),
)


def _type_problem(value, annotation: str) -> str:
    """'' when `value` fits the dataclass field's annotation, else what it must be (in words)."""
    annotation = str(annotation).replace(" ", "")
    if annotation.endswith("|None") or annotation.startswith("None|"):
        if value is None:
            return ""
        inner = _type_problem(value, annotation.replace("|None", "").replace("None|", ""))
        return inner and inner + ", or unset"
    if annotation == "bool":
        return "" if isinstance(value, bool) else "true or false"
    if annotation == "int":
        return "" if isinstance(value, int) and not isinstance(value, bool) else "a whole number"
    if annotation == "float":
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return "" if number and math.isfinite(value) else "a finite number"
    if annotation == "str":
        return "" if isinstance(value, str) else "text"
    if annotation == "list[str]":
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        return "" if ok else 'a list of text, such as ["a", "b"]'
    return ""                              # a type this check does not know: the field's own code checks it


# The longest file name one UTF-8 name may take on Linux, macOS and Windows filesystems (in bytes).
MAX_NAME_BYTES = 255
_WINDOWS_FORBIDDEN = '<>:"|?*'


def file_name_problem(name: str, longest_suffix: str = ".safetensors") -> str:
    """'' when `name` can be a file name on every common filesystem with `longest_suffix` added (the
    longest name the run writes from it), else what is wrong with it and how to fix it."""
    if not name.strip():
        return "is empty; give a name such as 'my_lora'"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "holds a control character (NUL, tab or line break); use letters, digits, '-' and '_'"
    if "/" in name or "\\" in name:
        return "holds a folder separator ('/' or '\\'); give a plain file name, no folders"
    if name.startswith("."):
        return "starts with a dot (a hidden file); start it with a letter or digit"
    if any(c in _WINDOWS_FORBIDDEN for c in name):
        return f"holds one of {' '.join(_WINDOWS_FORBIDDEN)}, which Windows cannot store in a file name"
    if name != name.rstrip(" ."):
        return "ends with a space or a dot, which Windows drops from file names"
    size = len((name + longest_suffix).encode("utf-8"))
    if size > MAX_NAME_BYTES:
        return (f"is too long: with {longest_suffix!r} it takes {size} bytes and a file name may take "
                f"{MAX_NAME_BYTES}; shorten it")
    return ""


def lora_stem(name: str) -> str:
    """The one rule every front end names a LoRA by (output_name, the node's save name): surrounding
    spaces and a trailing .safetensors (any case) are dropped, so "mine.safetensors" writes
    mine.safetensors, never mine.safetensors.safetensors."""
    stem = name.strip()
    return stem[:-len(".safetensors")].rstrip() if stem.lower().endswith(".safetensors") else stem


def _smallest_linear(spec) -> int:
    """The smallest in/out size of the layers a LoRA adapts on this model (a larger rank adds nothing)."""
    sizes = [min(lin.in_features, lin.out_features) for block in spec.blocks for lin in block.linears]
    return min(sizes) if sizes else MAX_RANK


@dataclass
class TrainConfig:
    model: str = "tiny-flux2"             # model id (see `python -m ugpum plan --help`)
    model_file: str = ""                  # the DiT .safetensors; empty: random weights (tiny models only)
    dataset: str = ""                     # image or clip (Wan) folder, or a musubi-tuner dataset .toml
    dataset_root: str | None = None       # every path the dataset names must lie inside this folder (the
                                          # nodes: ComfyUI's input/); unset: any folder (the command line)
    trigger: str = ""                     # prepended to every caption
    resolution: int = 1024
    frames: int = 1                       # Wan clips: 4k+1 frames from each clip's start
    frame_stride: int = 1                 # take every Nth frame of a clip (2: half the frame rate)
    repeats: int = 1
    caption_dropout: float = 0.0
    steps: int = 50
    batch: int = 1                        # samples per micro-batch (of one latent and text shape)
    grad_accum: int = 1                   # micro-batches per optimizer step
    lr: float = 1e-4
    lr_schedule: str = "constant"         # constant | cosine
    warmup_steps: int = 0
    optimizer: str = "adamw"              # adamw | adamw8bit (needs bitsandbytes)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0            # 0 disables clipping
    rank: int = 16
    alpha: float = 16.0
    targets: list[str] = field(default_factory=list)   # substrings of linear paths; empty: all
    timesteps: str = "auto"               # auto (FLUX.2: flux2_shift, Wan: shift) | flux2_shift | flux2 |
                                          # uniform | logit_normal | sigmoid | shift (README "Timestep sampling")
    shift: float = 3.0                    # for timesteps = "shift"
    weighting: str = "none"               # none | sigma_sqrt | cosmap
    seed: int = 42
    recompute: str = "auto"               # blocks recomputed in backward (per-block checkpointing): auto (the
                                          # planner keeps the activations the memory holds) | all | none
    autocast: bool = True                 # bf16 autocast on CUDA
    weight_dtype: str = "bf16"            # bf16 | fp8 | fp32 (base weights, frozen)
    guidance: float | None = None         # FLUX.2 dev's guidance-embedding input in training; unset: 1.0,
                                          # as musubi-tuner trains guidance-distilled models; klein/Wan
                                          # have no such input and ignore it (the run log says so)
    sample_guidance: float | None = None  # the same input for previews; unset: the model's sampling
                                          # default (4.0, ComfyUI's FLUX.2 template)
    devices: list[str] = field(default_factory=lambda: ["auto"])
    desktop_gib: float | None = None      # GPU memory left to the desktop on each card; unset: 0.5 on a card that
                                          # drives a display (a card described by name or size is taken to), else 0
    schedule: str = "auto"                # micro-batch order: auto | sequential | gpipe | 1f1b; distributed runs
    #                                       also interleaved-1f1b | zero-bubble (two stages per rank)
    replicas: int = 0                     # copies of the model training a step's micro-batches side by side, LoRA
                                          # gradients averaged each step: 0 the planner chooses (ugpum/planning/
                                          # space.py), 1 one copy (the split), R copies over devices / R GPUs each
    save_every: int = 0                   # a checkpoint (and LoRA) every N steps; 0: by time only
    save_every_minutes: float = 10.0      # ... and whenever this much training time passed since the last
                                          # (0: off); every stop saves as well (Ctrl-C, SIGTERM, Cancel, errors)
    sample_every: int = 10                # 0: no samples
    sample_prompt: str = ""
    sample_steps: int = 0                 # 0: the model's default
    sample_seed: int = 0
    output_name: str = "ugpum_lora"
    cache_dir: str = ""                   # latents/text cache; empty: <out>/cache
    stand_in_encoders: bool = False       # fixed random encoders instead of a VAE/text encoder
                                          # (tiny models, benchmarks on random weights)
    compile: str = "auto"                 # compiled blocks (ugpum/compute/compile.py): auto (CUDA with Triton) | on | off
    base_compute: str = "bf16"            # the frozen base's matmuls: auto | bf16 | fp8 | int8 (ugpum/compute/modes/);
                                          # auto: the fastest forecast within the modes' quality bound, bf16 on a tie

    def validate(self) -> "TrainConfig":
        """Every setting's type, then its range (against the model where it matters), as one sentence
        naming the setting; the same for the command line, a TOML config and the nodes. With a
        dataset_root, every path the dataset names must lie inside it (DatasetError otherwise)."""
        if isinstance(self.output_name, str):
            self.output_name = lora_stem(self.output_name)       # (one rule for names in every front end)
        for f in dataclasses.fields(self):
            problem = _type_problem(getattr(self, f.name), f.type)
            if problem and f.name in _LIST_EXAMPLES:
                problem = f"a list of text such as {_LIST_EXAMPLES[f.name]}"
            if problem:
                raise ConfigError(f"setting '{f.name}' = {quoted(getattr(self, f.name))}: must be {problem}")

        def need(ok: bool, name: str, what: str):
            if not ok:
                raise ConfigError(f"setting '{name}' = {quoted(getattr(self, name))}: {what}")
        need(self.model in model_ids(), "model", f"unknown model; known: {', '.join(model_ids())}")
        spec = get_spec(self.model)
        need(64 <= self.resolution <= MAX_RESOLUTION and self.resolution % 16 == 0, "resolution",
             f"must be a multiple of 16 from 64 to {MAX_RESOLUTION} pixels (the side of a square training "
             "image; 1024 for FLUX.2, 640 for Wan at 480p)")
        frames_error = spec.frames_error(self.frames)
        need(not frames_error, "frames", frames_error)
        need(self.frames <= MAX_FRAMES, "frames", f"at most {MAX_FRAMES} (Wan 2.1 makes 81-frame clips)")
        for name, low, high, what in _WHOLE_RANGES:
            need(low <= getattr(self, name) <= high, name, f"must be from {low} to {high:,} ({what})")
        need(self.rank <= _smallest_linear(spec), "rank",
             f"must be at most {_smallest_linear(spec)}, the smallest layer a LoRA on {spec.id} adapts")
        for name, low, high, what in _NUMBER_RANGES:
            need(low <= getattr(self, name) <= high, name, f"must be from {low:g} to {high:g} ({what})")
        need(0 <= self.caption_dropout < 1, "caption_dropout", "must be in [0, 1)")
        need(0 < self.lr <= 1, "lr", "must be in (0, 1] (1e-4 is usual for a LoRA)")
        need(0 < self.alpha <= 4 * MAX_RANK, "alpha", f"must be in (0, {4 * MAX_RANK}] (usually the rank)")
        need(0 < self.shift <= 100, "shift", "must be in (0, 100] (Wan trains at 3)")
        need(self.lr_schedule in ("constant", "cosine"), "lr_schedule", "constant or cosine")
        need(self.optimizer in ("adamw", "adamw8bit"), "optimizer", "adamw or adamw8bit")
        need(self.timesteps in ("auto", *TIMESTEP_METHODS), "timesteps", "auto, " + ", ".join(TIMESTEP_METHODS))
        need(self.weighting in ("none", "sigma_sqrt", "cosmap"), "weighting", "none, sigma_sqrt or cosmap")
        need(self.weight_dtype in TRAINING_DTYPES, "weight_dtype", ", ".join(TRAINING_DTYPES))
        need(self.autocast or self.weight_dtype != "bf16", "autocast", "bf16 weights (weight_dtype = bf16) compute "
             "under autocast: set autocast = true, or weight_dtype = fp32")
        need(self.guidance is None or 0 <= self.guidance <= 100, "guidance",
             "a number from 0 to 100 (training default 1.0), or leave it unset")
        need(self.desktop_gib is None or 0 <= self.desktop_gib <= 64, "desktop_gib",
             "GiB from 0 to 64 left to the desktop on each GPU (0: a card that drives no display), or leave it unset")
        need(self.sample_guidance is None or 0 <= self.sample_guidance <= 100, "sample_guidance",
             "a number from 0 to 100 (FLUX.2 dev's sampling default is 4.0), or leave it unset")
        need(self.schedule in SCHEDULE_SETTINGS, "schedule",
             f"auto, sequential, gpipe or 1f1b ({setting('distributed')} also takes interleaved-1f1b or zero-bubble)")
        need(bool(self.devices) and all(d.strip() for d in self.devices), "devices",
             'a list of devices such as ["auto"], ["cuda:0", "cuda:1"] or ["cpu"]')
        need(all(t.strip() for t in self.targets), "targets", "names of layers (substrings of their paths), no empty ones")
        problem = file_name_problem(self.output_name, f"_step{self.steps}.safetensors")
        need(not problem, "output_name", problem)
        need(self.compile in ("auto", "on", "off"), "compile", "auto, on or off")
        need(self.base_compute in BASE_COMPUTE_SETTINGS, "base_compute", ", ".join(BASE_COMPUTE_SETTINGS))
        need(self.recompute in RECOMPUTE_SETTINGS, "recompute", "auto (the planner keeps the activations the "
             "memory holds), all (every block recomputed in backward) or none")
        if self.dataset_root is not None and self.dataset:
            from .musubi_toml import check_inside
            check_inside(self.dataset, self.dataset_root)        # DatasetError naming the path outside
        return self

    @property
    def checkpointing(self) -> bool:
        """The older switch, read: whether any block may be recomputed in backward."""
        return self.recompute != "none"

    def workload(self) -> Workload:
        """One step's shape, as the planner sees it (text at ComfyUI's padded 512 tokens). An 8-bit
        base_compute holds the base weights as its mode does (an 8-bit one: 1 byte each, as fp8 weights). compile=auto
        is planned as compiled (what it does on a CUDA GPU with Triton; it says so where it cannot)."""
        held = held_dtype(self.base_compute, self.weight_dtype)          # (auto: the planner's)
        return Workload(width=self.resolution, height=self.resolution, frames=self.frames, batch=self.batch,
                        rank=self.rank, recompute=self.recompute, held_dtype=held, loaded_dtype=self.weight_dtype,
                        compiled=self.compile != "off", base_compute=self.base_compute)


# Built-in profiles: the settings a newcomer starts from.
from ..catalog.profiles import PROFILES  # noqa: E402,F401 (the built-in profiles; TrainConfig starts from them)


def load_config(profile: str = "", toml_file: str | Path = "", overrides: dict | None = None) -> TrainConfig:
    """Profile defaults, then a TOML file's keys (top level and [train]: `file_settings`), then explicit
    overrides."""
    values: dict = {}
    if profile:
        if profile not in PROFILES:
            raise ConfigError(f"unknown profile {quoted(profile)}; built-in: {', '.join(PROFILES)}")
        values.update(_recompute_from_switch(PROFILES[profile]))
    if toml_file:
        path = Path(toml_file)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8-sig"))   # (a BOM, as Notepad writes one, is no TOML)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"{path}: cannot read the config ({e})") from None
        values.update(_recompute_from_switch(file_settings(data, path), str(path)))
    values.update(_recompute_from_switch({k: v for k, v in (overrides or {}).items() if v is not None}))
    _refuse_unknown(values, "the settings")
    return TrainConfig(**values).validate()


def file_settings(data: dict, path: Path) -> dict:
    """Every setting a config file holds, each read or refused by name: the keys of [train] and those at
    the top of the file (with or without a [train] table; a key in both places is refused), unknown keys
    with the setting they most likely mean, and any other table with where its keys belong."""
    table = data.get("train", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [train] must be a table of settings (train.steps = 50, ...), "
                          f"not {type(table).__name__}")
    top = {k: v for k, v in data.items() if k != "train"}
    tables = [_table_name(k, v) for k, v in top.items() if _is_table(v)]
    tables += [_table_name(f"train.{k}", v) for k, v in table.items() if _is_table(v)]
    if tables:
        raise ConfigError(f"{path}: {_tables_note(sorted(tables))}")
    twice = sorted(set(top) & set(table))
    if twice:
        shown = ", ".join(f"{k} ({quoted(top[k])} at the top, {quoted(table[k])} in [train])" for k in twice)
        raise ConfigError(f"{path}: {'settings' if len(twice) > 1 else 'setting'} {shown} given twice; keep each "
                          "in one place")
    _refuse_unknown(top, f"{path} (at the top of the file)" if table else str(path))
    _refuse_unknown(table, f"{path} [train]")
    return {**top, **table}


def _is_table(value) -> bool:
    return isinstance(value, dict) or (isinstance(value, list) and bool(value) and
                                       all(isinstance(v, dict) for v in value))


def _table_name(key: str, value) -> str:
    return f"[[{key}]]" if isinstance(value, list) else f"[{key}]"


# The tables of a musubi-tuner dataset config, given where a training config belongs.
_DATASET_TABLES = {"[general]", "[[datasets]]", "[datasets]"}


def _tables_note(tables: list[str]) -> str:
    """What a config file's tables other than [train] are, and the fix."""
    many = len(tables) > 1
    if set(tables) <= _DATASET_TABLES:
        return (f"{' and '.join(tables)} {'are the tables' if many else 'is a table'} of a musubi-tuner dataset "
                f"config: give this file as {setting('dataset')}, and the run's settings in [train] of a config")
    guesses = [f"{t} (did you mean [train]?)" if difflib.get_close_matches(t.strip("[]").lower(), ["train"], cutoff=0.6)
               else t for t in tables]
    return (f"{'tables' if many else 'table'} {', '.join(guesses)} {'are' if many else 'is'} not read: the settings "
            "are the keys of [train] (or the top of the file); move the keys you mean there, each a setting of "
            "docs/train_config_example.toml")


# The older on/off switch (and other trainers' name for it), read as recompute: true = all, false = none.
RECOMPUTE_SWITCHES = ("checkpointing", "gradient_checkpointing")


def _recompute_from_switch(values: dict, where: str = "the settings") -> dict:
    """`values` (one layer: a profile, a TOML file, the overrides) with checkpointing = true/false, as older
    configs and other trainers write it, turned into recompute = all/none; refused, naming both, where it
    contradicts a recompute in the same layer."""
    values = dict(values)
    for name in RECOMPUTE_SWITCHES:
        if name not in values:
            continue
        switch = values.pop(name)
        if not isinstance(switch, bool):
            raise ConfigError(f"{where}: setting '{name}' = {quoted(switch)}: must be true or false (or use recompute "
                              "= auto, all or none)")
        meant = "all" if switch else "none"
        if values.setdefault("recompute", meant) != meant:
            raise ConfigError(f"{where}: settings '{name}' = {str(switch).lower()} and 'recompute' = "
                              f"{quoted(values['recompute'])} disagree: keep only recompute (auto, all or none)")
    return values


# What other trainers (musubi-tuner, kohya's sd-scripts, diffusers' scripts) call some of these settings.
OTHER_NAMES = {"learning_rate": "lr", "network_dim": "rank", "network_alpha": "alpha", "lora_rank": "rank",
               "lora_alpha": "alpha", "max_train_steps": "steps", "train_batch_size": "batch",
               "batch_size": "batch", "gradient_accumulation_steps": "grad_accum", "lr_scheduler": "lr_schedule",
               "lr_warmup_steps": "warmup_steps", "optimizer_type": "optimizer", "dit": "model_file",
               "timestep_sampling": "timesteps",
               "discrete_flow_shift": "shift", "caption_dropout_rate": "caption_dropout",
               "save_every_n_steps": "save_every", "sample_every_n_steps": "sample_every",
               "mixed_precision": "weight_dtype", "train_data_dir": "dataset", "dataset_config": "dataset"}


def closest_setting(name: str) -> str | None:
    """The setting a misspelt or foreign name most likely means, or None."""
    known = [f.name for f in dataclasses.fields(TrainConfig)]
    if name in OTHER_NAMES:
        return OTHER_NAMES[name]
    close = difflib.get_close_matches(name.lower().replace("-", "_"), known, n=1, cutoff=0.6)
    return close[0] if close else None


def _refuse_unknown(values: dict, where: str) -> None:
    """One sentence naming every unknown key of `where`, each with the setting it most likely means."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(k for k in values if k not in known and k not in RECOMPUTE_SWITCHES)
    if not unknown:
        return
    named = [f"{k} (did you mean {guess}?)" if (guess := closest_setting(k)) else k for k in unknown]
    raise ConfigError(f"{where}: unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(named)}; "
                      f"the settings are {', '.join(sorted(known))}")

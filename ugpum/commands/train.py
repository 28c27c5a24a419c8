"""`python -m ugpum train`: a LoRA from a profile or a config, on real model files or a tiny model.

The engine (`ugpum.train.loop.train`) takes the DiT and the encoders from its caller; this verb,
the demo and the nodes are its callers. Here the DiT is ComfyUI's own module class (built on the
meta device and streamed from its file by the plan), and the text encoder and VAE are loaded by
ComfyUI's own loaders, as the stock CLIPLoader and VAELoader load them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..arch import ArchSpec, get_spec, recognise
from ..compute.modes import SETTINGS as BASE_COMPUTE_SETTINGS
from ..planning.devices import CPU_TRAINABLE_PARAMS, resolve_devices
from ..placement.schedules import ALL_SETTINGS
from ..compute.dtypes import TORCH_DTYPES
from ..train.config import PROFILES, TrainConfig, load_config
from ..folders import check_writable, dangling_link, too_long_name
from ..startup import stops_while_starting
from .bridge import comfy_bridge
from .prog import printer
from .errors import UsageError


@dataclass(frozen=True)
class ModelFiles:
    """What a real-model run loads: the DiT, its text encoder and its VAE."""
    dit: Path
    text_encoder: Path
    vae: Path


DESCRIPTION = """\
Train a LoRA on a FLUX.2 or Wan 2.1 diffusion transformer, split over this machine's GPUs by the
planner (blocks swapped from host memory where they do not fit). Start a run from a built-in
--profile or a --config TOML (flags change single settings), with a --dataset and the model files
(--models: your ComfyUI's models/ folder), into --out. A stopped run (Ctrl-C, SIGTERM) saves first;
`--resume DIR` alone continues it with the settings its checkpoint records."""

EPILOG = """\
examples:
  %(prog)s --profile klein-9b-1024 --dataset my_images/ --models ~/ComfyUI/models --out runs/me
  %(prog)s --resume runs/me                 continue a stopped run, to its last step
  %(prog)s --resume runs/me --steps 100     train a run on to 100 steps in all
  %(prog)s --profile tiny-flux2 --dataset demo_datasets/loranne --devices cpu --steps 5 --out out/tiny
every setting, its default and meaning: docs/train_config_example.toml"""


def add_train_parser(sub) -> None:
    import argparse
    p = sub.add_parser("train", help="train a LoRA (the engine the LoRA Trainer node uses)", description=DESCRIPTION,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", help="a built-in profile to start from: " + ", ".join(PROFILES))
    p.add_argument("--config", metavar="FILE.toml", help="a TOML file of settings (top level or [train]; "
                                                          "docs/train_config_example.toml names them all); with "
                                                          "--profile, it changes the profile's settings")
    p.add_argument("--dataset", metavar="DIR", help="folder of images or clips (Wan) with same-stem .txt captions, "
                                                    "or a musubi dataset .toml")
    p.add_argument("--models", metavar="DIR", help="ComfyUI's models/ folder holding the profile's DiT, text "
                                                   "encoder and VAE (what `ugpum download` puts there); its "
                                                   "ComfyUI is the one used")
    p.add_argument("--model", metavar="FILE", help="the DiT .safetensors file (its header names the model)")
    p.add_argument("--text-encoder", metavar="FILE", help="the text encoder file (as ComfyUI's CLIPLoader loads it)")
    p.add_argument("--vae", metavar="FILE", help="the VAE file (as ComfyUI's VAELoader loads it)")
    p.add_argument("--comfyui", metavar="DIR", help="the ComfyUI whose model code runs (default: $COMFYUI_PATH, the "
                                                    "ComfyUI around --models, the one this pack is installed in, "
                                                    "else the packaged one; `ugpum doctor` names it)")
    p.add_argument("--devices", metavar="LIST", help="auto (every GPU), cuda:0,cuda:1, or cpu (the tiny test models "
                                                     "only); default: the profile's or config's, else auto")
    p.add_argument("--steps", type=int, metavar="N",
                   help="optimizer steps in all (default: the profile's or config's); with --resume, the run's new "
                        "total: raise it to train a run on past the steps it was started with")
    p.add_argument("--frames", type=int, help="Wan clips: frames from each clip's start (4k+1, e.g. 17 or 33)")
    p.add_argument("--batch", type=int, metavar="B", help="samples per micro-batch (items of one bucket and text "
                                                          "length; default 1)")
    p.add_argument("--grad-accum", type=int, metavar="M",
                   help="micro-batches per optimizer step, pipelined over the GPUs (default 1; the effective batch "
                        "is B x M)")
    p.add_argument("--schedule", choices=ALL_SETTINGS,
                   help="order of the micro-batches over the stages (default auto: the best for the plan); with "
                        "--distributed also interleaved-1f1b or zero-bubble (two pipeline stages per rank)")
    p.add_argument("--replicas", type=int, metavar="R",
                   help="copies of the model side by side, each training its share of a step's micro-batches on its "
                        "own GPU(s), LoRA gradients averaged each step (default 0: the planner chooses; 1: one copy)")
    p.add_argument("--resume", metavar="DIR", help="continue the run whose output folder is DIR, with the settings "
                                                   "its checkpoint records (the same run only; flags change only "
                                                   "--steps, --devices, --schedule, --sample-every and the like)")
    p.add_argument("--out", metavar="DIR", help="output folder (LoRA, metrics.jsonl, samples/, checkpoints/) of a "
                                                "new run")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out (default: refuse)")
    p.add_argument("--stand-in-encoders", action="store_true",
                   help="fixed random encoders instead of a VAE/text encoder (benchmarks on random weights)")
    p.add_argument("--sample-every", type=int, metavar="N", help="render a sample every N steps (0: never)")
    p.add_argument("--compile", choices=["auto", "on", "off"],
                   help="compiled blocks (default auto: on CUDA GPUs with Triton; says once why not elsewhere)")
    p.add_argument("--base-compute", choices=BASE_COMPUTE_SETTINGS,
                   help="the frozen base's matmuls (default bf16; fp8 on Ada/Hopper/Blackwell, int8 on Ampere)")
    # past one machine (README "Past one machine"): under torchrun, one pipeline stage per rank
    p.add_argument("--distributed", action="store_true",
                   help="run as one rank of a torchrun job on torch.distributed.pipelining (N ranks = stages x "
                        "--data-parallel)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="R",
                   help="with --distributed: R replicas of the pipeline, LoRA gradients summed (default 1)")


def _overrides(args) -> dict:
    return {"dataset": args.dataset, "steps": args.steps, "frames": args.frames, "batch": args.batch,
            "grad_accum": args.grad_accum, "schedule": args.schedule, "replicas": args.replicas,
            "devices": args.devices.split(",") if args.devices else None,
            "stand_in_encoders": True if args.stand_in_encoders else None,
            "sample_every": args.sample_every, "compile": args.compile, "base_compute": args.base_compute}


def config_from_args(args) -> TrainConfig:
    """The run's settings: a profile and/or a config with the flags on top; for `--resume DIR` alone, the
    settings its checkpoint records with the flags on top. Paths become absolute, so that a resume from
    another folder finds the same files."""
    if args.config or args.profile:
        cfg = load_config(args.profile or "", args.config or "", _overrides(args))
        source = f"profile {args.profile}" if args.profile else f"config {args.config}"
    elif args.resume:
        cfg, source = recorded_config(args.resume, _overrides(args)), f"the run in {args.resume}"
        check_recorded_files(args.resume, {"dataset": None if args.dataset else cfg.dataset,
                                           "model": None if args.model else cfg.model_file})
    else:
        raise UsageError("give --profile NAME or --config FILE.toml (" + ", ".join(PROFILES) + "), or --resume DIR "
                         "to continue a run")
    if args.model:
        found = recognise(args.model)[0].id
        if found != cfg.model:
            raise UsageError(f"--model {args.model} holds {found}, but {source} trains {cfg.model}; give a "
                             f"{cfg.model} file, or a profile or config for {found}")
        cfg.model_file = args.model
    for name in ("dataset", "model_file"):
        if getattr(cfg, name):
            setattr(cfg, name, str(Path(getattr(cfg, name)).expanduser().absolute()))
    return cfg


def recorded_run(out: str) -> dict:
    """state.json of the newest intact checkpoint of the run in `out`: its settings (identity.config)
    and what it was loaded from (inputs); one sentence when there is none to read."""
    from ..train.run.checkpoint import latest_checkpoint, read_state
    from ..train.run.layout import RunFolder
    folder = latest_checkpoint(Path(out).expanduser())
    if folder is None:
        raise UsageError(f"--resume {out}: no intact checkpoint in {RunFolder(Path(out)).checkpoints}, so nothing records "
                         "the run's settings; start it again with --profile or --config and --out")
    try:
        return read_state(folder)
    except (OSError, ValueError) as err:
        raise UsageError(f"--resume {out}: cannot read {folder / 'state.json'} ({err}); start the run again with "
                         "--profile or --config and --out") from None


def recorded_config(out: str, overrides: dict) -> TrainConfig:
    """The settings of the run in `out`, as its checkpoint records them, with `overrides` (flags) on top."""
    import dataclasses
    saved = (recorded_run(out).get("identity") or {}).get("config")
    if not isinstance(saved, dict):
        raise UsageError(f"--resume {out}: its checkpoint records no settings (written by an older UGPUM); give "
                         "the run's --profile or --config as well")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in saved.items() if k in known}
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return TrainConfig(**values).validate()
    except TypeError as err:
        raise UsageError(f"--resume {out}: its checkpoint's settings do not fit this UGPUM ({err}); give the run's "
                         "--profile or --config as well") from None


# what a run records of the files it was loaded from -> (what it is, the flag that gives its new place)
RECORDED_FILES = {"dataset": ("dataset", "--dataset DIR"), "model": ("model file", "--model FILE"),
                  "text_encoder": ("text encoder", "--text-encoder FILE"), "vae": ("VAE", "--vae FILE"),
                  "models": ("models folder", "--models DIR"), "comfyui": ("ComfyUI", "--comfyui DIR")}


def check_recorded_files(out: str, paths: dict) -> None:
    """For `--resume DIR` alone: each file or folder the checkpoint records (`paths`: name -> recorded
    path, None where the command line gives it again) must be there still; one that moved is named as
    the checkpoint records it, with the flag that continues the run from its new place."""
    from ..train.run.checkpoint import latest_checkpoint
    for name, path in paths.items():
        if path and not Path(path).exists():
            what, flag = RECORDED_FILES[name]
            checkpoint = latest_checkpoint(Path(out).expanduser())
            raise UsageError(f"--resume {out}: the run's {what} {path}, as its checkpoint {checkpoint} records it, "
                             f"is not there any more; if it moved, continue the run from its new place with "
                             f"--resume {out} {flag}")


def recorded_inputs(args) -> dict:
    """For a resume: the files the run loaded its encoders from (and its --models, --comfyui), as its
    checkpoint records them, where the command line does not give them again."""
    if not args.resume:
        return {}
    try:
        inputs = recorded_run(args.resume).get("inputs") or {}
    except UsageError:
        return {}                        # (open_run says what is wrong with the checkpoint, in its words)
    return inputs if isinstance(inputs, dict) else {}


def model_files(cfg: TrainConfig, models: str | None, dit: str | None, text_encoder: str | None,
                vae: str | None, spec: ArchSpec | None = None) -> ModelFiles | None:
    """The files of a real-model run: explicit paths first, the rest from a ComfyUI models/ folder by
    the catalog's names; None for runs without real encoders (tiny models, stand-in benchmarks).
    Anything missing is one sentence naming each file and the command that fetches them. `spec`: the
    model's, as the verb resolved it (None: `cfg.model`'s), here and below."""
    from ..catalog import models as catalog
    from .download import download_command
    spec = spec or get_spec(cfg.model)
    if cfg.stand_in_encoders:
        if text_encoder or vae or models:
            raise UsageError("--stand-in-encoders replaces the text encoder and VAE; drop --models, "
                             "--text-encoder and --vae (or drop --stand-in-encoders)")
        return None
    if models is None and not (text_encoder and vae):
        if spec.params <= CPU_TRAINABLE_PARAMS and not (text_encoder or vae):
            return None                                       # tiny models: stand-in encoders
        raise UsageError(f"{spec.id} needs its text encoder and VAE: give --models <ComfyUI>/models (the files "
                         f"`{download_command(cfg.model)}` puts there), or "
                         "--text-encoder FILE --vae FILE")
    explicit = {"dit": dit or cfg.model_file or None, "text_encoder": text_encoder, "vae": vae}
    entry = catalog.MODELS.get(spec.id)
    chosen: dict[str, Path] = {}
    missing: list[str] = []
    for role, given in explicit.items():
        if given:
            path = Path(given).expanduser()
            if not path.is_file():
                flag = {"dit": "--model", "text_encoder": "--text-encoder", "vae": "--vae"}[role]
                missing.append(f"{flag} {path} (no such file)")
            chosen[role] = path
            continue
        if models is None or entry is None:
            flag = {"dit": "--model FILE", "text_encoder": "--text-encoder FILE", "vae": "--vae FILE"}[role]
            raise UsageError(f"{spec.id}: no {catalog.ROLE_NAMES[role]} given; add {flag}")
        root = Path(models).expanduser()
        if not root.is_dir():
            raise UsageError(f"--models {root}: no such folder (give ComfyUI's models/ folder)")
        files = [entry.dit[cfg.weight_dtype] if role == "dit" and cfg.weight_dtype in entry.dit
                 else entry.dit[entry.default_dtype] if role == "dit"
                 else getattr(entry, role)]
        path = files[0].dest(root)
        if not path.is_file():
            missing.append(f"{files[0].folder}/{files[0].filename}")
        chosen[role] = path
    if missing:
        where = f" in {models}" if models else ""
        raise UsageError(f"{spec.title}: missing {', '.join(missing)}{where}; get them with "
                         f"{download_command(cfg.model, models)}")
    return ModelFiles(chosen["dit"], chosen["text_encoder"], chosen["vae"])


def build_model(cfg: TrainConfig, bridge=None, spec: ArchSpec | None = None):
    """(DiT, key prefix): ComfyUI's module on the meta device (streamed from `cfg.model_file` when
    placed), or seeded random weights for a tiny model without a file."""
    bridge = bridge or comfy_bridge()
    return bridge.build_dit(spec or get_spec(cfg.model), TORCH_DTYPES[cfg.weight_dtype], cfg.model_file, seed=cfg.seed)


def build_encoders(cfg: TrainConfig, files: ModelFiles | None, bridge=None, spec: ArchSpec | None = None):
    """ComfyUI's text encoder and VAE from `files` (checked against this ComfyUI first), else the
    stand-ins of tiny models and benchmarks."""
    spec = spec or get_spec(cfg.model)
    if files is None:
        if not (cfg.stand_in_encoders or spec.params <= CPU_TRAINABLE_PARAMS):
            raise UsageError(f"{spec.id} needs its text encoder and VAE: give --models <ComfyUI>/models, or "
                             "--text-encoder FILE --vae FILE (or --stand-in-encoders for a benchmark on random weights)")
        from ..train.encoders import StandInEncoders
        return StandInEncoders(spec)
    bridge = bridge or comfy_bridge()
    bridge.check_text_encoder_support(spec)
    return bridge.load_encoders(files.text_encoder, files.vae, spec, devices=cfg.devices)


def run_training(cfg: TrainConfig, out: str | Path, files: ModelFiles | None = None, comfyui=None,
                 spec: ArchSpec | None = None, **hooks):
    """One training run from the command line (or a test, or the demo): the ComfyUI to use (`comfyui`,
    as `find_comfyui` found it; default: the one it finds), the DiT, the encoders, then the engine.
    `hooks` go to `ugpum.train.loop.train` (resume, log, inputs, ...); a `log` words the settings the
    run log marks (`prog.printer`)."""
    from ..train.loop import train
    spec = spec or get_spec(cfg.model)
    with stops_while_starting():          # (the command line) ComfyUI's imports and the model: nothing written yet
        bridge = comfy_bridge()
        import torch
        folder = bridge.comfyui_folder(comfyui) if comfyui is not None else bridge.find_comfyui_or_raise()
        bridge.import_comfy(folder, cpu=not torch.cuda.is_available())
        if files is not None:
            cfg.model_file = str(files.dit)
        encoders = build_encoders(cfg, files, bridge, spec)
        model, key_prefix = build_model(cfg, bridge, spec)
    with bridge.comfy_training_mode():
        return train(cfg, out, model=model, encoders=encoders, key_prefix=key_prefix, spec=spec, **hooks)


def check_out_folder(out: str, flag: str) -> None:
    """Refuse, before any work, an output folder that cannot be made or written in: one sentence with
    the fix. The folder itself is made only by the run."""
    path = Path(out).expanduser().absolute()
    if too_long_name(path):                             # a name no filesystem takes (it cannot even be looked up)
        raise UsageError(f"{flag} {out[:60]}...: {too_long_name(path)}; give {flag} a shorter path")
    if dangling_link(path):                             # (mkdir would meet the link: "File exists")
        raise UsageError(f"{flag} {out}: {dangling_link(path)}; make that folder, or give {flag} another folder")
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {out} is a file, not a folder; give {flag} a folder (it is made if missing)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {out}: {existing} is a file, so no folder can be made inside it; give {flag} "
                         "a path under a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        if hasattr(os, "statvfs") and os.statvfs(existing).f_flag & os.ST_RDONLY:
            raise UsageError(f"{flag} {out}: {existing} is on a read-only filesystem; give {flag} a folder on a "
                             "writable disk")
        raise UsageError(f"{flag} {out}: this user cannot write in {existing} (permission denied); give {flag} a "
                         f"folder you can write to, or make it writable (chmod u+w {existing})")


def find_comfyui(cfg: TrainConfig, spec: ArchSpec, comfyui: str | None, models: str | None, files: list) -> object:
    """The ComfyUI this run uses (the one `doctor` names for the same flags), refused before anything is
    read or downloaded when it cannot load the model's text encoder."""
    bridge = comfy_bridge()
    found = bridge.locate_comfyui(comfyui, [models, *files])
    if found is None:
        raise UsageError(f"no ComfyUI found: give --comfyui DIR or set COMFYUI_PATH to {bridge.NEW_COMFYUI}")
    if not cfg.stand_in_encoders and spec.params > CPU_TRAINABLE_PARAMS:
        bridge.check_comfyui_for(found, spec)
    return found


def check_devices(cfg: TrainConfig, spec: ArchSpec) -> None:
    """Refuse devices that cannot train this model (the CPU for a real model, described GPUs), before
    anything is looked for, loaded or downloaded."""
    import torch
    if spec.params > CPU_TRAINABLE_PARAMS and not torch.cuda.is_available():
        raise UsageError(f"{spec.id} cannot train on the CPU, and torch sees no CUDA GPU here; train on a machine "
                         "with an NVIDIA GPU (`python -m ugpum doctor` shows what torch sees), or read the forecast "
                         f"for one: python -m ugpum plan --model {spec.id} --gpu rtx4090")
    resolve_devices(list(cfg.devices), spec, training=True, probe=False)


def random_weights_note(cfg: TrainConfig, spec: ArchSpec) -> str | None:
    """What a run on random weights says first: its LoRA learns nothing a real model can use."""
    if not cfg.model_file and spec.params <= CPU_TRAINABLE_PARAMS:
        return (f"note: {spec.id} is a tiny test model with random weights and stand-in encoders: this run tries the "
                "pipeline and learns no real picture, and its LoRA fits only this random model (for a real LoRA: "
                "--profile klein-9b-1024 --models <ComfyUI>/models)")
    if cfg.stand_in_encoders:
        return ("note: stand-in encoders (a fixed random text encoder and VAE) instead of the model's: the LoRA learns "
                "from random features, for benchmarks only")
    return None


def run_train(args) -> int:
    with stops_while_starting():          # (the command line) the checks and the files to load: nothing written yet
        out, cfg, spec, files, comfyui, inputs = prepare_run(args)
    if getattr(args, "distributed", False) or getattr(args, "data_parallel", 1) != 1:   # torchrun ... --distributed
        from .train_distributed import run_train_distributed
        return run_train_distributed(args, cfg, spec, out, files, build_model, build_encoders, comfyui, inputs)
    from ..train.run.folder import RunFinished
    try:
        result = run_training(cfg, out, files, comfyui, spec, resume=bool(args.resume), overwrite=args.overwrite,
                              inputs=inputs, log=printer("train"))
    except RunFinished as finished:                  # not an error: the run is done
        printer("train")(finished)
        return 0
    print(f"LoRA: {result.lora_path}")
    return 0


def prepare_run(args) -> tuple:
    """(out, settings, model spec, model files, ComfyUI, inputs) of the run the flags ask for, each checked, before
    anything is loaded or written."""
    if args.resume and args.out and Path(args.resume).resolve() != Path(args.out).resolve():
        raise UsageError(f"--resume {args.resume} continues the run in that folder; drop --out {args.out} "
                         "(a resumed run stays in its own folder)")
    if args.resume and args.overwrite:
        raise UsageError("--resume continues a run and --overwrite replaces one: give one of them")
    out = args.resume or args.out
    if not out:
        raise UsageError("give --out DIR (or --resume DIR to continue a run)")
    check_out_folder(out, "--resume" if args.resume else "--out")
    cfg = config_from_args(args)
    if cfg.cache_dir:                                   # before the encoders load: one sentence with the fix
        check_writable(cfg.cache_dir, "cache_dir", "set cache_dir to a folder you can write in")
    if not cfg.dataset:
        raise UsageError("no dataset: give --dataset DIR (or set dataset in the config)")
    spec = get_spec(cfg.model)                          # the one look-up: passed along from here
    check_devices(cfg, spec)                            # a real model without a GPU: said before any file
    recorded = recorded_inputs(args)
    check_recorded_files(args.resume, {name: None if getattr(args, name) else recorded.get(name)
                                       for name in ("text_encoder", "vae", "models", "comfyui")})
    models = args.models or recorded.get("models")
    given = {"text_encoder": args.text_encoder or recorded.get("text_encoder"),
             "vae": args.vae or recorded.get("vae")}
    comfyui = find_comfyui(cfg, spec, args.comfyui or recorded.get("comfyui"), models,
                           [args.model or cfg.model_file, *given.values()])
    files = model_files(cfg, models, args.model, given["text_encoder"], given["vae"], spec)
    note = random_weights_note(cfg, spec)
    if note:
        print(note)
    inputs = {"models": _absolute(models), "comfyui": _absolute(args.comfyui or recorded.get("comfyui")),
              **({"text_encoder": _absolute(files.text_encoder), "vae": _absolute(files.vae)} if files else {})}
    return out, cfg, spec, files, comfyui, inputs


def _absolute(path) -> str | None:
    return str(Path(path).expanduser().absolute()) if path else None

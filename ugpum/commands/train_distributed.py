"""`python -m ugpum train ... --distributed` under torchrun: the DiT and (on rank 0) the encoders as
`train` builds them, then the one training loop (`ugpum.train.loop.train`) with the distributed
stepper (`ugpum.distributed.stepper`; README "Past one machine")."""
from __future__ import annotations

import sys
from pathlib import Path

from ..train.config import TrainConfig


def run_distributed_training(cfg: TrainConfig, spec, out: str | Path, files, build_model, build_encoders,
                             data_parallel: int = 1, resume: bool = False, overwrite: bool = False, log=print,
                             comfyui=None, inputs: dict | None = None):
    """One rank of a distributed run of `spec`'s model: the ComfyUI to use, this rank's DiT (streamed from
    its file stage by stage), the encoders on rank 0 only, then the engine. `build_model` and
    `build_encoders`: `ugpum.commands.train`'s (passed in: that module imports this one). `comfyui`: the
    ComfyUI `train` found (`comfy_bridge.locate_comfyui`); `inputs`: what the checkpoints record."""
    import torch
    import torch.distributed as dist
    from ..distributed.stepper import TorchrunRankStepper
    from ..train.loop import train
    from .bridge import comfy_bridge
    cpu = all(d == "cpu" for d in cfg.devices) or not torch.cuda.is_available()
    bridge = comfy_bridge()
    bridge.import_comfy(bridge.comfyui_folder(comfyui) if comfyui else bridge.find_comfyui_or_raise(), cpu=cpu)
    if files is not None:
        cfg.model_file = str(files.dit)
    try:
        stepper = TorchrunRankStepper(cfg, lambda: build_encoders(cfg, files, bridge, spec), data_parallel, cpu)
        model, key_prefix = build_model(cfg, bridge, spec)
        with bridge.comfy_training_mode():
            return train(cfg, out, model, None, key_prefix, resume=resume, overwrite=overwrite, stepper=stepper,
                         inputs=inputs, spec=spec, log=log)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_train_distributed(args, cfg: TrainConfig, spec, out: str, files, build_model, build_encoders, comfyui=None,
                          inputs: dict | None = None) -> int:
    """The CLI's distributed branch: a stop by a signal is one sentence per rank and exit 128 + signal."""
    from ..distributed.topology import DistributedStop
    from ..train.stopping import Stop
    from .errors import UsageError
    from .prog import printer
    if not args.distributed:
        raise UsageError("--data-parallel needs --distributed (run under torchrun; README \"Past one machine\")")
    try:
        result = run_distributed_training(cfg, spec, out, files, build_model, build_encoders,
                                          data_parallel=args.data_parallel,
                                          resume=bool(args.resume), overwrite=getattr(args, "overwrite", False),
                                          log=printer("train"), comfyui=comfyui, inputs=inputs)
    except DistributedStop as why:
        stop = Stop.of(why)
        # One write per line: the ranks share torchrun's stderr, and print's separate newline let
        # two ranks' sentences run together on one line.
        sys.stderr.write(f"{stopped_sentence(stop, Path(out))}\n")
        sys.stderr.flush()
        return 128 + stop.signum
    if result.lora_path is not None:
        print(f"LoRA: {result.lora_path}")
    return 0


def stopped_sentence(stop, out: Path) -> str:
    """What a rank says when a signal stopped every rank (`stop.why`: a `DistributedStop`): the loop
    saved the completed steps with every rank before the stop reached here."""
    return (f"{stop.why}: checkpoint and LoRA saved in {out} by rank 0; continue with the same torchrun command and "
            f"--resume {out}")

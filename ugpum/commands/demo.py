"""`python -m ugpum demo`: the bundled Klein 9B workflow, headless.

dataset -> plan -> train -> LoRA file + before/after samples + loss curve + plan report. Without
real weights it runs the same code on a tiny random-weight FLUX.2 (ComfyUI's own model class) with
stand-in encoders, and says so; it finishes in a minute or two on a CPU.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..formats.atomic import atomic_path, remove_abandoned, write_json_atomic
from ..planning.forecast import plan_report
from ..render.report import loss_curve
from ..train.config import load_config
from ..wording import for_cli
from .bridge import PACK_ROOT
from .prog import printer

DEMO_DATASET = PACK_ROOT / "demo_datasets" / "loranne"
TRIGGER = "loranne"
KLEIN_PROFILE = "klein-9b-1024"


def klein_report() -> str:
    """The klein 9B profile's forecast on this machine's GPUs and typical rigs: the numbers
    `plan --profile klein-9b-1024 --gpu ...` and `doctor` print for the same GPUs (its advice in plan's flags)."""
    return for_cli(plan_report(load_config(KLEIN_PROFILE), KLEIN_PROFILE), "plan")


def write_report(out_dir: Path) -> None:
    """plan_report.txt, written whole or not at all (a killed demo leaves no half file, nor its temporary)."""
    remove_abandoned(out_dir)
    with atomic_path(out_dir / "plan_report.txt") as tmp:
        tmp.write_text(klein_report())


def write_loss_curve(out_dir: Path, losses: list[float]) -> None:
    with atomic_path(out_dir / "loss.png") as tmp:
        loss_curve(losses).save(tmp, format="PNG")


def run_real_demo(models: Path, steps: int | None, out_dir: Path, log, comfyui: str | None = None) -> int:
    """The Klein 9B workflow on the real files: ComfyUI's own text encoder and VAE (as the stock
    loaders load them) cache the captions and latents, then the DiT trains split by the plan. The
    devices and the ComfyUI (`train`'s, for the same --models) are checked before any file is."""
    from ..arch import get_spec
    from .train import check_devices, find_comfyui, model_files, run_training
    cfg = load_config(KLEIN_PROFILE, overrides={
        "dataset": str(DEMO_DATASET), "trigger": TRIGGER, "steps": steps,
        "sample_prompt": f"{TRIGGER}, waving, full body, on a beach", "output_name": "ugpum_klein9b_loranne"})
    spec = get_spec(cfg.model)
    check_devices(cfg, spec)
    found = find_comfyui(cfg, spec, comfyui, str(models), [])
    files = model_files(cfg, str(models), None, None, None, spec)
    write_report(out_dir)
    result = run_training(cfg, out_dir, files, found, spec, log=log, overwrite=True)   # a demo replaces its last run
    write_loss_curve(out_dir, result.losses)
    log(f"LoRA: {result.lora_path}; before/after: {result.sample_grid}; plan report: {out_dir / 'plan_report.txt'}")
    return 0


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="the bundled workflow, headless: dataset -> plan -> train -> LoRA + report",
                       description="The bundled klein 9B workflow without ComfyUI's window: the demo character "
                                   "dataset, the plan, training, the LoRA, before/after samples and a loss curve. "
                                   "Without --models it runs on a tiny random-weight FLUX.2 on the CPU, and says so.")
    p.add_argument("--models", metavar="DIR", help="a ComfyUI models/ folder with the real klein 9B files "
                                                   "(`ugpum download klein-9b-1024` puts them there)")
    p.add_argument("--comfyui", metavar="DIR", help="the ComfyUI whose model code runs (default: the one train uses; "
                                                    "`ugpum doctor` names it)")
    p.add_argument("--steps", type=int, default=None, metavar="N", help="optimizer steps (default: the profile's)")
    p.add_argument("--out", default="out/demo", metavar="DIR", help="output folder, replaced on each demo run "
                                                                    "(default out/demo)")


def run_demo(args) -> int:
    return demo(models=args.models, steps=args.steps, out=args.out, log=printer("demo"), comfyui=args.comfyui)


def demo(models: str | None = None, steps: int | None = None, out: str = "out/demo", log=print,
         comfyui: str | None = None) -> int:
    from .train import run_training
    out_dir = Path(out)
    found = None
    if comfyui and not models:                         # taken for the tiny model too, never dropped unsaid
        from ..arch import get_spec
        from .train import find_comfyui
        tiny = load_config("tiny-flux2")
        found = find_comfyui(tiny, get_spec(tiny.model), comfyui, None, [])
    out_dir.mkdir(parents=True, exist_ok=True)
    if models:
        return run_real_demo(Path(models), steps, out_dir, log, comfyui)
    log("No real weights given: running the demo on a tiny random-weight FLUX.2 (ComfyUI's own model "
        "class) with stand-in encoders. Same dataset, planner, placement, LoRA and files as the real run; "
        "the pictures show the pipeline working, not a trained character.")
    write_report(out_dir)
    log(f"plan report for the real klein 9B (profile {KLEIN_PROFILE}): {out_dir / 'plan_report.txt'}")
    cfg = load_config("tiny-flux2", overrides={"dataset": str(DEMO_DATASET), "trigger": TRIGGER,
                                               "steps": steps, "devices": ["auto"],
                                               "sample_prompt": f"{TRIGGER}, waving, full body, on a beach",
                                               "output_name": "ugpum_demo_loranne"})
    result = run_training(cfg, out_dir, comfyui=found, log=log, overwrite=True)      # a demo replaces its last run
    write_loss_curve(out_dir, result.losses)
    summary = {"lora": str(result.lora_path), "steps": result.steps_done,
               "validation_loss_before": result.validation_before, "validation_loss_after": result.validation_after,
               "plan": [{"device": s.device, "blocks": s.blocks} for s in result.plan.stages],
               "loss_plot": str(out_dir / "loss.png"), "plan_report": str(out_dir / "plan_report.txt"),
               "samples": [str(p) for p in result.samples]}
    write_json_atomic(out_dir / "summary.json", summary)
    log(json.dumps(summary, indent=1))
    return 0

"""`python -m ugpum demo`: the bundled Klein 9B workflow, headless.

dataset -> plan -> train -> LoRA file + before/after samples + loss curve + plan report. Without
real weights it runs the same code on a tiny random-weight FLUX.2 (ComfyUI's own model class) with
stand-in encoders, and says so; it finishes in a minute or two on a CPU.
"""
from __future__ import annotations

import json
from pathlib import Path

from .arch import Workload, get_spec
from .devices import parse_device_specs
from .plan import PlanError, make_plan
from .report import loss_curve

REPO = Path(__file__).resolve().parent.parent
DEMO_DATASET = REPO / "demo_datasets" / "loranne"
TRIGGER = "loranne"
# rigs a reader is likely to own, for the plan report when no GPU is here
TYPICAL_RIGS = (("one RTX 4090", ["rtx4090"]), ("two RTX 4060 Ti 16 GB", ["rtx4060ti-16g", "rtx4060ti-16g"]),
                ("one 16 GiB card", ["16GiB"]), ("RTX 5080 + RTX 4060 Ti 16 GB", ["rtx5080", "rtx4060ti-16g"]))


def plan_report(model_id: str = "flux2-klein-9b") -> str:
    from .cli import format_plan
    spec = get_spec(model_id)
    w = Workload(width=1024, height=1024, rank=16)
    here = parse_device_specs(["auto"], probe=False)
    rigs = ([("this machine", [d.label for d in here])] if here else []) + list(TYPICAL_RIGS)
    parts = []
    for title, specs in rigs:
        devices = here if title == "this machine" else parse_device_specs(specs, probe=False)
        try:
            text = format_plan(make_plan(spec, devices, w, grad_accum=4))
        except PlanError as e:
            text = f"does not fit: {e}"
        parts.append(f"=== {model_id} at 1024², rank 16, 4 micro-batches on {title} ===\n{text}\n")
    return "\n".join(parts)


REAL_MODEL = "flux2-klein-9b"


def real_model_files(models: Path) -> tuple[Path, Path, Path, str]:
    """(DiT, text encoder, VAE, weight dtype) of Klein 9B in a ComfyUI models/ folder; an error
    naming the missing files and the download command otherwise."""
    from .models_catalog import missing_hint, model_status
    if not models.is_dir():
        raise FileNotFoundError(f"--models {models}: no such folder (give ComfyUI's models/ folder)")
    status = model_status(models, REAL_MODEL)
    ready = status.ready_dtypes()
    if not ready:
        present = [s.file.filename for s in status.files if s.present]
        raise FileNotFoundError(missing_hint(REAL_MODEL, present, models_dir=models))
    dtype = "bf16" if "bf16" in ready else ready[0]
    entry = status.entry
    return (entry.dit[dtype].dest(models), entry.text_encoder.dest(models), entry.vae.dest(models), dtype)


def run_real_demo(models: Path, steps: int | None, out_dir: Path, log) -> int:
    """The Klein 9B workflow on the real files: ComfyUI's own text encoder and VAE (as the stock
    loaders load them) cache the captions and latents, then the DiT trains split by the plan."""
    from comfy_bridge import comfy_training_mode, import_comfy, find_comfyui_or_raise, load_encoders
    from .train.config import load_config
    from .train.loop import train
    dit, text_encoder, vae, dtype = real_model_files(models)
    import_comfy(find_comfyui_or_raise(), cpu=False)
    (out_dir / "plan_report.txt").write_text(plan_report())
    cfg = load_config("klein-9b-1024", overrides={
        "dataset": str(DEMO_DATASET), "trigger": TRIGGER, "steps": steps, "model_file": str(dit),
        "weight_dtype": dtype, "sample_prompt": f"{TRIGGER}, waving, full body, on a beach",
        "output_name": "ugpum_klein9b_loranne"})
    with comfy_training_mode():
        result = train(cfg, out_dir, encoders=load_encoders(text_encoder, vae, "flux2"), log=log)
    loss_curve(result.losses).save(out_dir / "loss.png")
    log(f"LoRA: {result.lora_path}; before/after: {result.sample_grid}; plan report: {out_dir / 'plan_report.txt'}")
    return 0


def run_demo(models: str | None = None, steps: int | None = None, out: str = "out/demo", log=print) -> int:
    from .train.config import load_config
    from .train.loop import train
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if models:
        return run_real_demo(Path(models), steps, out_dir, log)
    log("No real weights given: running the demo on a tiny random-weight FLUX.2 (ComfyUI's own model "
        "class) with stand-in encoders. Same dataset, planner, placement, LoRA and files as the real run; "
        "the pictures show the pipeline working, not a trained character.")
    report = plan_report()
    (out_dir / "plan_report.txt").write_text(report)
    log(f"plan report for the real Klein 9B: {out_dir / 'plan_report.txt'}")
    cfg = load_config("tiny-flux2", overrides={"dataset": str(DEMO_DATASET), "trigger": TRIGGER,
                                               "steps": steps, "devices": ["auto"],
                                               "sample_prompt": f"{TRIGGER}, waving, full body, on a beach",
                                               "output_name": "ugpum_demo_loranne"})
    result = train(cfg, out_dir, log=log)
    loss_curve(result.losses).save(out_dir / "loss.png")
    summary = {"lora": str(result.lora_path), "steps": result.steps_done,
               "validation_loss_before": result.validation_before, "validation_loss_after": result.validation_after,
               "plan": [{"device": s.device, "blocks": s.blocks} for s in result.plan.stages],
               "loss_plot": str(out_dir / "loss.png"), "plan_report": str(out_dir / "plan_report.txt"),
               "samples": [str(p) for p in result.samples]}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    log(json.dumps(summary, indent=1))
    return 0

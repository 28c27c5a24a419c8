"""`python -m ugpum train --models DIR` on full-size real-format klein 9B files (issue 14 item 2), with
the GPU memory of each phase: caption encoding (ComfyUI's Qwen3-8B), VAE encoding (ComfyUI's FLUX.2
VAE), placing the DiT, training, the final save and the samples.

It runs the verb's own path (`ugpum.commands.train`: model_files -> build_encoders -> build_model ->
the engine), only watching it: the encoders' calls and the engine's log lines mark the phases, and
`torch.cuda.max_memory_allocated` is read and reset at each mark.

    COMFYUI_PATH=<ComfyUI 0.33> python3 bench/train_real_files.py --models /tmp/k9models --steps 6 \
        --out /tmp/run --json OUT/train_real_files.json

The files come from bench/real_model_files.py (random weights in ComfyUI's layouts).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ugpum.commands.bridge import comfy_bridge  # noqa: E402
from ugpum.commands.train import build_encoders, build_model, model_files  # noqa: E402
from ugpum.train.config import load_config  # noqa: E402
from ugpum.train.loop import train  # noqa: E402
from ugpum.wording import for_cli  # noqa: E402

GIB = 2 ** 30
CUDA = torch.cuda.is_available()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / GIB if CUDA else 0.0


def reset_peak() -> None:
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


class Phases:
    """Peak allocated GiB per phase, closed at each mark."""

    def __init__(self):
        self.peaks: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}
        self.current = "load"
        reset_peak()

    def mark(self, next_phase: str) -> None:
        if next_phase == self.current:
            return
        peak = peak_gib()
        self.peaks[self.current] = round(max(peak, self.peaks.get(self.current, 0.0)), 3)
        now = time.perf_counter()
        self.times[self.current] = round(self.times.get(self.current, 0.0) + now - self.t0, 2)
        self.t0, self.current = now, next_phase
        reset_peak()


def watch_encoders(encoders, phases: Phases) -> None:
    for name, phase in (("encode_text", "caption encoding"), ("encode_images", "VAE encoding"),
                        ("encode_video", "VAE encoding")):
        inner = getattr(encoders, name, None)
        if inner is None:
            continue

        def wrapped(*args, _inner=inner, _phase=phase, **kwargs):
            phases.mark(_phase)
            return _inner(*args, **kwargs)
        setattr(encoders, name, wrapped)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", required=True)
    ap.add_argument("--profile", default="klein-9b-1024")
    ap.add_argument("--dataset", default=str(REPO / "demo_datasets" / "loranne"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--sample-steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)

    cfg = load_config(args.profile, overrides=dict(dataset=args.dataset, steps=args.steps, sample_every=args.steps,
                                                   sample_steps=args.sample_steps, trigger="loranne"))
    files = model_files(cfg, args.models, None, None, None)
    bridge = comfy_bridge()
    comfy = bridge.import_comfy(bridge.find_comfyui_or_raise(), cpu=False)
    phases = Phases()
    cfg.model_file = str(files.dit)
    encoders = build_encoders(cfg, files, bridge)
    watch_encoders(encoders, phases)
    model, key_prefix = build_model(cfg, bridge)
    lines = []

    def log(message) -> None:
        text = for_cli(str(message), "train")             # (the settings the run names, as train's flags)
        lines.append(text)
        print(text, flush=True)
        if text.startswith("features:"):
            phases.mark("placing the DiT")
        elif text.startswith("validation loss before"):
            phases.mark("training")
        elif text.startswith(f"saving checkpoint and LoRA at step {cfg.steps}"):
            phases.mark("final save, validation and samples")
    t0 = time.perf_counter()
    with bridge.comfy_training_mode():
        result = train(cfg, args.out, model=model, encoders=encoders, key_prefix=key_prefix, log=log, overwrite=True)
    phases.mark("done")
    metrics = [json.loads(l) for l in (Path(args.out) / "metrics.jsonl").read_text().splitlines()]
    seconds = [m["seconds"] for m in metrics]
    record = {
        "command": "COMFYUI_PATH=<ComfyUI 0.33> python3 bench/train_real_files.py " + " ".join(argv or sys.argv[1:]),
        "comfyui": str(Path(comfy.__path__[0]).parent),
        "comfyui_version": (Path(comfy.__path__[0]).parent / "comfyui_version.py").read_text().split('"')[1],
        "gpu": torch.cuda.get_device_name(0) if CUDA else "cpu", "torch": torch.__version__,
        "files": {k: str(v) for k, v in vars(files).items()},
        "file_gib": {k: round(Path(v).stat().st_size / GIB, 2) for k, v in vars(files).items()},
        "peak_gib_by_phase": phases.peaks, "seconds_by_phase": phases.times,
        "forecast_gib": {s.device: s.forecast_gib for s in result.plan.stages},
        "s_per_step": seconds, "median_s_per_step_after_first": statistics.median(seconds[1:]) if len(seconds) > 1 else None,
        "predicted_s_per_step": result.plan.predicted_step_s,
        "validation_loss": [result.validation_before, result.validation_after],
        "lora": str(result.lora_path), "samples": [str(p) for p in result.samples],
        "total_s": round(time.perf_counter() - t0, 1),
    }
    Path(args.json).write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("peak_gib_by_phase", "median_s_per_step_after_first", "forecast_gib")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

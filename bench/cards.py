"""The cards people own, played by one big GPU (issue 24): `python -m ugpum train` with the allocator capped
at a smaller card's memory and device detection reporting that card, one case per process.

    python bench/cards.py --model-file K9.safetensors --card-gib 12 --base-compute fp8 --steps 8 \
        --dataset demo_datasets/loranne --rows OUT/cards.jsonl --work /tmp/cards_run

The run goes through the CLI's own `main(["train", "--config", TOML, ...])` in this process: the same
planning, streaming, 8-bit quantising, swap, compile and step loop a user gets. Around it this script only
(1) caps the allocator (`torch.cuda.set_per_process_memory_fraction`) at the card's memory minus the CUDA
context a real card spends (`ugpum.planning.plan.CUDA_CONTEXT`), (2) has `detect_devices` report the capped card,
(3) records the plan the run made, and (4) samples the SM clock and power (nvidia-smi) while it trains.
One JSON row per case is appended to --rows: model, card_gib (null: unconstrained), base_compute (what ran),
s_per_step (median after the first two steps: compile and warm-up), peak_gib (allocator peak of the whole run,
loading included), forecast_s, forecast_gib, swapped_blocks, attention_kept, the validation losses, clocks, command."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The allocator reads its settings when CUDA first allocates, which cap_card's memory cap does before ugpum's main
# would set them: set here, as `python -m ugpum train` has them (the capped rows recorded before 2026-12-07's
# second session ran without them: bench/results/README.md)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402

from ugpum.compute import kernels  # noqa: E402
from ugpum.formats.atomic import append_line  # noqa: E402

GIB = 1024 ** 3


class Tee(io.StringIO):
    """stdout that is also kept, to read the run's own report lines (validation loss) afterwards."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def write(self, text):
        self.stream.write(text)
        return super().write(text)

    def flush(self):
        self.stream.flush()


DETECTED: list = []       # the devices the run was planned for (rate and link: what the forecast assumed)


def cap_card(card_gib: float | None):
    """Cap cuda:0's allocator at the card's memory minus its CUDA context; `detect_devices` then reports
    that card (same speed and link as the real GPU, the card's memory). None: unconstrained."""
    import ugpum.planning.devices as devices
    from ugpum.planning.plan import CUDA_CONTEXT
    real = devices.detect_devices
    budget = None
    if card_gib is not None:
        budget = card_gib * GIB - CUDA_CONTEXT
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(budget / total, 0)

    def detect_capped(probe: bool = True):
        found = real(probe=probe)
        if budget is not None:
            found = [dataclasses.replace(found[0], label=f"{found[0].label} as a {card_gib:g} GiB card",
                                         total_bytes=int(card_gib * GIB), free_bytes=int(budget))] + found[1:]
        DETECTED[:] = found
        return found
    devices.detect_devices = detect_capped


def record_plans(kept: list, variant: str = ""):
    """Keep every plan `best_plan` returns (the one planning call of every front end: the run's plan is the last
    one made before training); with `variant`, each is first turned into that neighbour of the planner's pick."""
    import ugpum.train.prepare  # noqa: F401  (imports the modules that hold best_plan)
    import ugpum.planning.space as space
    original = space.best_plan

    def recorded(spec, devices, w, *args, **kwargs):
        plan = original(spec, devices, w, *args, **kwargs)
        if variant:
            plan = neighbour(plan, variant, spec, devices)
        kept.append(plan)
        return plan
    for module in list(sys.modules.values()):
        if getattr(module, "best_plan", None) is original:
            module.best_plan = recorded


def neighbour(plan, variant: str, spec, devices):
    """The planner's one-GPU pick with N more or fewer blocks keeping their activations (kept+N, kept-N: the
    next or last ones in the planner's own keep order) or swapped (swapped+N, swapped-N: the planner's own
    swap candidate of that size, its kept blocks then chosen as the planner chooses them), forecast as the
    planner forecasts any set. A neighbour may not fit the card: the run then says so by running out."""
    from ugpum.planning.plan import GIB, StageCosts, budget_bytes
    (stage,) = plan.stages
    costs = StageCosts(spec, devices[:1], plan.planned_workload(), plan.in_flight)
    what, sign, count = re.fullmatch(r"(kept|swapped)([+-])(\d+)", variant).groups()
    delta, n = int(count) * (1 if sign == "+" else -1), len(spec.blocks)
    offloaded, kept = tuple(stage.offloaded), tuple(stage.kept_activations)
    if what == "kept":
        order = [i for i in costs.keep_order if i not in offloaded]
        kept = tuple(sorted(order[:max(0, len(kept) + delta)]))
    else:
        size = max(0, len(offloaded) + delta)
        offloaded = next(o for o in costs._swap_choices(0, n) if len(o) == size)
        kept = costs._keep_what_fits(0, 0, n, offloaded, budget_bytes(devices[0]))
    memory = costs._memory(0, 0, n, offloaded, kept)
    stage.offloaded, stage.kept_activations = list(offloaded), list(kept)
    stage.forecast_gib = round(sum(memory.values()) / GIB, 3)
    stage.detail_gib = {k: round(v / GIB, 3) for k, v in memory.items()}
    stage.seconds = costs.seconds(0, 0, n, offloaded, kept)
    plan.offloaded_blocks, plan.predicted_step_s = list(offloaded), stage.seconds
    plan.swap_bytes_per_step = 2 * sum(costs.weight[i] for i in offloaded)
    return plan


class BlockMemory:
    """What each block keeps for its backward, read off the allocator in the real run: at every block's forward
    pre-hook of a training step (grad on; validation runs without grad, and recomputed blocks recompute without
    module hooks) the bytes allocated on cuda:0, and after the last block. The difference between two readings is
    what the first block left alive for backward (its saved tensors, its output). Each step's first block also
    reads and resets the allocator's peaks, so every step's peak is kept apart; `peaks()` is the whole run's."""

    def __init__(self):
        self.steps: list[dict] = []
        self.peak_allocated = self.peak_reserved = 0

    def attach(self, model, spec) -> None:
        paths = [b.path for b in spec.blocks]
        for i, path in enumerate(paths):
            model.get_submodule(path).register_forward_pre_hook(lambda m, a, i=i: self._pre(i))
        model.get_submodule(paths[-1]).register_forward_hook(lambda m, a, out: self._pre(len(paths)))

    def _take_peaks(self) -> tuple[int, int]:
        allocated, reserved = torch.cuda.max_memory_allocated(0), torch.cuda.max_memory_reserved(0)
        self.peak_allocated, self.peak_reserved = max(self.peak_allocated, allocated), max(self.peak_reserved, reserved)
        torch.cuda.reset_peak_memory_stats(0)
        return allocated, reserved

    def _pre(self, i: int) -> None:
        if not torch.is_grad_enabled() or not torch.cuda.is_available():
            return
        if i == 0:
            if self.steps:
                self.steps[-1]["peak_allocated"], self.steps[-1]["peak_reserved"] = self._take_peaks()
            else:
                self._take_peaks()
            self.steps.append({"at_block": []})
        self.steps[-1]["at_block"].append(torch.cuda.memory_allocated(0))

    def peaks(self) -> tuple[float, float]:
        """(allocated, reserved) peaks of the whole run so far, in GiB."""
        if torch.cuda.is_available():
            self._take_peaks()
        return self.peak_allocated / GIB, self.peak_reserved / GIB

    def summary(self) -> dict:
        """Per block, the bytes it left alive in the forward of the third measured step (compile and
        warm-up done), in MiB, with each step's peaks in GiB."""
        done = [s for s in self.steps if "peak_allocated" in s]
        chosen = done[2] if len(done) > 2 else (done[-1] if done else None)
        if chosen is None:
            return {}
        at = chosen["at_block"]
        return {"block_kept_mib": [round((b - a) / 2**20, 1) for a, b in zip(at, at[1:])],
                "forward_start_gib": round(at[0] / GIB, 3),
                "step_peak_allocated_gib": [round(s["peak_allocated"] / GIB, 3) for s in done],
                "step_peak_reserved_gib": [round(s["peak_reserved"] / GIB, 3) for s in done]}


def measure_blocks(meter: BlockMemory) -> None:
    """Attach `meter` to the model the single-process engine prepares (after LoRA, compile, checkpointing)."""
    from ugpum.train import stepper
    original = stepper.OneProcessStepper.prepare

    def prepare(self, cfg, spec, plan, model, key_prefix, log):
        original(self, cfg, spec, plan, model, key_prefix, log)
        meter.attach(self.model, spec)
    stepper.OneProcessStepper.prepare = prepare


def host_peak_gib() -> float:
    """This process's peak resident host memory (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Clock:
    """nvidia-smi sampling SM clock (MHz) and power (W) every 250 ms while the run trains."""

    def __init__(self):
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                                          "--format=csv,noheader,nounits", "-lms", "250", "-i", "0"],
                                         stdout=subprocess.PIPE, text=True)
        except OSError:                   # no nvidia-smi (a CPU try of this script)
            self.proc = None

    def stop(self) -> dict:
        if self.proc is None:
            return {}
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        rows = [[float(v) for v in line.split(",")] for line in out.splitlines() if re.match(r"^\s*\d", line)]
        busy = [r for r in rows if r[1] > 200] or rows          # the samples while the GPU works
        if not busy:
            return {}
        return {"sm_clock_mhz_median": statistics.median(r[0] for r in busy),
                "power_w_median": statistics.median(r[1] for r in busy), "clock_samples": len(busy)}


def comfyui_used() -> dict:
    """Which ComfyUI the run imported, and whether comfy-kitchen's CUDA kernels were there (issue 41: every
    speed row says both; a user's install has the kernels, bench/pack_device.sh's default site has not)."""
    comfy, kitchen = sys.modules.get("comfy"), sys.modules.get("comfy_kitchen")
    found = {"comfyui": None, "comfyui_commit": None, "kitchen_cuda": None}
    if comfy is not None:
        from comfy_bridge import comfyui_version
        where = Path(list(comfy.__path__)[0]).parent
        commit = (where / "COMMIT").read_text().strip() if (where / "COMMIT").is_file() else None
        found.update(comfyui=comfyui_version(where), comfyui_commit=commit)
    if kitchen is not None:
        found["kitchen_cuda"] = bool(kitchen.list_backends().get("cuda", {}).get("available"))
    return found


def write_config(path: Path, a) -> None:
    from ugpum.arch import recognise
    spec = recognise(a.model_file)[0]
    lines = [f'model = "{spec.id}"', f"resolution = {a.resolution}", f"frames = {a.frames}", f"steps = {a.steps}",
             f"rank = {a.rank}", f"alpha = {float(a.rank)}", f'weight_dtype = "{a.weight_dtype}"',
             "sample_every = 0", f'compile = "{a.compile}"', f'base_compute = "{a.base_compute}"', "lr = 1e-4",
             'devices = ["auto"]', "stand_in_encoders = true", f'recompute = "{a.recompute}"']
    path.write_text("\n".join(lines) + "\n")


def torchao_base(recipe: str):
    """--experiment torchao-float8 | torchao-int8 (--base-compute bf16): the frozen Linears in torchao's 8-bit training
    path, beside ours (issue 41). It holds weights in bf16, quantised at every call; each keeps its LoRA hooks."""
    def use(model, paths, mode, log, keep=None):
        from torchao.float8.float8_linear import Float8Linear, Float8LinearConfig
        from torchao.prototype.quantized_training import int8_mixed_precision_training
        from torchao.quantization import quantize_
        kept = {m: m.weight for m in map(model.get_submodule, paths)}    # (int8's go back before the model is moved)
        for m in kept:
            if recipe == "float8":
                m.forward = Float8Linear.from_float(m, config=Float8LinearConfig.from_recipe_name("rowwise")).forward
            else:
                quantize_(m, int8_mixed_precision_training())
        log(f"base compute: torchao's {recipe} training path in {len(paths)} Linears")
        return lambda: [setattr(m, "weight", w) for m, w in kept.items() if recipe == "int8"]
    return use


# what-ifs (--experiment): a setting changed before the run, (module, name, value)
EXPERIMENTS = {
    "comfy-attention": ("ugpum.arch.attention", "torch_attention", lambda f, *a, **k: f(*a, **k)),  # as 0.33 does
    "gemm-autotune": ("torch._inductor.config", "max_autotune_gemm", True),
    "plain-ops": ("ugpum.compute.kernels", "ON_BY_DEFAULT", ()),         # PyTorch's ops, no kernel of ours
    "int8-lora-epilogue": ("ugpum.compute.modes.int8", "LORA_IN_KERNEL", True), "int8-tma": (
        "ugpum.compute.kernels.matmul_8bit", "DESCRIPTORS", True), "attention-recomputed": (
        "ugpum.planning.plan", "KEEP_ATTENTION", False),     # the LoRA in the int8 GEMM; a recompute of all
    **{name: ("ugpum.compute.kernels", "ON_BY_DEFAULT", (name,)) for name in kernels.KERNELS},   # that one alone
    "fp8-lora-epilogue": ("ugpum.compute.kernels", "ON_BY_DEFAULT", (*kernels.ON_BY_DEFAULT, "fp8-lora-epilogue")),
    "step-read-at-once": ("ugpum.train.loop", "skips_on_device", lambda optimizer: False),   # each step read as it ends
    "transpose-kept": ("ugpum.compute.base_compute", "KEEP_TRANSPOSED", True), "lora-as-sum": (
        "ugpum.compute.lora", "UP_PROJECTION_AS_SUM", True),   # Wq^T kept for the backward; the LoRA summed over r
    **{f"torchao-{r}": ("ugpum.train.prepare", "use_base_compute", torchao_base(r)) for r in ("float8", "int8")},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-file", required=True)
    p.add_argument("--card-gib", type=float, default=None, help="the card's memory (omit: the whole GPU)")
    p.add_argument("--base-compute", default="auto", choices=["auto", "bf16", "fp8", "int8"])
    p.add_argument("--weight-dtype", default="bf16")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--frames", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--compile", default="on", choices=["auto", "on", "off"])
    p.add_argument("--recompute", default="all", choices=["auto", "all", "none"], help="blocks recomputed in backward")
    p.add_argument("--dataset", default=str(ROOT / "demo_datasets" / "loranne"))
    p.add_argument("--rows", required=True, help="JSON lines file the case's row is appended to")
    p.add_argument("--work", required=True, help="a scratch folder for the run's config and output")
    p.add_argument("--label", default="")
    p.add_argument("--choice", default="", choices=["", "planner", "neighbour"], help="the plan's pick or a neighbour")
    p.add_argument("--of", default="", help="the label of the planner's pick a neighbour row belongs to")
    p.add_argument("--variant", default="", help="a neighbour of the planner's pick: kept±N, swapped±N")
    p.add_argument("--speed-rows", help="also append the speed row (bench/results/speed.json's fields) to this file")
    p.add_argument("--call", default="", help="which GPU run the speed row belongs to (the peer's --call)")
    p.add_argument("--experiment", default="", help="what-ifs of EXPERIMENTS, joined by + (a+b: both)")
    a = p.parse_args(argv)
    for x in filter(None, a.experiment.split("+")):
        module, name, value = EXPERIMENTS.get(x) or p.error(f"--experiment {x}: use one of {', '.join(EXPERIMENTS)}")
        setattr(importlib.import_module(module), name, value)
    (work := Path(a.work)).mkdir(parents=True, exist_ok=True)
    config, out = work / "config.toml", work / "run"
    write_config(config, a)
    cap_card(a.card_gib)
    plans: list = []
    record_plans(plans, a.variant)
    meter = BlockMemory()
    measure_blocks(meter)
    from ugpum.commands import main as ugpum_main
    argv_train = ["train", "--config", str(config), "--model", a.model_file, "--dataset", a.dataset,
                  "--out", str(out), "--overwrite"]
    clock, tee, started = Clock(), Tee(sys.stdout), time.time()
    with contextlib.redirect_stdout(tee):
        rc = ugpum_main(argv_train)
    clocks = clock.stop()
    row = case_row(a, rc, plans, out, tee.getvalue(), clocks, meter)
    row.update(wall_s=round(time.time() - started, 1),
               command="python bench/cards.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:])),
               cli=" ".join(["python -m ugpum", *argv_train]),
               gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               torch=torch.__version__, **comfyui_used())
    kept = [(a.rows, row)] + ([(a.speed_rows, speed_row(a, row, (plans or [None])[-1]))] if a.speed_rows else [])
    for rows, line in kept:
        append_line(rows, json.dumps(line))
        print(json.dumps(line))
    return rc


def speed_row(a, row: dict, plan) -> dict:
    """Issue 23's row for the user's path beside `peer_reference` rows: the median s/step of steps 5 and later of
    the run's own metrics.jsonl (the case row's step_seconds; compile and warm-up excluded), with its clocks."""
    timed = row["step_seconds"][4:]
    return {"model": row["model"], "impl": "ugpum_cli", "experiment": a.experiment, "mode": row["base_compute"],
            "compiled": a.compile == "on", "compile": a.compile, "choice": a.choice, "variant": a.variant, "of": a.of,
            "recompute": a.recompute, "kept_blocks": len(plan.kept_activations) if plan else None,
            "card_gib": a.card_gib, "s_per_step": round(statistics.median(timed), 4) if timed else None,
            "timed_steps": len(timed), "peak_gib": row["peak_gib"], "sm_clock_mhz": row.get("sm_clock_mhz_median"),
            "power_w": row.get("power_w_median"), "forecast_s": row["forecast_s"], "forecast_gib": row["forecast_gib"],
            "rc": row["rc"], "call": a.call, "label": a.label, "command": row["cli"], "gpu": row["gpu"],
            "comfyui": row["comfyui"], "comfyui_commit": row["comfyui_commit"], "kitchen_cuda": row["kitchen_cuda"]}


def case_row(a, rc: int, plans: list, out: Path, log: str, clocks: dict, meter: BlockMemory) -> dict:
    plan = plans[-1] if plans else None
    peak_allocated, peak_reserved = meter.peaks()
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    timed = [s["seconds"] for s in steps[2:]]
    found = {k: re.findall(rf"validation loss {k}[^:]*: ([0-9.]+)", log) for k in ("before", "after")}
    return {
        "label": a.label, "model": plan.model if plan else None, "card_gib": a.card_gib, "rc": rc,
        "base_compute": plan.base_compute if plan else a.base_compute, "base_compute_setting": a.base_compute,
        "base_compute_note": plan.base_compute_note if plan else "",
        "resolution": a.resolution, "frames": a.frames, "steps": len(steps),
        "s_per_step": round(statistics.median(timed), 4) if timed else None,
        "step_seconds": [round(s["seconds"], 4) for s in steps],
        "compile": a.compile, "choice": a.choice, "variant": a.variant, "of": a.of,
        "recompute": a.recompute, "kept_blocks": len(plan.kept_activations) if plan else None,
        "peak_gib": round(peak_allocated, 3) if torch.cuda.is_available() else None,
        "peak_reserved_gib": round(peak_reserved, 3) if torch.cuda.is_available() else None,
        "host_peak_gib": round(host_peak_gib(), 3), "forecast_host_gib": getattr(plan, "forecast_host_gib", None),
        "detail_gib": plan.stages[0].detail_gib if plan else None,
        "budget_gib": plan.stages[0].budget_gib if plan else None,
        "forecast_s": round(plan.predicted_step_s, 4) if plan else None,
        "forecast_gib": plan.stages[0].forecast_gib if plan else None,
        "swapped_blocks": len(plan.offloaded_blocks) if plan else None,
        "offloaded_blocks": list(plan.offloaded_blocks) if plan else None,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "attention_kept": bool(plan and plan.workload.get("attention_kept")),
        "device_tflops": round(DETECTED[0].tflops_bf16, 1) if DETECTED else None,
        "device_host_gbps": round(DETECTED[0].host_gbps, 1) if DETECTED else None,
        "swap_gib_per_step": round(plan.swap_bytes_per_step / GIB, 2) if plan else None,
        "losses": [round(s["loss"], 4) for s in steps],
        "validation_before": float(found["before"][-1]) if found["before"] else None,
        "validation_after": float(found["after"][-1]) if found["after"] else None,
        **clocks, **meter.summary(),
    }


if __name__ == "__main__":
    sys.exit(main())

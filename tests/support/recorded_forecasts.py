"""Every recorded CLI row of the 8-bit cards work against the planner's forecast as the code stands now
(issue 24), shared by the test that holds the planner to them (tests/unit/test_plan_eight_bit_memory.py)
and `python bench/cards_refit.py`, which prints every row's errors.

Rows: bench/results/cards.json (cases that trained; the H200 measured 769 TFLOP/s bf16 in device calls 1-4
and 777.6 in calls 5-6, the rates their recorded forecasts imply; pinned copies ~55 GB/s as the probes of
bench/results/wan14b_*_place.json read) and
bench/results/modes.json (klein 9B at 1024² through the CLI, 798.9 TFLOP/s in that session: the rate its
recorded forecasts imply). The rate each session measured is what its forecast used, so it is kept here.
"""
from __future__ import annotations

import json
from pathlib import Path

from ugpum.arch import get_spec
from ugpum.arch.base import Workload
from ugpum.devices import Device
from ugpum.plan import CUDA_CONTEXT, GIB, StageCosts, budget_bytes, plan_training

ROOT = Path(__file__).resolve().parents[2]

RESULTS = ROOT / "bench" / "results"
H200_GIB = 139.8
LIMIT = 0.10
CALL_TFLOPS = {5: 777.6, 6: 777.6}           # else 769.0 (device calls 1-4)


def device(card_gib: float | None, tflops: float, gbps: float = 55.0) -> Device:
    """The H200 as the run saw it: the whole GPU (the session's free memory), or capped as a card."""
    if card_gib is None:
        total = free = H200_GIB * GIB
    else:
        total, free = card_gib * GIB, card_gib * GIB - CUDA_CONTEXT
    return Device("cuda:0 NVIDIA H200", "cuda:0", int(total), int(free), tflops, gbps, "pcie5x16", (9, 0))


def workload(model: str, resolution: int, frames: int, rank: int, compiled: bool, mode: str) -> Workload:
    held = "fp8" if mode in ("fp8", "int8") else "bf16"          # (what TrainConfig.workload() gives)
    return Workload(width=resolution, height=resolution, frames=frames, rank=rank, compiled=compiled,
                    base_compute=mode, weight_dtype=held)


def recorded_rows() -> list[dict]:
    rows = []
    for r in json.loads((RESULTS / "cards.json").read_text())["rows"]:
        if r.get("rc") == 0 and r.get("s_per_step"):
            rank = 32 if r["model"].startswith("wan") else 16
            rows.append(dict(label=f"cards {r['label']}", model=r["model"], card=r["card_gib"],
                             tflops=CALL_TFLOPS.get(r.get("device_call"), 769.0),
                             w=workload(r["model"], r["resolution"], r["frames"], rank, True, r["base_compute"]),
                             s=r["s_per_step"], gib=r["peak_gib"], swapped=r["swapped_blocks"],
                             offloaded=r.get("offloaded_blocks")))
    for line in (RESULTS / "modes.json").read_text().splitlines():
        r = json.loads(line)
        rows.append(dict(label=f"modes klein compile={r['compile']} {r['base_compute']}", model=r["model"],
                         card=None, tflops=798.9,
                         w=workload(r["model"], 1024, 1, 16, r["compile"] == "on", r["base_compute"]),
                         s=r["s_per_step"], gib=r["train_peak_gib"], swapped=0))
    return rows


def forecast_gib_as_run(row: dict, dev: Device) -> float:
    """The stage's forecast memory for the blocks the run swapped: the measured peak belongs to that set,
    which a changed model may not pick again. Rows that name the set (bench/cards.py records it now) use it;
    older rows give only the count: the planner's first candidate of that count that fits the budget (the
    planner takes the first that fits; the slot sizes in the older logs agree: klein 12 GiB swapped single
    blocks, 8 GiB double blocks too), else the smallest of that count."""
    spec = get_spec(row["model"])
    costs = StageCosts(spec, [dev], row["w"], 1)
    n = len(spec.blocks)

    def gib(offloaded) -> float:
        return sum(costs._memory(0, 0, n, tuple(offloaded)).values()) / GIB
    if row.get("offloaded") is not None:
        return round(gib(row["offloaded"]), 3)
    sizes = [gib(o) for o in costs._swap_choices(0, n) if len(o) == row["swapped"]]
    budget = budget_bytes(dev) / GIB
    return round(next((x for x in sizes if x <= budget), min(sizes)), 3)


def compare(row: dict) -> dict:
    dev = device(row["card"], row["tflops"])
    plan = plan_training(get_spec(row["model"]), [dev], row["w"])
    forecast_s, forecast_gib = plan.predicted_step_s, forecast_gib_as_run(row, dev)
    return dict(label=row["label"], s=row["s"], forecast_s=round(forecast_s, 4),
                s_error=round(forecast_s / row["s"] - 1, 3), gib=row["gib"], forecast_gib=forecast_gib,
                gib_error=round(forecast_gib / row["gib"] - 1, 3), swapped=row["swapped"],
                planned=len(plan.offloaded_blocks))

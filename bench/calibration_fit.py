"""The planner's coefficients, fitted to runs of `python -m ugpum train` on a GPU (issue 29): the rows bench/cards.py
writes, with what each block kept read off the allocator.

    python bench/calibration_fit.py [--write | --check]   # print (write, check) the coefficients, each row's error

Where they go: the shared time coefficients into ugpum/planning/calibration.json, each family's into
ugpum/arch/<family>/calibration.json; each 8-bit mode's compiled dense speeds and extra host memory are
printed, for its file in ugpum/compute/modes/. Rows: bench/results/calibration_fit.jsonl (`bash bench/session.sh
OUT fit`) and bench/results/calibration.json (`... cards`, `wan-cards`, `dev-card`: the planner's picks on cards).

Memory, in units of the hidden state between two blocks (ArchSpec.boundary_bytes; for a row whose blocks were
recomputed, the unit is what such a block left alive, which is its output: this reads the tokens the dataset's
buckets really had):
- kept[kind]: what a block that keeps its activations leaves alive, the median over the blocks of that kind
  (the first block and the last before another kind are left out: they also hold the stream's start or join);
- recompute_work / keep_work: the step's peak allocated less everything counted (weights, swap slots, LoRA
  state, shared inputs, every block's kept bytes as measured), in rows where some block is recomputed / none
  is: the working memory of the backward at the peak;
- allocator: peak reserved less peak allocated, the largest of the family's rows on capped cards.
Time: the coefficients of ugpum.planning.cost.block_seconds against the device's measured matmul rate (the
row's device_tflops): the dense matmuls' share of it in compiled and eager blocks, attention's, the width at
which the memory-bound work around the matmuls costs as much as they do, each 8-bit mode's forward and backward
dense speeds, and a factor per family but FLUX.2's, solved together over every row (swap included, as the
planner forecasts it) by bounded least squares on the relative errors (`TIME_COEFFICIENTS`); then each mode whose
rows all recompute every block, one speed with another mode's backward/forward ratio (`tied_modes`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from ugpum.planning import cost  # noqa: E402
from ugpum.arch import FAMILIES, Workload, get_spec  # noqa: E402
from ugpum.compute.modes import MODES, mode_named  # noqa: E402
from support import recorded_forecasts  # noqa: E402
# a row's workload, its hidden-state size and its kept blocks, read as the test holding the planner reads them
from support.recorded_forecasts import kept_blocks, unit_bytes as measured_unit, workload  # noqa: E402

GIB, MIB = 1024 ** 3, 1024 ** 2
ROWS = [str(path) for path in recorded_forecasts.FILES]


def kept_units(rows: list[dict]) -> dict:
    """(family, mode) -> kind -> units a kept block leaves alive."""
    found: dict = {}
    for row in rows:
        spec, w = get_spec(row["model"]), workload(row)
        unit = measured_unit(row, spec, w)
        kinds = [b.kind for b in spec.blocks]
        for i in kept_blocks(row, spec, w):
            inner = 0 < i < len(kinds) - 1 and kinds[i + 1] == kinds[i]
            if inner:
                key = (spec.family, "compiled" if w.compiled else "eager")
                found.setdefault(key, {}).setdefault(kinds[i], []).append(row["block_kept_mib"][i] * MIB / unit)
    return {key: {kind: round(statistics.median(v), 2) for kind, v in kinds.items()} for key, kinds in found.items()}


def counted_bytes(row: dict, spec, w: Workload) -> float:
    """Everything but the backward's working memory: the plan's weights, slots and LoRA state (the row's
    detail), the shared inputs, and what each block left alive, as measured."""
    d = row["detail_gib"]
    static = (d["weights"] + d["swap_slots"] + d["lora"]) * GIB
    return static + spec.shared_input_bytes(w) + 2 * spec.boundary_bytes(w) + sum(row["block_kept_mib"]) * MIB


def work_units(rows: list[dict]) -> dict:
    """(family, mode) -> {recompute_work, keep_work}: the backward's working memory at the peak, in units."""
    found: dict = {}
    for row in rows:
        if row["steps"] < 3:                    # the first step has no optimizer moments yet
            continue
        spec, w = get_spec(row["model"]), workload(row)
        unit = measured_unit(row, spec, w)
        recomputed = len(kept_blocks(row, spec, w)) < len(spec.blocks)
        work = (row["peak_gib"] * GIB - counted_bytes(row, spec, w)) / unit
        key = (spec.family, "compiled" if w.compiled else "eager")
        found.setdefault(key, {}).setdefault("recompute_work" if recomputed else "keep_work", []).append(work)
    return {key: {name: round(max(v), 2) for name, v in works.items()} for key, works in found.items()}


def allocator_units(rows: list[dict]) -> dict:
    """family -> the allocator's slack where memory is tight: the largest of the family's rows on a capped card
    (all its rows if none is). With room to spare the caching allocator keeps more (Wan on the whole H100: 17
    hidden states, on 16 and 24 GiB cards 8-9), which costs a plan nothing."""
    found: dict = {}
    capped = {get_spec(row["model"]).family for row in rows if row.get("card_gib")}
    for row in rows:
        spec, w = get_spec(row["model"]), workload(row)
        if spec.family in capped and not row.get("card_gib"):
            continue
        slack = (row["peak_reserved_gib"] - row["peak_gib"]) * GIB / measured_unit(row, spec, w)
        found.setdefault(spec.family, []).append(slack)
    return {family: round(max(v), 2) for family, v in found.items()}


def host_table(rows: list[dict]) -> tuple[dict, dict]:
    """(family -> GiB the process held at its peak beyond the pinned copies of its swapped blocks, mode -> GiB its
    runs held beyond that): the family's figure is the median of its rows less their modes' figures (klein 9B's
    alone spread 2.07-2.58 GiB over the exact base and fp8, and one Wan run on a 16 GiB card held 1.1 GiB more
    than its others: the middle holds every row nearest); a quantising mode's, the median of its rows less their
    families' (int8's runs held 0.2-0.5 GiB more than bf16's and fp8's in the same calls). Solved in turns."""
    held = []
    for row in rows:
        spec, w = get_spec(row["model"]), workload(row)
        pinned = sum(cost.block_weight_bytes(spec.blocks[i], w) for i in row["offloaded_blocks"])
        held.append((spec.family, row["base_compute"], row["host_peak_gib"] - pinned / GIB))
    extra, families = dict.fromkeys({mode for _, mode, _ in held}, 0.0), {f for f, _, _ in held}
    for _ in range(8):
        family = {f: statistics.median(g - extra[m] for f2, m, g in held if f2 == f) for f in families}
        extra = {mode: statistics.median(g - family[f] for f, m, g in held if m == mode)
                 if mode_named(mode).quantises else 0.0 for mode in extra}
    return ({f: round(v, 2) for f, v in family.items()},
            {m.name: round(extra.get(m.name, m.extra_host_gib), 2) for m in MODES})


def memory_table(rows: list[dict]) -> dict:
    """family -> mode -> {kept, recompute_work, keep_work}, and the allocator's slack per family. What no row
    measured is filled and says so: a family's eager mode from its compiled one, scaled as FLUX.2's eager
    blocks keep more than its compiled ones; a work term from the other one (a row that mixes kept and
    recomputed blocks measures the larger of the two)."""
    kept, work = kept_units(rows), work_units(rows)
    table: dict = {}
    for (family, mode), kinds in kept.items():
        table.setdefault(family, {})[mode] = {"kept": kinds, **work.get((family, mode), {})}
    flux = table.get("flux2", {})
    scale = (statistics.mean(flux["eager"]["kept"][k] / flux["compiled"]["kept"][k] for k in flux["compiled"]["kept"])
             if {"eager", "compiled"} <= set(flux) else 1.0)
    for family, modes in table.items():
        compiled = modes["compiled"]
        for name, other in (("recompute_work", "keep_work"), ("keep_work", "recompute_work")):
            if name not in compiled:
                compiled[name] = compiled[other]
                compiled["filled"] = compiled.get("filled", []) + [name]
        eager = modes.setdefault("eager", {"kept": {k: round(v * scale, 2) for k, v in compiled["kept"].items()},
                                           "filled": ["kept"]})
        for name in ("recompute_work", "keep_work"):
            if name not in eager:
                eager[name] = round(compiled[name] * scale, 2)
                eager["filled"] = eager.get("filled", []) + [name]
    table["allocator"] = allocator_units(rows)
    return table


# Time: the coefficients of cost.block_seconds, solved together so the forecast of every row (through the
# planner's own StageCosts, swap included) lands nearest its measured s/step in relative terms, within what the
# hardware can do: no term faster than the device's measured matmul rate, no 8-bit matmul over twice bf16's.
# (name, where it lives, lowest, highest, start)
TIME_COEFFICIENTS = [
    ("compiled_efficiency", ("shared",), 0.05, 1.0, 0.8),
    ("eager_efficiency", ("shared",), 0.05, 1.0, 0.6),
    ("attention_efficiency", ("shared",), 0.05, 1.0, 0.8),
    ("elementwise_width", ("shared",), 0.0, 20000.0, 2000.0),
    *((f"{m.name} {way}", ("mode", m, i), 0.2, 2.0, 1.0) for m in MODES if m.quantises
      for i, way in enumerate(("forward", "backward"))),
    *((f"{f.name} efficiency", ("family", f), 0.5, 2.0, 1.0) for f in FAMILIES if f.name != "flux2"),
]


def tied_modes(rows: list[dict]) -> dict:
    """mode -> the mode whose backward/forward speed ratio it takes: a quantising mode whose rows all recompute every
    block measures one speed, not forward and backward apart (int8's with its Triton GEMM fit anything from 1.91x
    and 0.90x to 1.31x and 1.50x within 1.6 %); it takes the ratio of a mode whose rows do separate them."""
    keeps = {r["base_compute"] for r in rows if kept_blocks(r, get_spec(r["model"]), workload(r))}
    measured = [m for m in MODES if m.quantises and m.name in keeps]
    return {m: measured[0] for m in MODES if m.quantises and m.name not in keeps and measured}


def _set_time(coefficients, values, tied: dict) -> None:
    """Put trial coefficients where cost.block_seconds reads them; a tied mode's backward at its model's ratio."""
    for (name, where, *_), value in zip(coefficients, values):
        if where[0] == "shared":
            cost.CALIBRATION["time"][name] = float(value)
        elif where[0] == "mode":
            speeds = list(where[1].dense_speed["compiled"])
            speeds[where[2]] = float(value)
            where[1].dense_speed = {**where[1].dense_speed, "compiled": tuple(speeds)}
        else:
            where[1].calibration["efficiency"] = float(value)
    for mode, model in tied.items():
        forward, backward = model.dense_speed["compiled"]
        speed = mode.dense_speed["compiled"][0]
        mode.dense_speed = {**mode.dense_speed, "compiled": (speed, round(speed * backward / forward, 4))}


def time_table(rows: list[dict]) -> dict:
    """The time coefficients fitted to `rows` (scipy's bounded least squares on the relative errors): first every
    one but the tied modes' to the other modes' rows, then each tied mode's one speed to its own rows."""
    from scipy.optimize import least_squares
    tied = tied_modes(rows)
    coefficients = [c for c in TIME_COEFFICIENTS if not (c[1][0] == "mode" and c[1][1] in tied)]
    fitted = {}
    for free, timed in ((coefficients, [r for r in rows if mode_named(r["base_compute"]) not in tied]),
                        *(([c for c in TIME_COEFFICIENTS if c[1][:3] == ("mode", m, 0)],
                           [r for r in rows if r["base_compute"] == m.name]) for m in tied)):
        lower, upper, start = zip(*((lo, hi, x0) for _, _, lo, hi, x0 in free))

        def errors(values):
            _set_time(free, values, tied)
            return [recorded_forecasts.compare(r)["s_error"] for r in timed]
        values = [round(float(v), 4) for v in least_squares(errors, start, bounds=(lower, upper), diff_step=1e-3).x]
        _set_time(free, values, tied)
        fitted.update((name, v) for (name, *_), v in zip(free, values))
    return fitted


def calibration_file(family) -> Path:
    """Where a family's coefficients live: calibration.json in its folder."""
    return Path(importlib.import_module(f"ugpum.arch.{family.name}").__file__).with_name("calibration.json")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", default=ROWS)
    p.add_argument("--write", action="store_true", help="write ugpum/planning/calibration.json")
    p.add_argument("--check", action="store_true", help="exit 1 where what the planner reads is not this fit")
    a = p.parse_args(argv)
    held = {"shared": cost.CALIBRATION["time"], **{f.name: dict(f.calibration) for f in FAMILIES},
            **{m.name: (m.dense_speed["compiled"], m.extra_host_gib) for m in MODES}}
    rows = [json.loads(line) for name in a.rows if Path(name).exists()
            for line in Path(name).read_text().splitlines() if line.strip()]
    fitted = [r for r in rows if r.get("block_kept_mib") and recorded_forecasts.held_to(r)]
    runs = sorted({f"{r['gpu']}, torch {r['torch']}" for r in fitted})
    memory, (host, extra_host) = memory_table(fitted), host_table(fitted)
    for m in MODES:
        m.extra_host_gib = extra_host[m.name]
    families = [f for f in FAMILIES if f.name in memory]      # (one no row measured keeps its own)
    for family in families:
        family.calibration.update(runs=runs, memory=memory[family.name], allocator=memory["allocator"][family.name],
                                  host_gib=host[family.name])
    time = time_table(fitted)                 # (sets what it fits where the forecast reads it)
    shared = {**cost.CALIBRATION, "runs": runs,
              "rows": [str(Path(n).resolve().relative_to(ROOT)) if Path(n).resolve().is_relative_to(ROOT) else n
                       for n in a.rows],
              "time": {name: time[name] for name, where, *_ in TIME_COEFFICIENTS if where == ("shared",)}}
    cost.CALIBRATION = shared
    print(json.dumps({"shared": shared, **{f.name: f.calibration for f in families}}, indent=1))
    print("each mode's compiled dense speeds (forward, backward) and extra host GiB, for its file in "
          "ugpum/compute/modes/:", {m.name: (m.dense_speed["compiled"], m.extra_host_gib) for m in MODES})
    print("\n".join(recorded_forecasts.table()))
    now = {"shared": shared["time"], **{f.name: dict(f.calibration) for f in FAMILIES},
           **{m.name: (m.dense_speed["compiled"], m.extra_host_gib) for m in MODES}}
    if a.check and now != held:
        print("the planner reads other coefficients:", {k: (held[k], v) for k, v in now.items() if held[k] != v})
        return 1
    if a.write:
        cost.CALIBRATION_FILE.write_text(json.dumps(shared, indent=1) + "\n")
        for family in families:
            calibration_file(family).write_text(json.dumps(family.calibration, indent=1) + "\n")
        print("wrote", ", ".join(str(p.relative_to(ROOT)) for p in
                                 [cost.CALIBRATION_FILE, *(calibration_file(f) for f in families)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

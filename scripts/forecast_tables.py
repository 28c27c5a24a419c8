"""The forecast tables of README.md and docs/, made from the planner: each lies between
`<!-- forecast-table NAME -->` and `<!-- /forecast-table -->`, and this script rewrites what is between.

    python scripts/forecast_tables.py            # rewrite the tables
    python scripts/forecast_tables.py --check    # exit 1 if a table differs from what the planner says now

tests/unit/test_forecast_tables.py runs the check, so a table cannot go stale.
"""
from __future__ import annotations

import argparse
import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ugpum.compute.modes import mode_named  # noqa: E402
from ugpum.planning.devices import parse_device_specs  # noqa: E402
from ugpum.planning.forecast import plan_for_config  # noqa: E402
from ugpum.planning.plan import PlanError  # noqa: E402
from ugpum.train.config import load_config  # noqa: E402

FILES = ("README.md", "docs/planner.md")
# (row title, profile, overrides) and (column title, --gpu specs)
CARD_ROWS = (("klein 9B, bf16 (`klein-9b-1024`)", "klein-9b-1024", {}),
             ("klein 9B, 8-bit base (`--base-compute auto`)", "klein-9b-1024", {"base_compute": "auto"}),
             ("klein 4B, bf16 (`klein-4b-1024`)", "klein-4b-1024", {}),
             ("FLUX.2 [dev], fp8 weights (`flux2-dev-1024`)", "flux2-dev-1024", {}),
             ("Wan 2.1 14B, 17 frames 480p, fp8 (`wan14b-480-clip`)", "wan14b-480-clip", {}))
CARD_COLUMNS = (("8 GB (RTX 4060)", ["rtx4060"]), ("12 GB (RTX 3060)", ["rtx3060"]),
                ("16 GB (RTX 4060 Ti)", ["rtx4060ti-16g"]), ("24 GB (RTX 4090)", ["rtx4090"]),
                ("32 GB (RTX 5090)", ["rtx5090"]), ("2x 16 GB (RTX 4060 Ti)", ["rtx4060ti-16g", "rtx4060ti-16g"]))
RIG_ROWS = (("one RTX 4090 (24 GB)", ["rtx4090"], {}),
            ("same, `--base-compute fp8`", ["rtx4090"], {"base_compute": "fp8"}),
            ("one RTX 4060 Ti 16 GB", ["rtx4060ti-16g"], {}),
            ("same, `--base-compute auto`", ["rtx4060ti-16g"], {"base_compute": "auto"}),
            ("two RTX 4060 Ti 16 GB", ["rtx4060ti-16g", "rtx4060ti-16g"], {}),
            ("same, `--grad-accum 4`", ["rtx4060ti-16g", "rtx4060ti-16g"], {"grad_accum": 4}),
            ("same, `--grad-accum 4 --base-compute auto`", ["rtx4060ti-16g", "rtx4060ti-16g"],
             {"grad_accum": 4, "base_compute": "auto"}),
            ("one 16 GiB card (a bare size: an RTX 4090's speed)", ["16GiB"], {}))


def cell(profile: str, overrides: dict, gpus: list[str]) -> str:
    """One forecast in a few words: s/step, then blocks swapped (per copy) or the fullest GPU's GiB, and for
    several GPUs the layout the planner chose; where the recomputed blocks' inputs wait in host memory, so."""
    try:
        plan = plan_for_config(load_config(profile, overrides=overrides), parse_device_specs(gpus, probe=False))
    except PlanError:
        return "does not fit"
    quantised = mode_named(plan.base_compute).quantises and overrides.get("base_compute")
    mode = f", {plan.base_compute}" if quantised else ""
    layout = "" if len(gpus) == 1 else f", {len(plan.replicas)} replicas" if plan.replicas else \
        ", one card" if len(plan.stages) == 1 else ", split"
    layout += ", inputs on host" if any(p.inputs_on_host_gib for p in plan.copies) else ""
    if plan.offloaded_blocks:
        return f"{plan.predicted_step_s:.1f} s, swap {len(plan.offloaded_blocks)}{mode}{layout}"
    return f"{plan.predicted_step_s:.1f} s, {max(s.forecast_gib for s in plan.stages):.1f} GiB{mode}{layout}"


@functools.cache
def cards_table() -> list[str]:
    lines = ["| model (profile) | " + " | ".join(title for title, _ in CARD_COLUMNS) + " |",
             "|---|" + "---|" * len(CARD_COLUMNS)]
    for title, profile, overrides in CARD_ROWS:
        lines.append(f"| {title} | " + " | ".join(cell(profile, overrides, gpus) for _, gpus in CARD_COLUMNS) + " |")
    return lines


@functools.cache
def rigs_table() -> list[str]:
    lines = ["| rig | klein 9B at 1024² (`klein-9b-1024`): s/step, swap or GiB | host memory at the peak |",
             "|---|---|---|"]
    for title, gpus, overrides in RIG_ROWS:
        plan = plan_for_config(load_config("klein-9b-1024", overrides=overrides), parse_device_specs(gpus, probe=False))
        lines.append(f"| {title} | {cell('klein-9b-1024', overrides, gpus)} | {plan.forecast_host_gib:.1f} GiB |")
    return lines


TABLES = {"cards": cards_table, "rigs": rigs_table}
BLOCK = re.compile(r"(<!-- forecast-table (\w+) -->\n)(.*?)(<!-- /forecast-table -->)", re.S)


def render(text: str) -> str:
    return BLOCK.sub(lambda m: m[1] + "\n".join(TABLES[m[2]]()) + "\n" + m[4], text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a table differs from the planner's")
    a = p.parse_args(argv)
    stale = []
    for name in FILES:
        path = ROOT / name
        text = path.read_text()
        new = render(text)
        if new != text:
            stale.append(name)
            if not a.check:
                path.write_text(new)
    if a.check and stale:
        print(f"forecast tables differ from the planner in {', '.join(stale)}: run python scripts/forecast_tables.py")
        return 1
    print(("rewrote " + ", ".join(stale)) if stale and not a.check else "forecast tables match the planner")
    return 0


if __name__ == "__main__":
    sys.exit(main())

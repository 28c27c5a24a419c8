"""The host memory forecast (issue 29, item 4): the process's measured base for the family plus the pinned
copies of the swapped blocks; `plan` shows it, and says what to change when this machine's RAM is short."""
from __future__ import annotations

import pytest

from ugpum.planning import cost
from ugpum.arch import Workload, get_spec
from ugpum.planning.devices import Device, host_memory, parse_device_specs
from ugpum.planning.forecast import format_plan
from ugpum.planning.plan import GIB, make_plan

DEV = get_spec("flux2-dev")
KLEIN = get_spec("flux2-klein-9b")


def this_machines_gpu(gib: float) -> Device:
    """A GPU of this machine as detection reports it (so its host is this machine)."""
    return Device("cuda:0 a card", "cuda:0", int(gib * GIB), int(gib * GIB), 100.0, 25.0, "pcie4x16", (8, 9))


def test_the_forecast_is_the_base_plus_the_pinned_copies_and_plan_shows_it():
    plan = make_plan(KLEIN, parse_device_specs(["rtx4060ti-16g"]), Workload(compiled=True))
    pinned = sum(cost.block_weight_bytes(KLEIN.blocks[i], Workload()) for i in plan.offloaded_blocks)
    assert plan.offloaded_blocks and pinned > 4 * GIB
    assert plan.forecast_host_gib * GIB == pytest.approx(cost.family_rows(KLEIN)["host_gib"] * GIB + pinned,
                                                         abs=0.01 * GIB)
    text = format_plan(plan)
    assert f"host memory: {plan.forecast_host_gib:.1f} GiB at the peak of training, {pinned / GIB:.1f} of it pinned" in text


def test_short_ram_is_said_with_the_fix_for_this_machines_gpus_only():
    _, available = host_memory()
    w = Workload(compiled=True)                       # FLUX.2 [dev] in bf16: ~60 GiB of pinned copies on 24 GiB
    here = make_plan(DEV, [this_machines_gpu(24)], w)
    assert here.forecast_host_gib * GIB > available
    assert f"the run needs {here.forecast_host_gib:.1f} GiB at its peak" in here.verdict
    assert "base compute fp8 or int8" in here.verdict
    described = make_plan(DEV, parse_device_specs(["24GiB"]), w)      # planning a rig that is not this machine
    assert "Host memory" not in described.verdict
    small = make_plan(KLEIN, [this_machines_gpu(80)], w)              # no swap: the base alone
    assert "Host memory" not in small.verdict

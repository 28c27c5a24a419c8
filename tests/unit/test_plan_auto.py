"""base_compute = auto (issue 24, issue 38): the fastest forecast among bf16 and the cards' 8-bit modes within
the quality bound (fp8 on Ada/Hopper/Blackwell, int8 on Ampere), and a bf16 plan that swaps shows the 8-bit
plans (the choice against each mode's own plan: test_auto_base_compute.py)."""
from __future__ import annotations

import json

import pytest

from ugpum.arch import get_spec
from ugpum.planning.devices import parse_device_specs
from ugpum.planning.forecast import format_plan
from ugpum.planning.plan import plan_training
from ugpum.train.config import TrainConfig

KLEIN = get_spec("flux2-klein-9b")


def _plan(gpu: str, mode: str, **settings):
    return plan_training(KLEIN, parse_device_specs([gpu]),
                         TrainConfig(model=KLEIN.id, base_compute=mode, **settings).workload())


def test_auto_keeps_bf16_where_its_forecast_is_the_fastest():
    """Eager blocks: fp8's matmuls measured slower than bf16's there (ugpum/compute/modes/fp8.py). On a card
    where every block keeps its activations either way, fp8's smaller weights buy nothing back (on a 24 GB
    card at 1024² they let more blocks keep theirs, and auto takes fp8)."""
    plan = _plan("rtx5090", "auto", compile="off", resolution=512)
    assert plan.base_compute == "bf16" and not plan.offloaded_blocks and len(plan.stages[0].kept_activations) == 32
    assert plan.base_compute_note.startswith("base compute auto: bf16, the fastest forecast (")
    assert [a["base_compute"] for a in plan.alternatives] == ["fp8", "int8"]


def test_auto_takes_the_cards_8bit_mode_where_bf16_would_swap():
    ada, ampere = _plan("rtx4070", "auto"), _plan("rtx3060", "auto")
    bf16 = _plan("rtx4070", "bf16")
    assert ada.base_compute == "fp8"
    # Ampere's 8-bit mode is int8 (no fp8 cores); int8 measured slower than bf16 (ugpum/compute/modes/int8.py), so
    # the 3060 weighs it against bf16 with swap and says which won
    assert "int8" in ampere.base_compute_note and "fp8" not in ampere.base_compute_note
    assert ampere.base_compute == ("int8" if "bf16, the fastest" not in ampere.base_compute_note else "bf16")
    assert len(ada.offloaded_blocks) < len(bf16.offloaded_blocks)        # half the bytes to hold and stream
    assert ada.swap_bytes_per_step < bf16.swap_bytes_per_step / 2
    assert ada.predicted_step_s < bf16.predicted_step_s
    assert "faster than bf16" in ada.base_compute_note and "cosine" in ada.base_compute_note


def test_a_bf16_plan_with_swap_lists_the_8bit_plans_the_card_can_run():
    text = format_plan(_plan("rtx4070", "bf16"))
    assert "with base compute fp8:" in text and "with base compute int8:" in text and "cosine 0.99802" in text
    ampere = format_plan(_plan("rtx3060", "bf16"))
    assert "with base compute int8:" in ampere and "with base compute fp8" not in ampere   # no fp8 cores


def test_an_8gib_card_plans_the_8bit_base_with_swap():
    plan = _plan("rtx4060", "auto")
    assert plan.base_compute == "fp8" and plan.offloaded_blocks
    assert plan.stages[0].forecast_gib <= plan.stages[0].budget_gib


def test_fp8_on_a_card_without_fp8_cores_is_refused_with_the_fix(capsys):
    from ugpum.commands import main
    assert main(["plan", "--profile", "klein-9b-1024", "--gpu", "rtx3060", "--base-compute", "fp8"]) == 2
    said = capsys.readouterr().err.strip()
    assert "rtx3060 has none (compute capability 8.6)" in said and "--base-compute int8" in said and "\n" not in said
    assert main(["plan", "--profile", "klein-9b-1024", "--gpu", "rtx3060", "--base-compute", "int8"]) == 0


def test_the_plan_says_which_speed_memory_and_link_it_assumed(capsys):
    from ugpum.commands import main
    assert main(["plan", "--profile", "klein-9b-1024", "--gpu", "16GiB", "--gpu", "rtx4090@pcie4x4"]) == 0
    out = capsys.readouterr().out
    assert "assumed: 16GiB: 16 GiB less 0.64 for the CUDA context and 0.5 for the desktop" in out
    assert "an RTX 4090's (a bare size; name the card" in out and "host link pcie4x16 at 25 GB/s" in out
    assert "assumed: rtx4090@pcie4x4:" in out and "the rtx4090 spec sheet's; host link pcie4x4 at 6 GB/s" in out


def test_desktop_gib_sets_what_each_card_leaves_to_the_desktop(capsys):
    from ugpum.commands import main
    budgets = {}
    for desktop in ("0", "2"):
        assert main(["plan", "--profile", "klein-9b-1024", "--gpu", "16GiB", "--desktop-gib", desktop, "--json"]) == 0
        budgets[desktop] = json.loads(capsys.readouterr().out)["stages"][0]["budget_gib"]
    assert budgets["0"] - budgets["2"] == pytest.approx(2 * 0.97, abs=0.01)
    assert main(["plan", "--profile", "klein-9b-1024", "--gpu", "16GiB", "--desktop-gib", "-1"]) == 2
    assert "setting 'desktop_gib' = -1.0" in capsys.readouterr().err

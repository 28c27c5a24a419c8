"""base_compute = auto (issue 38): the fastest forecast among bf16 and every mode the card runs whose LoRA
gradients stay within the quality bound of the exact base (`ugpum.compute.modes.QUALITY_BOUND`), each weighed
by its own plan; the plan says in one line which it took, and by how much."""
from __future__ import annotations

import pytest

from support.cli_run import main_here
from ugpum.compute import modes
from ugpum.planning.devices import parse_device_specs
from ugpum.planning.forecast import plan_for_config
from ugpum.train.config import TrainConfig

CARDS = ["rtx4090", "rtx5090"]          # 24 and 32 GiB: bf16 fits both without swap


def planned(card: str, base_compute: str):
    """`ugpum plan --model flux2-klein-9b --resolution 1024 --rank 16 --gpu CARD --base-compute MODE`'s plan."""
    cfg = TrainConfig(model="flux2-klein-9b", resolution=1024, rank=16, base_compute=base_compute)
    return plan_for_config(cfg, parse_device_specs([card], probe=False))


def forecasts_within_bound(card: str) -> dict:
    """{mode: s/step} of each mode the card runs within the quality bound, each planned on its own."""
    capability = parse_device_specs([card], probe=False)[0].compute_capability
    return {mode.name: planned(card, mode.name).predicted_step_s for mode in (modes.EXACT, *modes.tensor_core_modes())
            if mode.runs_on(capability) and modes.within_quality_bound(mode)}


@pytest.mark.parametrize("card", CARDS)
def test_auto_takes_the_fastest_forecast_within_the_bound(card):
    forecasts = forecasts_within_bound(card)
    assert set(forecasts) == {"bf16", "fp8", "int8"}            # fp8 0.99802 and int8 0.99961 reach 0.998
    fastest = min(forecasts, key=forecasts.get)
    auto = planned(card, "auto")
    assert auto.base_compute == fastest == "fp8"                 # (bf16 would fit: the old rule kept it)
    assert auto.predicted_step_s == forecasts[fastest]
    faster = 1 - forecasts[fastest] / forecasts["bf16"]
    assert auto.base_compute_note.startswith(f"base compute auto: {fastest}, forecast {faster:.0%} faster than bf16 "
                                             f"({forecasts[fastest]:.2f} against {forecasts['bf16']:.2f} s/step; "
                                             "LoRA gradients vs the bf16 base: cosine 0.99802 per block)")
    assert sorted(a["base_compute"] for a in auto.alternatives) == sorted(set(forecasts) - {fastest})


def test_a_bound_above_a_modes_cosine_leaves_it_out(monkeypatch):
    monkeypatch.setattr(modes, "QUALITY_BOUND", 0.999)           # above fp8's 0.99802, below int8's 0.99961
    forecasts = forecasts_within_bound("rtx4090")
    assert set(forecasts) == {"bf16", "int8"}
    auto = planned("rtx4090", "auto")
    assert auto.base_compute == min(forecasts, key=forecasts.get) != "fp8"
    assert "fp8" not in auto.base_compute_note and "fp8" not in [a["base_compute"] for a in auto.alternatives]
    monkeypatch.setattr(modes, "QUALITY_BOUND", 0.9999)          # above both
    auto = planned("rtx4090", "auto")
    assert auto.base_compute == "bf16" and not auto.alternatives
    assert "no mode these devices run stays within the quality bound" in auto.base_compute_note
    assert "cosine >= 0.9999 per block (fp8 0.99802, int8 0.99961)" in auto.base_compute_note


def test_a_mode_without_a_recorded_cosine_is_never_taken(monkeypatch):
    fp8 = modes.mode_named("fp8")
    monkeypatch.setattr(type(fp8), "gradient_cosine", None)
    assert not modes.within_quality_bound(fp8) and "not measured" in fp8.quality
    assert planned("rtx4090", "auto").base_compute != "fp8"


def test_plan_prints_the_choice_in_one_line():
    done = main_here("plan", "--model", "flux2-klein-9b", "--resolution", "1024", "--rank", "16",
                     "--gpu", "rtx4090", "--base-compute", "auto")
    assert done.returncode == 0, done.stderr
    note = [line for line in done.stdout.splitlines() if line.startswith("base compute auto:")]
    assert len(note) == 1 and note[0].startswith("base compute auto: fp8, forecast ")
    assert note[0].endswith("; --base-compute bf16 trains on the exact base")
    assert "with base compute bf16:" in done.stdout and "with base compute int8:" in done.stdout


def test_a_quantised_plan_says_where_its_speed_ratio_was_measured():
    """Issue 41 item 5: a card the mode's speed was not measured on is forecast with the measured ratio, and the
    plan's assumed: lines say which ratio, where it was measured, and that this card was not."""
    int8 = modes.mode_named("int8")
    forward, backward = int8.dense_speed["compiled"]
    said = planned("rtx3090", "int8").assumed
    assert (f"base compute int8: compiled dense matmuls at {forward:g}x (forward) and {backward:g}x (backward) "
            f"their bf16 speed, as measured on an {int8.speed_measured_on['compiled']}; taken as they are for "
            f"rtx3090 (not measured there)" in said)
    assert not any(line.startswith("base compute") for line in planned("rtx3090", "bf16").assumed)

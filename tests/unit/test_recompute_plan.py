"""Planned recompute (issue 23, item 3): `recompute = auto` keeps the activations of the resident blocks the
budget still holds, the largest saving first; `all` and `none` are the older checkpointing true and false.
On the real klein 9B spec at 1024², on a 24 GiB card and on the H200's memory; no training."""
import dataclasses

import pytest

from ugpum.planning import cost
from ugpum.arch import Workload, get_spec
from ugpum.planning.devices import GIB, Device, parse_device_specs
from ugpum.planning.forecast import format_plan
from ugpum.planning.plan import HEADROOM, StageCosts, budget_bytes, make_plan, plan_training
from ugpum.train.run.checkpoint import MAY_CHANGE
from ugpum.train.config import ConfigError, load_config

KLEIN = get_spec("flux2-klein-9b")
N = len(KLEIN.blocks)
W = Workload(width=1024, height=1024, compiled=True)


def card(free_bytes: float, tflops: float = 680.0) -> Device:
    """A detected GPU (no CUDA context to take off) with `free_bytes` free."""
    return Device("gpu", "cuda:0", int(free_bytes), int(free_bytes), tflops, 55.0, "pcie5x16", (9, 0))


def recompute_all_bytes(w: Workload = W, in_flight: int = 1) -> float:
    """What the whole model needs on one device with every block recomputed: the least `auto` needs."""
    return sum(StageCosts(KLEIN, [card(GIB)], w, in_flight)._memory(0, 0, N, (), ()).values())


def auto_plan(free_bytes: float, in_flight: int = 1, w: Workload = W):
    return make_plan(KLEIN, [card(free_bytes)], dataclasses.replace(w, recompute="auto"), in_flight=in_flight)


def test_auto_keeps_none_when_tight_more_as_the_budget_grows_all_on_a_huge_one():
    least = recompute_all_bytes() / (1 - HEADROOM)
    counts = []
    for extra_gib in (0.1, 2, 5, 10, 20, 40, 80):
        plan = auto_plan(least + extra_gib * GIB / (1 - HEADROOM))
        (stage,) = plan.stages
        assert stage.offloaded == [] and stage.forecast_gib <= stage.budget_gib + 1e-3
        counts.append(len(plan.kept_activations))
    assert counts[0] == 0 and counts[-1] == N
    assert counts == sorted(counts) and len(set(counts)) >= 4, counts


@pytest.mark.parametrize("gpu", ["rtx4090", "h200"])
def test_auto_fits_its_budget_and_its_step_lies_between_none_and_all(gpu):
    devices = parse_device_specs([gpu], probe=False)
    plans = {r: plan_training(KLEIN, devices, dataclasses.replace(W, recompute=r)) for r in ("auto", "all")}
    auto, every = plans["auto"], plans["all"]
    (stage,) = auto.stages
    assert stage.forecast_gib <= budget_bytes(devices[0]) / GIB + 1e-3
    # the step without any recompute, on the same device (it need not fit there)
    fastest = sum(cost.block_seconds(KLEIN, b, W, devices[0].tflops_bf16, False) for b in KLEIN.blocks)
    assert fastest <= auto.predicted_step_s <= every.predicted_step_s
    # (what the kept blocks save against every block recomputed the way auto recomputes the rest)
    alike = make_plan(KLEIN, devices, dataclasses.replace(W, recompute="all",
                                                          attention_kept=auto.workload["attention_kept"]))
    assert auto.recompute_saved_s == pytest.approx(alike.predicted_step_s - auto.predicted_step_s)
    kept = auto.kept_activations
    if gpu == "h200":                      # 139.8 GiB: every block keeps its activations, as none would
        assert kept == list(range(N)) and auto.predicted_step_s == pytest.approx(fastest)
    else:                                  # 24 GiB: a few blocks, not all
        assert 0 < len(kept) < N and auto.predicted_step_s < every.predicted_step_s
    # the memory forecast counts each kept block's activations instead of its input (and its attention, where
    # the recomputed blocks keep that)
    w = dataclasses.replace(W, attention_kept=auto.workload["attention_kept"])
    grown = sum(cost.block_activation_bytes(KLEIN, KLEIN.blocks[i], w, False)
                - cost.block_activation_bytes(KLEIN, KLEIN.blocks[i], w, True) for i in kept)
    assert stage.kept_gib * GIB == pytest.approx(grown - _peak_drop(kept), abs=0.002 * GIB)
    line = f"recompute auto: {len(kept)} of {N} blocks keep their activations (+{stage.kept_gib:.1f} GiB)"
    assert line in format_plan(auto)


def _peak_drop(kept: list[int]) -> float:
    """How much lower the recompute peak sits when the `kept` blocks are not recomputed."""
    def peak(recomputed):
        return max(cost.block_peak_extra_bytes(KLEIN, b, W, i in recomputed) for i, b in enumerate(KLEIN.blocks))
    return peak(set(range(N))) - peak(set(range(N)) - set(kept))


def old_forecast(devices: list[Device], w: Workload, checkpointing: bool) -> tuple[float, float]:
    """(GiB, s/step) of one device without swap, by the formula the planner used with its one global
    checkpointing switch: every block's activations and its recompute counted the same way."""
    (dev,) = devices
    blocks = KLEIN.blocks
    memory = (sum(cost.block_weight_bytes(b, w) + cost.lora_bytes(b, w) for b in blocks)
              + KLEIN.head_params * 2 + w.batch * w.text_tokens * KLEIN.context_dim * 2 + KLEIN.tail_params * 2
              + sum(cost.block_activation_bytes(KLEIN, b, w, checkpointing) for b in blocks)
              + max(cost.block_peak_extra_bytes(KLEIN, b, w, checkpointing) for b in blocks)
              + KLEIN.shared_input_bytes(w) + 2 * KLEIN.boundary_bytes(w) + cost.allocator_bytes(KLEIN, w))
    seconds = sum(cost.block_seconds(KLEIN, b, w, dev.tflops_bf16, checkpointing) for b in blocks)
    return memory / GIB, seconds


@pytest.mark.parametrize("checkpointing", [True, False])
def test_all_and_none_forecast_what_checkpointing_true_and_false_did(checkpointing):
    devices = parse_device_specs(["h200"], probe=False)
    by_switch = Workload(width=1024, height=1024, compiled=True, checkpointing=checkpointing)
    assert by_switch == dataclasses.replace(W, recompute="all" if checkpointing else "none")
    plan = plan_training(KLEIN, devices, by_switch)
    assert plan.workload["attention_kept"] is checkpointing    # (the H200 holds the recomputed blocks' attention)
    gib, seconds = old_forecast(devices, dataclasses.replace(by_switch, attention_kept=checkpointing), checkpointing)
    (stage,) = plan.stages
    assert stage.offloaded == [] and stage.forecast_gib == pytest.approx(gib, abs=0.001)
    assert plan.predicted_step_s == pytest.approx(seconds, rel=1e-12)
    assert stage.kept_activations == ([] if checkpointing else list(range(N)))
    assert plan.to_json()["workload"]["checkpointing"] is checkpointing     # (plan.json's older key)


def test_swapped_blocks_are_never_kept():
    """At 256² a swap set leaves room for a kept block or so; the swapped ones stay recomputed."""
    small = Workload(width=256, height=256, compiled=True, recompute="auto")
    both = 0
    for gib in (8, 10, 12, 14, 16.5, 18.5):
        plan = make_plan(KLEIN, [card(gib * GIB)], small)
        (stage,) = plan.stages
        assert not set(stage.offloaded) & set(stage.kept_activations)
        assert stage.forecast_gib <= stage.budget_gib + 1e-3
        both += bool(stage.offloaded and stage.kept_activations)
    assert both >= 3


def test_in_flight_micro_batches_count_each_kept_block_that_many_times():
    free = (recompute_all_bytes(in_flight=2) + 12 * GIB) / (1 - HEADROOM)
    one, two = auto_plan(free, in_flight=1), auto_plan(free, in_flight=2)
    assert 0 < len(two.kept_activations) < len(one.kept_activations)
    for plan in (one, two):
        assert plan.stages[0].forecast_gib <= plan.stages[0].budget_gib + 1e-3
    # at the same kept set, two micro-batches in flight hold the kept growth twice
    ev1, ev2 = (StageCosts(KLEIN, [card(free)], dataclasses.replace(W, recompute="auto"), k) for k in (1, 2))
    kept = tuple(two.kept_activations)
    grown = [ev._memory(0, 0, N, (), kept)["activations"] - ev._memory(0, 0, N, (), ())["activations"]
             for ev in (ev1, ev2)]
    assert grown[1] - grown[0] == pytest.approx(sum(ev1.kept[False][i] - ev1.kept[True][i] for i in kept))


def test_largest_saving_first_then_the_fewest_bytes():
    """FLUX.2's double and single blocks save the same seconds (the same FLOPs); at fp8 weights a single
    block's kept activations cost fewer bytes (its cast weight copy is half a double block's)."""
    fp8 = dataclasses.replace(W, held_dtype="fp8", recompute="auto")
    ev = StageCosts(KLEIN, [card(GIB)], fp8, 1)
    singles = [i for i, b in enumerate(KLEIN.blocks) if b.kind == "single"]
    assert ev.keep_order[:len(singles)] == singles
    saving = [cost.recompute_seconds(KLEIN, b, fp8, 1.0) for b in KLEIN.blocks]
    assert max(saving) == pytest.approx(min(saving), rel=1e-9) and min(saving) > 0


def test_failure_advice_names_recompute_all():
    from ugpum.planning.plan import PlanError
    with pytest.raises(PlanError) as failed:
        make_plan(KLEIN, parse_device_specs(["24GiB"], probe=False), dataclasses.replace(W, recompute="none"))
    assert "{setting:recompute=all}" in str(failed.value)
    with pytest.raises(PlanError) as failed:                 # auto already recomputes all where it must
        make_plan(KLEIN, parse_device_specs(["8GiB"], probe=False),
                  dataclasses.replace(W, width=2048, height=2048, batch=4, recompute="auto"))
    assert "recompute" not in str(failed.value)


def test_checkpointing_stays_an_alias_of_all_and_none():
    assert load_config("tiny-flux2").recompute == "auto"
    assert load_config("tiny-flux2", overrides={"checkpointing": False}).recompute == "none"
    assert load_config("tiny-flux2", overrides={"gradient_checkpointing": True}).recompute == "all"
    assert load_config("tiny-flux2", overrides={"checkpointing": True}).workload().recompute == "all"
    with pytest.raises(ConfigError, match="'checkpointing' = false and 'recompute' = 'all' disagree"):
        load_config("tiny-flux2", overrides={"checkpointing": False, "recompute": "all"})
    with pytest.raises(ConfigError, match="setting 'recompute' = 'some'"):
        load_config("tiny-flux2", overrides={"recompute": "some"})
    assert "recompute" in MAY_CHANGE                          # the same LoRA either way: a resume may change it


def test_toml_checkpointing_is_overridden_by_a_later_recompute(tmp_path):
    toml = tmp_path / "old.toml"
    toml.write_text("[train]\ncheckpointing = false\n")
    assert load_config(toml_file=toml).recompute == "none"
    assert load_config(toml_file=toml, overrides={"recompute": "auto"}).recompute == "auto"


def test_recomputed_blocks_keep_their_attention_where_that_is_faster_and_swaps_nothing(monkeypatch):
    """`Workload.attention_kept`: the plan keeps each recomputed block's self-attention output where that plan is
    faster and swaps no block; it then holds one attention output and its statistics more per recomputed block."""
    devices = parse_device_specs(["h200"], probe=False)
    every = plan_training(KLEIN, devices, dataclasses.replace(W, recompute="all"))
    given = make_plan(KLEIN, devices, dataclasses.replace(W, recompute="all"))     # (the workload as given)
    assert every.workload["attention_kept"] and not given.workload["attention_kept"]
    (kept,), (plain,) = every.stages, given.stages
    grown = N * KLEIN.kept_attention_bytes(W)
    assert grown == N * 4608 * (4096 * 2 + 32 * 4)             # [tokens, hidden] in bf16 and fp32 per head and token
    assert (kept.forecast_gib - plain.forecast_gib) * GIB == pytest.approx(grown, abs=0.002 * GIB)
    assert every.predicted_step_s < given.predicted_step_s
    assert f"those recomputed keep their self-attention outputs (+{grown / GIB:.1f} GiB)" in format_plan(every)
    tight = plan_training(KLEIN, [card(12 * GIB)], dataclasses.replace(W, recompute="all"))
    assert tight.offloaded_blocks and not tight.workload["attention_kept"]
    assert "self-attention" not in format_plan(tight)
    import ugpum.planning.plan as planning
    monkeypatch.setattr(planning, "KEEP_ATTENTION", False)      # (a torch without selective checkpointing)
    assert not plan_training(KLEIN, devices, dataclasses.replace(W, recompute="all")).workload["attention_kept"]

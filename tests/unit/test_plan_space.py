"""The plan space (issue 40): one card, the split, replicas and splits x replicas, weighed by forecast; the
fastest that fits GPU and host memory is the plan, and the table of what was weighed goes with it."""
import json

import pytest

from ugpum.arch import get_spec
from ugpum.commands import main
from ugpum.planning import replicas as costs
from ugpum.planning.devices import parse_device_specs
from ugpum.planning.forecast import format_plan, plan_for_config
from ugpum.planning.plan import GIB, PlanError
from ugpum.planning.space import best_plan
from ugpum.train.config import load_config

# issue 40's rigs: a model and a card, two of them
RIGS = [("klein-9b-1024", "rtx3060"), ("klein-9b-1024", "rtx4060ti-16g"), ("klein-9b-1024", "rtx3090"),
        ("flux2-dev-1024", "rtx4090"), ("wan14b-480-clip", "rtx4090")]
KLEIN = get_spec("flux2-klein-base-9b")


def planned(profile: str, gpus: list[str], grad_accum: int, replicas: int = 0, **settings):
    cfg = load_config(profile, overrides={"grad_accum": grad_accum, "replicas": replicas, "base_compute": "auto",
                                          **settings})
    return plan_for_config(cfg, parse_device_specs(gpus, probe=False))


@pytest.mark.parametrize("profile, card", RIGS, ids=[f"{p}-{c}" for p, c in RIGS])
def test_two_cards_are_never_slower_than_the_better_of_the_split_and_the_replicas(profile, card):
    for m in (2, 4, 8):
        pick = planned(profile, [card, card], m)
        weighed = {r["layout"]: r for r in pick.layouts}
        split, replicas = weighed["split over 2 GPUs"], weighed["2 replicas"]
        assert [r["chosen"] for r in pick.layouts].count(True) == 1
        assert pick.predicted_step_s <= min(split["predicted_step_s"], replicas["predicted_step_s"]) * 1.02
        # the replicas: the one-card plan at half the micro-batches, plus what they are stated to cost
        one_card = planned(profile, [card], m // 2)
        assert replicas["predicted_step_s"] >= one_card.predicted_step_s
        if pick.replicas:       # (no faster than a lone card: replicas that swap share the host's rate too)
            assert pick.predicted_step_s >= one_card.predicted_step_s * (1 + costs.ONE_PROCESS_LOSS) + pick.average_s
            assert 0 < pick.average_s < 0.02 * pick.predicted_step_s


def test_a_model_no_card_holds_even_with_swap_is_split():
    """FLUX.2 [dev] on two 8 GiB cards: one card cannot hold it even with every block swapped, so neither can
    a replica; the split can. (Two 9 GiB cards each hold a replica: fp8, 54 blocks swapped, inputs on host.)"""
    plan = planned("flux2-dev-1024", ["8GiB", "8GiB"], 2)
    rows = {r["layout"]: r for r in plan.layouts}
    assert not plan.replicas and len(plan.stages) == 2
    assert rows["2 replicas"]["fits"] is False and rows["2 replicas"]["note"] == "does not fit"
    assert rows["one card (8GiB)"]["predicted_step_s"] is None


def test_host_memory_too_small_for_the_swapped_copy_makes_the_split_win():
    """Two 12 GB cards, klein 9B in bf16: each replica swaps about 21 blocks (one shared pinned copy, 14 GiB of
    host memory); with 8 GiB available the split, which swaps less, is the plan and the table says why."""
    cfg = load_config("klein-9b-1024", overrides=dict(grad_accum=2))
    devices = parse_device_specs(["rtx3060", "rtx3060"], probe=False)
    roomy = best_plan(KLEIN, devices, cfg.workload(), 2, host_available=64 * GIB)
    tight = best_plan(KLEIN, devices, cfg.workload(), 2, host_available=8 * GIB)
    assert roomy.replicas and roomy.forecast_host_gib > 8
    assert not tight.replicas and tight.forecast_host_gib <= 8
    [replicas_row] = [r for r in tight.layouts if r["replicas"] == 2]
    assert not replicas_row["fits"] and replicas_row["note"].startswith(
        f"host memory: needs {roomy.forecast_host_gib:.1f} GiB, 8.0 available")


def test_replicas_in_one_process_share_the_pinned_copy_and_processes_do_not():
    plan = planned("klein-9b-1024", ["rtx3060", "rtx3060"], 2, replicas=2, base_compute="bf16")
    assert all(p.offloaded_blocks == plan.replicas[0].offloaded_blocks for p in plan.replicas)
    one, apart = (costs.pinned_bytes(KLEIN, plan.replicas, how) for how in ("one process", "processes"))
    assert len(one) == 1 and apart == [one[0], one[0]]
    assert plan.forecast_host_gib == costs.host_gib(KLEIN, plan.replicas, "one process")
    assert costs.host_gib(KLEIN, plan.replicas, "processes") > 2 * plan.forecast_host_gib - 0.01
    # two replicas swapping at once read host memory at its rate, half each
    assert any("host memory read at 40 GB/s by the 2 replicas that swap, 20 GB/s each" in a for a in plan.assumed)


def test_splits_times_replicas_on_four_cards():
    plan = planned("klein-9b-1024", ["rtx3060"] * 4, 4)
    names = [r["layout"] for r in plan.layouts]
    assert names == ["split over 4 GPUs", "4 replicas", "2 replicas of a 2-GPU split", "one card (rtx3060)"]
    mixed = planned("klein-9b-1024", ["rtx3060"] * 4, 4, replicas=2)
    assert [len(p.stages) for p in mixed.replicas] == [2, 2] and mixed.shares == [2, 2]
    text = format_plan(mixed)
    assert "replica 2: rtx3060" in text and "2 replicas, each on its own 2 GPUs training 2 of the 4" in text


def test_the_replicas_setting_fixes_the_layout_or_says_what_is_wrong():
    split = planned("klein-9b-1024", ["rtx4090", "rtx4090"], 4, replicas=1)
    assert not split.replicas and not split.layouts                   # one layout weighed: no table
    uneven = planned("klein-9b-1024", ["rtx4090", "rtx4090"], 3, replicas=2)
    assert uneven.shares == [2, 1]
    with pytest.raises(PlanError, match=r"replicas=3\}: 2 device\(s\) do not divide into 3 replicas"):
        planned("klein-9b-1024", ["rtx4090", "rtx4090"], 4, replicas=3)
    with pytest.raises(PlanError, match="replicas=2}: 2 replicas need at least 2 micro-batches per step"):
        planned("klein-9b-1024", ["rtx4090", "rtx4090"], 1, replicas=2)


def test_a_cpu_run_stays_one_copy_unless_asked():
    auto = planned("tiny-flux2", ["cpu", "cpu"], 2)
    asked = planned("tiny-flux2", ["cpu", "cpu"], 2, replicas=2)
    assert not auto.replicas and len(auto.stages) == 2
    assert len(asked.replicas) == 2
    assert asked.verdict == "A CPU run (cpu, cpu) as 2 replicas: fits, no step-time forecast."
    assert "s/step" not in format_plan(asked)


def test_plan_prints_and_writes_the_table(capsys):
    argv = ["plan", "--profile", "klein-9b-1024", "--gpu", "rtx4060ti-16g", "--gpu", "rtx4060ti-16g",
            "--grad-accum", "4", "--base-compute", "auto"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    table = text.split("layouts weighed (* the plan above):\n", 1)[1]
    assert "* 2 replicas " in table and "  split over 2 GPUs " in table and "  one card (rtx4060ti-16g) " in table
    assert "replica 1: rtx4060ti-16g" in text and "replicas: 2 in one process, micro-batches per step 2/2" in text
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["chosen"] for r in data["layouts"]] == [False, True, False]
    assert data["shares"] == [2, 2] and len(data["replicas"]) == 2 and data["runs_as"] == "one process"
    assert main(argv + ["--replicas", "3"]) == 2
    assert "--replicas 3: 2 device(s) do not divide into 3 replicas; set --replicas 0 to let the planner choose, " \
        "or --replicas 1 for one copy over every device" in capsys.readouterr().err


def test_the_split_with_swap_is_forecast_as_it_runs():
    """A split that swaps runs its micro-batches one after another (`best_schedule`), and its forecast says so."""
    plan = planned("klein-9b-1024", ["rtx3060", "rtx3060"], 4, replicas=1, base_compute="bf16")
    assert plan.offloaded_blocks and plan.schedule == "sequential"
    assert plan.predicted_step_s == plan.step_s["sequential"][3]

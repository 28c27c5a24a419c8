"""One forecast for one set of settings: `plan`, `doctor`, the demo's plan_report.txt and the Partition
Planner node print the same plan, every speed line says what it assumes, and a CPU run says it is one
instead of forecasting 0.00 s/step."""
from pathlib import Path

import pytest

from support.pack_nodes import pack_nodes
from ugpum.commands import main
from ugpum.commands.demo import klein_report
from ugpum.commands.doctor import plan_info

PACK = Path(__file__).resolve().parents[2]
RIG = "1x RTX 4090 (24 GiB, PCIe 4 x16)"


def plan_cli(argv: list[str], capsys) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out.strip()


def report_section(report: str, title: str) -> str:
    head = f"=== profile klein-9b-1024 (flux2-klein-base-9b) on {title} ===\n"
    assert head in report, report[:400]
    return report.split(head, 1)[1].split("\n=== ", 1)[0].strip()


def test_plan_doctor_and_the_demo_report_agree_for_the_profile(capsys):
    by_plan = plan_cli(["--profile", "klein-9b-1024", "--gpu", "rtx4090"], capsys)
    by_doctor = next(r for r in plan_info("klein-9b-1024")["rigs"] if r["rig"] == RIG)["text"].strip()
    by_demo = report_section(klein_report(), RIG)
    assert by_plan == by_doctor == by_demo
    # and the flags that spell the profile out give the same plan
    spelled = plan_cli(["--model", "flux2-klein-base-9b", "--gpu", "rtx4090", "--resolution", "1024", "--rank", "16",
                        "--grad-accum", "1", "--compile", "auto", "--dtype", "bf16"], capsys)
    assert spelled == by_plan
    assert ("predicted: " in by_plan and "(compiled blocks, bf16 weights, base compute bf16, 1 micro-batch of "
            "batch 1 per step, 1024x1024, rank 16)" in by_plan)


def test_the_node_prints_the_same_plan(comfy, capsys):
    from ugpum.arch import get_spec
    planner, types = pack_nodes()
    spec = get_spec("flux2-klein-base-9b")
    model = types.UGPUMModel(family="flux2", model_id=spec.id, title=spec.title, path="/nowhere.safetensors",
                             file_name="nowhere.safetensors", key_prefix="", stored_dtype="bf16", weight_dtype="bf16",
                             devices=("rtx4090",), spec=spec)
    output = planner.PartitionPlanner.execute(model, resolution=1024, batch=1, grad_accum=4, rank=16,
                                              recompute="auto")
    by_node = output.result[1].strip()
    by_plan = plan_cli(["--profile", "klein-9b-1024", "--gpu", "rtx4090", "--grad-accum", "4"], capsys)
    assert by_node == by_plan and "4 micro-batches of batch 1 per step" in by_node


def test_each_assumption_is_named_and_changes_the_forecast(capsys):
    def predicted(text: str) -> str:
        return next(line for line in text.splitlines() if line.startswith("predicted: "))
    base = ["--model", "flux2-klein-base-9b", "--gpu", "rtx4090"]
    compiled = predicted(plan_cli(base, capsys))
    eager = predicted(plan_cli(base + ["--compile", "off"], capsys))
    accum = predicted(plan_cli(base + ["--grad-accum", "4"], capsys))
    fp8 = predicted(plan_cli(base + ["--base-compute", "fp8"], capsys))
    assert "compiled blocks" in compiled and "eager blocks (compile off)" in eager
    assert "4 micro-batches of batch 1 per step" in accum and "fp8 weights, base compute fp8" in fp8
    seconds = [float(line.split()[1]) for line in (compiled, eager, accum, fp8)]
    assert seconds[1] > seconds[0] and seconds[2] == pytest.approx(4 * seconds[0], rel=0.01) and seconds[3] < seconds[0]


def test_a_cpu_run_says_so_instead_of_zero_seconds(capsys):
    out = plan_cli(["--model", "tiny-flux2", "--gpu", "cpu"], capsys)
    assert "CPU run: no step-time forecast" in out and "A CPU run (cpu)" in out
    assert " s/step" not in out


def test_plan_checks_settings_as_train_does(capsys):
    assert main(["plan", "--model", "flux2-klein-base-9b", "--gpu", "rtx4090", "--rank", "0"]) == 2
    assert "setting 'rank' = 0" in capsys.readouterr().err
    assert main(["plan", "--gpu", "rtx4090"]) == 2
    assert "give --model ID|FILE, --profile NAME or --config FILE.toml" in capsys.readouterr().err

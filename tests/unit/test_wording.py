"""The core names the setting to change; each front end words it its own way: the command line as the
verb's flag, the nodes as the input on the node the user sees (issue 22, item 4)."""
from pathlib import Path

import pytest

from support.pack_nodes import pack_nodes
from ugpum.arch import Workload, get_spec
from ugpum.commands import main
from ugpum.planning.devices import resolve_devices
from ugpum.planning.plan import PlanError, plan_training
from ugpum.wording import for_cli, for_nodes, plain, setting

REPO = Path(__file__).resolve().parents[2]


def test_a_mark_reads_as_a_flag_a_config_key_or_a_node_input():
    text = f"use fp8 weights ({setting('weight_dtype', 'fp8')}) or recompute ({setting('recompute', 'all')})"
    assert plain(text) == "use fp8 weights (weight_dtype = fp8) or recompute (recompute = all)"
    assert for_cli(text, "plan") == "use fp8 weights (--dtype fp8) or recompute (--recompute all)"
    assert for_cli(text, "train") == ("use fp8 weights (weight_dtype = fp8 in the --config TOML) or recompute "
                                      "(recompute = all in the --config TOML)")
    assert for_nodes(text) == ("use fp8 weights (weight_dtype = fp8 on the UGPUM Loader) or recompute "
                               "(recompute = all on the Partition Planner)")


def too_small() -> str:
    spec = get_spec("flux2-klein-9b")
    w = Workload(width=2048, height=2048, frames=1, batch=4, rank=16, recompute="all", held_dtype="bf16")
    with pytest.raises(PlanError) as failed:
        plan_training(spec, resolve_devices(["10GiB"], spec, probe=False), w)
    return str(failed.value)


def test_the_planners_advice_names_settings_not_flags():
    message = too_small()
    assert "{setting:" in message and "--" not in message                 # the core words no flag
    assert "(--resolution 512)" in for_cli(message, "plan") and "{setting:" not in for_cli(message, "plan")
    assert "(resolution = 512 in the --config TOML)" in for_cli(message, "train")
    nodes = for_nodes(message)
    assert "(resolution = 512 on the Partition Planner)" in nodes and "--" not in nodes and "{setting:" not in nodes


def test_the_cli_prints_flags(capsys):
    assert main(["plan", "--model", "flux2-klein-9b", "--gpu", "10GiB", "--resolution", "2048", "--batch", "4"]) == 2
    said = capsys.readouterr().err
    assert "(--resolution 512)" in said and "{setting:" not in said


def test_the_planner_node_names_its_inputs(comfy):
    planner, types = pack_nodes()
    from ugpum_pack_nodes.errors import UGPUMError
    spec = get_spec("flux2-klein-9b")
    model = types.UGPUMModel(family="flux2", model_id=spec.id, title=spec.title, path="/nowhere.safetensors",
                             file_name="nowhere.safetensors", key_prefix="", stored_dtype="bf16", weight_dtype="bf16",
                             devices=("10GiB",), spec=spec)
    with pytest.raises(UGPUMError) as failed:
        planner.PartitionPlanner.execute(model, resolution=2048, batch=4, grad_accum=1, rank=16, recompute="auto")
    said = str(failed.value)
    assert "resolution = 512 on the Partition Planner" in said and "--" not in said and "{setting:" not in said


def test_the_run_marks_read_as_flags_on_the_command_line_and_as_the_trainers_inputs_on_the_nodes():
    out = "/runs/me"
    text = (f"continue with {setting('resume', out)}; the same command (without {setting('resume')}); replace it "
            f"({setting('overwrite')}); {setting('distributed')} also takes zero-bubble; batch ({setting('batch')}), "
            f"frames ({setting('frames', 17)})")
    assert for_cli(text, "train") == ("continue with --resume /runs/me; the same command (without --resume); replace "
                                      "it (--overwrite); --distributed also takes zero-bubble; batch (--batch), "
                                      "frames (--frames 17)")
    assert for_cli(text, "plan").startswith("continue with resume = /runs/me; the same command (without resume); "
                                            "replace it (overwrite); --distributed also takes")
    assert for_nodes(text) == (
        "continue with resume on the LoRA Trainer (same save name); the same command (without resume on the LoRA "
        "Trainer); replace it (not on the LoRA Trainer, which keeps every run: give a new save name); the command "
        "line's distributed mode also takes zero-bubble; batch (batch on the Partition Planner), frames (frames = 17 "
        "on the Partition Planner)")
    assert plain(text) == ("continue with resume = /runs/me; the same command (without resume); replace it "
                           "(overwrite); distributed also takes zero-bubble; batch (batch), frames (frames = 17)")


@pytest.mark.parametrize("folder", ["runs/a {b}", "runs/{setting:steps}", "runs/50% {x=1}", "runs/%7B%25}",
                                    "C:\\runs\\{1}"])
def test_a_value_with_braces_or_percent_signs_reads_as_given(folder):
    """A value is user input (a folder): its braces do not end the mark, nor read as a mark of their own."""
    text = f"{setting('resume', folder)}: no intact checkpoint; {setting('steps', 600)}"
    assert for_cli(text, "train") == f"--resume {folder}: no intact checkpoint; --steps 600"
    assert for_nodes(text) == ("resume on the LoRA Trainer (same save name): no intact checkpoint; steps = 600 on "
                               "the LoRA Trainer")
    assert plain(text) == f"resume = {folder}: no intact checkpoint; steps = 600"


def finished_run(out) -> str:
    """The message a resume of a finished 300-step run gives (ugpum.train.run.folder.resume_point), from a run
    folder holding that run's last checkpoint and LoRA."""
    import json

    import torch
    from safetensors.torch import save_file
    from ugpum.train.config import load_config
    from ugpum.train.run.folder import RunFinished, resume_point
    cfg = load_config("tiny-flux2", overrides={"steps": 300})
    identity = {"config": {}, "model": {}, "dataset_hash": "same", "lora_shapes": {}}
    folder = out / "checkpoints" / "step_000300"
    folder.mkdir(parents=True)
    save_file({"block.A": torch.zeros(2, 2)}, str(folder / "lora.safetensors"))
    save_file({"block.A::exp_avg": torch.zeros(2, 2)}, str(folder / "optimizer.safetensors"))
    (folder / "state.json").write_text(json.dumps({"step": 300, "identity": identity}))
    save_file({"block.A": torch.zeros(2, 2)}, str(out / f"{cfg.output_name}.safetensors"))
    with pytest.raises(RunFinished) as finished:
        resume_point(out, cfg, identity, log=lambda text: None)
    return str(finished.value)


def test_a_finished_run_says_steps_as_the_front_end_does(tmp_path):
    """What said 'use --steps 600' on the node too: the command line says --resume DIR and --steps 600,
    the node its inputs, with no flag; a folder with braces and spaces reads as it is."""
    out = tmp_path / "my run {2}"
    message = finished_run(out)
    assert "--" not in message and "{setting:steps=600}" in message
    cli = for_cli(message, "train")
    assert cli.startswith(f"--resume {out}: the run is finished (300 of 300 steps trained") and \
        cli.endswith("resume with a new total, --steps 600 for instance")
    nodes = for_nodes(message)
    assert nodes.startswith("resume on the LoRA Trainer (same save name): the run is finished")
    assert "steps = 600 on the LoRA Trainer" in nodes and "--" not in nodes and "{setting:" not in nodes


def test_an_earlier_run_is_continued_or_replaced_on_the_command_line_and_never_replaced_by_the_nodes(tmp_path):
    from ugpum.train.config import load_config
    from ugpum.train.errors import RunExists
    from ugpum.train.run.folder import open_run
    cfg = load_config("tiny-flux2", overrides={"dataset": str(REPO / "demo_datasets" / "loranne")})
    out = tmp_path / "run"
    out.mkdir()
    (out / f"{cfg.output_name}.safetensors").write_bytes(b"")
    with pytest.raises(RunExists) as held:
        open_run(cfg, get_spec(cfg.model), out, resume=False, overwrite=False, log=lambda text: None)
    assert for_cli(str(held.value), "train") == (f"{out} holds an earlier run ({cfg.output_name}.safetensors); "
                                                 f"continue it with --resume {out}, train into another folder, "
                                                 "or replace it (--overwrite)")
    nodes = for_nodes(str(held.value))
    assert "continue it with resume on the LoRA Trainer (same save name)" in nodes and "give a new save name" in nodes
    assert "--" not in nodes


def test_every_engine_error_has_the_one_base_and_keeps_its_builtin_one():
    from ugpum.arch import UnknownModel
    from ugpum.compute.base_compute import BaseComputeError
    from ugpum.planning.devices import DeviceError
    from ugpum.folders import FolderError
    from ugpum.formats.disk_space import DiskFull
    from ugpum.formats.finite import NonFinite
    from ugpum.formats.lora_file import LoraFileError
    from ugpum.formats.safetensors_header import HeaderError
    from ugpum.catalog.models import UnknownName
    from ugpum.placement.stream_load import CheckpointMismatch
    from ugpum.train.run.checkpoint import CheckpointError
    from ugpum.train.config import ConfigError
    from ugpum.train.errors import DatasetError, TrainingError
    from ugpum.wording import EngineError
    builtin = {UnknownModel: ValueError, BaseComputeError: RuntimeError, DeviceError: ValueError,
               FolderError: ValueError, DiskFull: OSError, NonFinite: ValueError, LoraFileError: ValueError,
               HeaderError: ValueError, UnknownName: ValueError, CheckpointMismatch: ValueError,
               CheckpointError: ValueError, ConfigError: ValueError, DatasetError: ValueError,
               TrainingError: RuntimeError, PlanError: ValueError}
    for error, base in builtin.items():
        assert issubclass(error, EngineError) and issubclass(error, base), error.__name__
    full = DiskFull("the LoRA needs 12.0 MiB and 1.0 MiB is free")
    assert str(full) == "the LoRA needs 12.0 MiB and 1.0 MiB is free" and full.errno == 28


def test_the_trainer_node_words_an_engine_error_without_flags(comfy, tmp_path):
    pack_nodes()
    from ugpum_pack_nodes.errors import UGPUMError, user_errors
    message = finished_run(tmp_path / "run")
    from ugpum.train.run.folder import RunFinished
    with pytest.raises(UGPUMError) as failed, user_errors("LoRA Trainer"):
        raise RunFinished(message)
    said = str(failed.value)
    assert said.startswith("LoRA Trainer: resume on the LoRA Trainer (same save name): the run is finished")
    assert "steps = 600 on the LoRA Trainer for instance." in said and "--" not in said


def test_a_library_callers_default_log_names_settings_plainly(capsys):
    from ugpum.train.loop import print_plain
    print_plain(f"continue with {setting('resume', '/runs/a {1}')}")
    assert capsys.readouterr().out == "continue with resume = /runs/a {1}\n"

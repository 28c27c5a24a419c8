"""The core names the setting to change; each front end words it its own way: the command line as the
verb's flag, the nodes as the input on the node the user sees (issue 22, item 4)."""
import pytest

from support.pack_nodes import pack_nodes
from ugpum.arch import Workload, get_spec
from ugpum.commands import main
from ugpum.devices import resolve_devices
from ugpum.plan import PlanError, plan_training
from ugpum.wording import for_cli, for_nodes, plain, setting


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

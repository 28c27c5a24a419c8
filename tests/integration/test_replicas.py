"""Replicas in one process (issue 40) on the CPU: two devices as replicas train the LoRA one device trains
with the same global batch, bit for bit (the gradients are added in one device's order); a resumed replica
run continues bit for bit; replicas that swap share one host copy of the blocks; splits x replicas train it
within float tolerance; the command line runs them."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfy_bridge import build_dit, build_meta, find_comfyui, init_random
from support.cli_run import train as cli_train
from support.swap_cap import swap_forcing_cap_gib
from ugpum.arch import get_spec
from ugpum.commands.train import run_training as train
from ugpum.planning.devices import host_device
from ugpum.planning.plan import GIB
from ugpum.planning.space import best_plan
from ugpum.train.config import load_config
from ugpum.train.replicas import place_replicas

pytestmark = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")
DATASET = Path(__file__).resolve().parents[2] / "demo_datasets" / "loranne"
QUIET = dict(log=lambda *a: None)


def cfg(**kw):
    base = dict(dataset=str(DATASET), devices=["cpu"], trigger="loranne", sample_every=0, steps=3)
    base.update(kw)
    return load_config("tiny-flux2", overrides=base)


def assert_same_lora(a_path, b_path, exact: bool = True):
    a, b = load_file(str(a_path)), load_file(str(b_path))
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)     # (AdamW magnifies the last bits)


@pytest.mark.parametrize("grad_accum", [4, 3])
def test_two_cpu_replicas_train_the_one_device_lora_bit_for_bit(tmp_path, grad_accum):
    one = train(cfg(grad_accum=grad_accum), tmp_path / "one", **QUIET)
    two = train(cfg(grad_accum=grad_accum, devices=["cpu", "cpu"], replicas=2), tmp_path / "two", **QUIET)
    assert len(two.plan.replicas) == 2 and two.plan.shares == ([2, 2] if grad_accum == 4 else [2, 1])
    assert two.losses == one.losses and two.validation_after == one.validation_after
    assert_same_lora(one.lora_path, two.lora_path)
    recorded = json.loads((tmp_path / "two" / "plan.json").read_text())
    assert len(recorded["replicas"]) == 2 and recorded["shares"] == two.plan.shares


def test_a_resumed_replica_run_continues_bit_for_bit(tmp_path):
    settings = dict(steps=4, grad_accum=2, devices=["cpu", "cpu"], replicas=2)
    straight = train(cfg(**settings), tmp_path / "straight", **QUIET)
    for name, again in (("replicas", settings), ("one device", dict(settings, devices=["cpu"], replicas=1))):
        calls = {"n": 0}

        def stop_at_step_2():
            calls["n"] += 1
            if calls["n"] > 2:
                raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            train(cfg(**settings), tmp_path / name, check_interrupt=stop_at_step_2, **QUIET)
        resumed = train(cfg(**again), tmp_path / name, resume=True, **QUIET)      # (the same checkpoint format)
        assert resumed.resumed_at == 2 and resumed.steps_done == 4
        assert_same_lora(straight.lora_path, resumed.lora_path)


def tiny_file(folder: Path) -> Path:
    """tiny-flux2's weights in a file, so that the runs stream it from there (the meta path the nodes take)."""
    module = build_meta(get_spec("tiny-flux2"), torch.float32).to_empty(device="cpu")
    init_random(module, 3)
    path = folder / "tiny-flux2.safetensors"
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    return path


def swapping_replicas(config):
    """Two CPU "devices" each capped so that its replica swaps some of the blocks."""
    spec = get_spec(config.model)
    cap = swap_forcing_cap_gib(config.workload())
    capped = dataclasses.replace(host_device(), total_bytes=int(cap * GIB), free_bytes=int(cap * GIB))
    plan = best_plan(spec, [capped, capped], config.workload(), config.grad_accum, replicas=2)
    assert all(0 < len(p.offloaded_blocks) < len(spec.blocks) for p in plan.replicas)
    return plan


def test_replicas_that_swap_share_one_host_copy_and_train_the_one_device_lora(tmp_path):
    path = tiny_file(tmp_path)
    config = cfg(grad_accum=2, model_file=str(path))
    plan = swapping_replicas(config)
    model, prefix = build_dit(get_spec(config.model), torch.float32, str(path))
    replicas = place_replicas(config, get_spec(config.model), plan, model, prefix, lambda *a: None)
    try:
        [first], [second] = (r.swaps for r in replicas)
        assert [b.path for b in first.blocks] == [b.path for b in second.blocks]
        assert all(a.host is b.host and a.owns_host and not b.owns_host for a, b in zip(first.blocks, second.blocks))
        assert all(p.is_meta is False for r in replicas for p in r.model.parameters())
    finally:
        for r in reversed(replicas):
            r.release()
    one = train(cfg(grad_accum=2, model_file=str(path)), tmp_path / "one", **QUIET)
    two = train(cfg(grad_accum=2, model_file=str(path)), tmp_path / "two", plan=plan, **QUIET)
    assert two.plan is plan and two.losses == one.losses
    assert_same_lora(one.lora_path, two.lora_path)


def test_splits_times_replicas_train_the_lora_within_float_tolerance(tmp_path):
    one = train(cfg(steps=2, grad_accum=4), tmp_path / "one", **QUIET)
    mixed = train(cfg(steps=2, grad_accum=4, devices=["cpu"] * 4, replicas=2), tmp_path / "mixed", **QUIET)
    assert [len(p.stages) for p in mixed.plan.replicas] == [2, 2]
    assert mixed.losses == pytest.approx(one.losses, rel=1e-6)
    assert_same_lora(one.lora_path, mixed.lora_path, exact=False)


def test_the_command_line_trains_replicas(tmp_path):
    args = ["--profile", "tiny-flux2", "--dataset", str(DATASET), "--steps", "2", "--grad-accum", "2",
            "--sample-every", "0"]
    rc, text = cli_train(*args, "--devices", "cpu,cpu", "--replicas", "2", "--out", str(tmp_path / "two"))
    assert rc == 0, text
    assert "A CPU run (cpu, cpu) as 2 replicas" in text and "replicas: 2 in one process" in text
    rc, text = cli_train(*args, "--devices", "cpu", "--out", str(tmp_path / "one"))
    assert rc == 0, text
    assert_same_lora(tmp_path / "one" / "ugpum_lora.safetensors", tmp_path / "two" / "ugpum_lora.safetensors")
    rc, text = cli_train(*args, "--devices", "cpu,cpu", "--replicas", "3", "--out", str(tmp_path / "three"))
    assert rc == 2 and "--replicas 3: 2 device(s) do not divide into 3 replicas" in text, text


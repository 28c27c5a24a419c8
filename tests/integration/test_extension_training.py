"""Issue 37, done when: a tiny training run on the CPU picks up a compute mode added as one file and a model
family added as one folder (in a temporary copy of the pack: tests/support/extension_copy.py; the plan and
the nodes: tests/unit/test_extension_points.py)."""
from __future__ import annotations

import json

from safetensors import safe_open

from support.extension_copy import NEW_MODE, NEW_MODEL, REPO, extended_copy, imported_from


def test_a_tiny_run_trains_the_new_family_in_the_new_mode(tmp_path, capsys):
    pack = extended_copy(tmp_path / "pack")
    config = tmp_path / "toy.toml"
    config.write_text("\n".join([
        "[train]", f'model = "{NEW_MODEL}"', f'base_compute = "{NEW_MODE}"',
        f'dataset = "{REPO / "demo_datasets" / "loranne"}"', 'devices = ["cpu"]', "resolution = 64", "rank = 4",
        "alpha = 4.0", "steps = 2", "lr = 1e-2", "sample_every = 0", 'weight_dtype = "fp32"', "autocast = false",
        "stand_in_encoders = true", 'timesteps = "logit_normal"']) + "\n")
    out = tmp_path / "run"
    with imported_from(pack):
        from ugpum.commands import main
        assert main(["train", "--config", str(config), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"base_compute={NEW_MODE}: 12 frozen Linears" in said              # 1 double block's 8, 2 singles' 2 each
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model"] == NEW_MODEL and plan["base_compute"] == NEW_MODE
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    with safe_open(str(out / "ugpum_lora.safetensors"), "pt") as lora:
        assert lora.metadata()["modelspec.architecture"] == "Toy-tiny/lora"

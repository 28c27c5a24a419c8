"""docs/train_config_example.toml: loads as `train --config` loads it, names every TrainConfig setting,
and states each one's true default (so the documentation cannot drift from the code)."""
import dataclasses
import re
from pathlib import Path

from ugpum.train.config import TrainConfig, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "train_config_example.toml"
NOT_IN_FILES = {"dataset_root"}          # set by the nodes, never by a file


def test_the_example_loads_to_the_defaults():
    loaded = load_config(toml_file=EXAMPLE)
    assert loaded == TrainConfig().validate()


def test_every_setting_is_in_the_example():
    text = EXAMPLE.read_text()
    named = set(re.findall(r"^#?\s*([a-z_]+)\s*(?:=|#|$)", text, re.M))
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert fields - named == set(), f"settings missing from {EXAMPLE.name}: {sorted(fields - named)}"
    for name in NOT_IN_FILES:
        assert re.search(rf"^# {name}\b", text, re.M), name

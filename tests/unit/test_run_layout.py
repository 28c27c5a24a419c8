"""The run folder's layout, as ugpum/train/run/layout.py names it (the files themselves are written by the
tiny trainings of tests/integration/)."""
from pathlib import Path

from ugpum.train.run.layout import RunFolder


def test_the_feature_cache_lives_in_the_run_folder_unless_cache_dir_is_set(tmp_path):
    assert RunFolder(tmp_path).cache == tmp_path / "cache"
    assert RunFolder(tmp_path, "").cache == tmp_path / "cache"            # an empty setting is unset, not "."
    assert RunFolder(tmp_path, str(tmp_path / "elsewhere")).cache == tmp_path / "elsewhere"


def test_a_run_folder_lists_its_loras_and_what_replacing_a_run_removes(tmp_path):
    run = RunFolder(str(tmp_path))
    for name in ("mine.safetensors", "mine_step10.safetensors", "other.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in run.loras("mine")] == ["mine.safetensors", "mine_step10.safetensors"]
    assert run.sample(7) == tmp_path / "samples" / "step_00007.png"
    assert set(run.run_files()) == {run.metrics, run.checkpoints, run.plan, run.samples}
    assert isinstance(run.root, Path) and run.lock.parent == tmp_path

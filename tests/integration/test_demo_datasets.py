"""Tests for the synthetic demo datasets made by scripts/make_demo_datasets.py.

The full regeneration + sha256 check takes about 5 s on one CPU core.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_demo_datasets.py"
DATA = REPO / "demo_datasets"
TRIGGERS = ("loranne", "rolwayne")


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_committed_files_match_regeneration():
    r = _run("--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout


@pytest.mark.parametrize("trigger", TRIGGERS)
def test_images_and_captions(trigger):
    images = sorted((DATA / trigger).glob("*.jpg"))
    assert [p.stem for p in images] == [f"{trigger}_{i:02d}" for i in range(1, 11)]
    for img_path in images:
        with Image.open(img_path) as im:
            assert im.format == "JPEG"
            assert im.size == (1024, 1024), img_path
            assert im.mode == "RGB"
        caption = img_path.with_suffix(".txt").read_text(encoding="utf-8").strip()
        assert caption.startswith(trigger + ", "), (img_path, caption)
        assert len(caption) > len(trigger) + 20
    captions = {p.with_suffix(".txt").read_text(encoding="utf-8") for p in images}
    assert len(captions) == len(images), "captions should differ between images"


def test_check_detects_changed_and_missing_files(tmp_path):
    for trigger in TRIGGERS:
        (tmp_path / trigger).mkdir()
    for stem in ("loranne_01", "loranne_02"):
        for ext in (".jpg", ".txt"):
            shutil.copy(DATA / "loranne" / (stem + ext), tmp_path / "loranne" / (stem + ext))
    only = "--only=loranne_01,loranne_02,rolwayne_01"

    # loranne_* copied unchanged, rolwayne_01 missing
    r = _run("--check", "--out", str(tmp_path), only)
    assert r.returncode == 1, r.stdout
    assert "MISSING  rolwayne/rolwayne_01.jpg" in r.stdout
    assert "loranne_01" not in r.stdout

    # an edited caption and a changed pixel are both caught
    cap = tmp_path / "loranne" / "loranne_01.txt"
    cap.write_text(cap.read_text(encoding="utf-8").replace("loranne", "someone", 1), encoding="utf-8")
    img = tmp_path / "loranne" / "loranne_02.jpg"
    with Image.open(img) as im:
        im = im.copy()
    im.putpixel((10, 10), (255, 0, 255))
    im.save(img, quality=90)
    r = _run("--check", "--out", str(tmp_path), "--only=loranne_01,loranne_02")
    assert r.returncode == 1, r.stdout
    assert "MISMATCH loranne/loranne_01.txt" in r.stdout
    assert "MISMATCH loranne/loranne_02.jpg" in r.stdout

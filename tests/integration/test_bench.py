"""The GPU session's parts on the CPU with a tiny model, in child processes as bench/session.sh runs them: a
random-weight file in a real layout (bench/model_files.py), `python -m ugpum train` on it through bench/cards.py
(its case row and speed row), bench/profile_steps.py around that run (a kernel table by op class), and
bench/gradient_cosine.py (each 8-bit mode's LoRA gradients against the exact base's, emulated on the CPU)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.bench_run import run_bench  # noqa: E402
from ugpum.arch import get_spec, recognise  # noqa: E402
from ugpum.compute.modes import MODES  # noqa: E402


def test_a_written_fp8_file_trains_through_the_cli_under_the_profiler(tmp_path):
    dit = tmp_path / "dev_fp8.safetensors"
    written = run_bench("model_files", ["dit", "--model", "tiny-flux2-dev", "--dtype", "fp8", "--path", str(dit)],
                        via_cli=True)
    assert written.returncode == 0, written.stderr[-3000:]
    spec, prefix, stored = recognise(dit)
    assert (spec.id, prefix, stored) == ("tiny-flux2-dev", "model.diffusion_model.", "fp8")

    rows, speed, table = tmp_path / "cases.jsonl", tmp_path / "speed.jsonl", tmp_path / "prof" / "tiny"
    done = run_bench("profile_steps", ["--out", str(table), "--skip", "2", "--active", "2", "--",
                                       "bench/cards.py", "--model-file", str(dit), "--steps", "5", "--resolution", "64",
                                       "--compile", "off", "--rows", str(rows), "--speed-rows", str(speed),
                                       "--work", str(tmp_path / "work"), "--label", "tiny-dev", "--call", "cpu"],
                     threads=1)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in rows.read_text().splitlines()]
    assert (row["label"], row["model"], row["rc"], row["steps"], row["recompute"]) == ("tiny-dev", spec.id, 0, 5, "all")
    assert row["forecast_gib"] > 0 and row["comfyui"] and row["validation_after"] is not None
    (speed_row,) = [json.loads(line) for line in speed.read_text().splitlines()]
    assert speed_row["impl"] == "ugpum_cli" and speed_row["s_per_step"] > 0 and speed_row["call"] == "cpu"

    summary = json.loads(table.with_suffix(".json").read_text())
    assert summary["device"] == "cpu" and summary["steps"] == 2 and summary["by_class_ms_per_step"]["matmul"] > 0
    assert not any(k["name"].startswith(("ProfilerStep", "## ")) for k in summary["top_kernels"])
    assert "| matmul |" in table.with_suffix(".txt").read_text()


def test_the_gradient_cosine_bench_compares_each_8bit_mode_with_the_exact_base_on_the_cpu(tmp_path):
    rows = tmp_path / "cosine.jsonl"
    done = run_bench("gradient_cosine", ["--profile", "tiny-flux2", "--device", "cpu", "--rows", str(rows)], threads=1)
    assert done.returncode == 0, done.stderr[-3000:]
    found = [json.loads(line) for line in rows.read_text().splitlines()]
    blocks = [b.path for b in get_spec("tiny-flux2").blocks]
    picks = list(dict.fromkeys([blocks[0], blocks[len(blocks) // 2], blocks[-1]]))
    quantising = [m.name for m in MODES if m.quantises]
    assert [(r["block"], r["mode"]) for r in found] == [(b, m) for b in picks for m in quantising]
    assert all(r["model"] == "tiny-flux2" and r["emulated"] and r["device"] == "cpu" for r in found)
    # the emulated 8-bit numerics stay close to the exact base, but the switch changes the gradients
    assert all(0.9 < r["cosine_vs_bf16"] <= 1.0 and r["rel_norm_error"] > 0 for r in found), found
    assert sum("(emulated): cosine vs bf16" in line for line in done.stdout.splitlines()) == len(found)

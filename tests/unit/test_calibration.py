"""The planner against the GPU runs it was fitted to and checked by (issue 29): every recorded row's peak
reserved memory and s/step within 5 % of the forecast for the blocks it kept and swapped, its host peak
within 10 %; and each measured coefficient carries weight: dropped, some row leaves its bound."""
from __future__ import annotations

import copy

import pytest

from support import recorded_forecasts as recorded
from ugpum.compute.modes import mode_named
from ugpum.planning import cost


def worst(key: str) -> float:
    return max(abs(recorded.compare(row)[key]) for row in recorded.rows())


def test_there_are_rows_of_both_families_kept_swapped_and_recomputed():
    rows = [recorded.compare(r) | {"model": r["model"]} for r in recorded.rows()]
    assert {r["model"].split("-")[0] for r in rows} >= {"flux2", "wan2.1"}
    assert any(r["kept"] == 0 for r in rows) or any(0 < r["kept"] < 32 for r in rows)
    assert len(rows) >= 6


def test_every_row_is_within_its_bounds():
    for row in recorded.rows():
        c = recorded.compare(row)
        assert abs(c["gib_error"]) <= recorded.MEMORY_LIMIT, c
        assert abs(c["s_error"]) <= recorded.TIME_LIMIT, c
        assert abs(c["host_error"]) <= recorded.HOST_LIMIT, c


@pytest.mark.parametrize("path, key", [
    (("memory", "flux2", "compiled", "kept", "double"), "gib_error"),
    (("memory", "flux2", "compiled", "kept", "single"), "gib_error"),
    (("memory", "flux2", "eager", "kept", "single"), "gib_error"),
    (("memory", "wan", "compiled", "kept", "wan"), "gib_error"),
    (("memory", "allocator", "flux2"), "gib_error"),
    (("host", "flux2"), "host_error"),
    (("host", "wan"), "host_error"),
])
def test_a_dropped_coefficient_shows(monkeypatch, path, key):
    changed = copy.deepcopy(cost.CALIBRATION)
    inner = changed
    for part in path[:-1]:
        inner = inner[part]
    limit = {"gib_error": recorded.MEMORY_LIMIT, "s_error": recorded.TIME_LIMIT, "host_error": recorded.HOST_LIMIT}[key]
    assert worst(key) <= limit
    inner[path[-1]] = 0 if key != "s_error" else 1.0       # (a dense speed of 1: fp8 as fast as bf16)
    monkeypatch.setattr(cost, "CALIBRATION", changed)
    assert worst(key) > limit, path


def test_a_dropped_speed_factor_of_a_mode_shows(monkeypatch):
    """The fp8 mode's own speed factor (ugpum/compute/modes/fp8.py) carries weight: at bf16's, some row leaves its bound."""
    assert worst("s_error") <= recorded.TIME_LIMIT
    monkeypatch.setattr(mode_named("fp8"), "dense_speed", {"compiled": 1.0, "eager": 1.0})
    assert worst("s_error") > recorded.TIME_LIMIT

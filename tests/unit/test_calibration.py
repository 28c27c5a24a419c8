"""The planner against the GPU runs it was fitted to and checked by (issue 29): every recorded row's peak
reserved memory and s/step within 5 % of the forecast for the blocks it kept and swapped, its host peak
within 10 %; and each measured coefficient carries weight: dropped, some row leaves its bound."""
from __future__ import annotations

import copy

import pytest

from support import recorded_forecasts as recorded
from ugpum.arch import family_named
from ugpum.compute.modes import mode_named


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


@pytest.mark.parametrize("family, path, key", [
    ("flux2", ("memory", "compiled", "kept", "double"), "gib_error"),
    ("flux2", ("memory", "compiled", "kept", "single"), "gib_error"),
    ("flux2", ("memory", "eager", "kept", "single"), "gib_error"),
    ("wan", ("memory", "compiled", "kept", "wan"), "gib_error"),
    ("flux2", ("allocator",), "gib_error"),
    ("flux2", ("host_gib",), "host_error"),
    ("wan", ("host_gib",), "host_error"),
])
def test_a_dropped_coefficient_of_a_family_shows(monkeypatch, family, path, key):
    """Each family's own rows (ugpum/arch/<family>/calibration.json) carry weight."""
    inner = family_named(family).calibration
    for part in path[:-1]:
        inner = inner[part]
    limit = {"gib_error": recorded.MEMORY_LIMIT, "s_error": recorded.TIME_LIMIT, "host_error": recorded.HOST_LIMIT}[key]
    assert worst(key) <= limit
    monkeypatch.setitem(inner, path[-1], 0)
    assert worst(key) > limit, (family, path)


def test_a_dropped_speed_factor_of_a_mode_shows(monkeypatch):
    """The fp8 mode's own speed factor (ugpum/compute/modes/fp8.py) carries weight: at bf16's, some row
    leaves its bound."""
    assert worst("s_error") <= recorded.TIME_LIMIT
    monkeypatch.setattr(mode_named("fp8"), "dense_speed", {"compiled": 1.0, "eager": 1.0})
    assert worst("s_error") > recorded.TIME_LIMIT

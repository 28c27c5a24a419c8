"""The forecast tables of README.md and docs/planner.md are what the planner says now (issue 29, item 6):
`scripts/forecast_tables.py`'s rendering leaves both files as they are, and changes a table whose number
was edited."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tables():
    spec = importlib.util.spec_from_file_location("forecast_tables", ROOT / "scripts" / "forecast_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tables_match_the_planner_and_a_changed_cell_is_caught():
    script = tables()
    for name in script.FILES:
        text = (ROOT / name).read_text()
        assert "<!-- forecast-table " in text and script.render(text) == text, f"{name}: python scripts/forecast_tables.py"
    readme = (ROOT / "README.md").read_text()
    cell = readme.index(" s, ", readme.index("<!-- forecast-table cards -->"))
    edited = readme[:cell - 1] + ("9" if readme[cell - 1] != "9" else "8") + readme[cell:]
    assert script.render(edited) == readme

"""The test tiers, by each test's own time (tests/timings.json), not by the folder it lives in.

`quick`: recorded under a second, and sharing no module- or session-wide fixture of this suite with a
test that is not quick (such a fixture is set up once, in the tier that needs it anyway); a test without
a recorded time is quick in tests/unit and not elsewhere. `slow`: recorded at half a minute or more. A
test starting a ComfyUI server is never quick. scripts/test.sh runs the quick tier first, then the rest
on two workers, files with the longest recorded time first so the two workers finish together.

`UGPUM_RECORD_TEST_TIMES=tests/timings.json` records each test's time (setup + call + teardown, in
seconds) into that file, merged with what it holds; `expected_minutes` says what the recorded times
add up to on two workers, as scripts/test.sh prints it before it starts."""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

TIMES = Path(__file__).resolve().parents[1] / "timings.json"
QUICK_S = 1.0
SLOW_S = 30.0
WORKERS = 2
PER_TIER_S = 20.0             # starting two workers (each imports torch) and collecting, per pytest run
TESTS = Path(__file__).resolve().parents[1]


def recorded() -> dict[str, float]:
    try:
        return json.loads(TIMES.read_text())
    except (OSError, ValueError):
        return {}


def expected_minutes(times: dict[str, float] | None = None) -> float:
    """The whole suite on two workers, from the recorded times: each tier's tests shared by the workers,
    plus each tier's start."""
    times = recorded() if times is None else times
    return (sum(times.values()) / WORKERS + 2 * PER_TIER_S) / 60


def announcement() -> str:
    """What scripts/test.sh says before it starts."""
    times = recorded()
    return (f"scripts/test.sh: {len(times)} tests, expected about {expected_minutes(times):.0f} min on two idle "
            "cores (their recorded times, tests/timings.json), after setup (a fresh clone's .venv: about 4 min "
            "more)")


def _shared_fixtures(item) -> set[str]:
    """The fixtures of this suite (defined under tests/) that `item` uses and that outlive one test."""
    info = getattr(item, "_fixtureinfo", None)
    shared = set()
    for name, defs in (info.name2fixturedefs.items() if info else ()):
        for d in defs:
            where = getattr(d.func, "__code__", None)
            if d.scope != "function" and where and Path(where.co_filename).resolve().is_relative_to(TESTS):
                shared.add(name)
    return shared


def assign(items, mark) -> None:
    """Mark each item `quick` or `slow` by its recorded time (`mark`: pytest.mark), and order the files
    longest first."""
    times = recorded()
    quick = set()
    for item in items:
        t = times.get(item.nodeid)
        unit = item.nodeid.startswith("tests/unit/")
        if (t if t is not None else (0.0 if unit else SLOW_S)) < QUICK_S and not item.get_closest_marker("server"):
            quick.add(item.nodeid)
        if t is not None and t >= SLOW_S:
            item.add_marker(mark.slow)
    users = defaultdict(set)                       # shared fixture -> the tests using it
    shared = {item.nodeid: _shared_fixtures(item) for item in items}
    for nodeid, names in shared.items():
        for name in names:
            users[name].add(nodeid)
    changed = True
    while changed:                                 # a fixture a timed test sets up anyway keeps its users there
        changed = False
        for nodeid in list(quick):
            if any(users[name] - quick for name in shared[nodeid]):
                quick.discard(nodeid)
                changed = True
    for item in items:
        if item.nodeid in quick:
            item.add_marker(mark.quick)
    per_file = defaultdict(float)
    for item in items:
        per_file[item.nodeid.split("::")[0]] += times.get(item.nodeid, 0.0 if item.nodeid in quick else SLOW_S)
    items.sort(key=lambda item: -per_file[item.nodeid.split("::")[0]])       # stable: a file's order is kept


class Recorder:
    """Each test's setup + call + teardown time, written (merged) into a JSON file at the end of the run
    by the process that reports (under xdist: the controller)."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.times: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.times[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session):
        if hasattr(session.config, "workerinput") or not self.times:
            return
        try:
            old = json.loads(self.path.read_text())
        except (OSError, ValueError):
            old = {}
        old.update({k: round(v, 2) for k, v in self.times.items()})
        self.path.write_text(json.dumps(dict(sorted(old.items())), indent=0) + "\n")


def recorder() -> Recorder | None:
    path = os.environ.get("UGPUM_RECORD_TEST_TIMES")
    return Recorder(path) if path else None

"""Every recorded CLI row of the 8-bit cards work against the planner's forecast as the code stands now
(issue 24): prints, per row, measured and forecast s/step and peak GiB and their errors (relative to the
measurement), and exits 1 when any is over 10 %. The rows and the comparison live in
tests/support/recorded_forecasts.py (the unit test holds the planner to the same)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support.recorded_forecasts import LIMIT, compare, recorded_rows  # noqa: E402


def main() -> int:
    worst = 0.0
    print(f"{'row':44} {'s/step':>7} {'fcst':>7} {'err':>6} {'peak':>7} {'fcst':>7} {'err':>6} swapped (plans now)")
    for row in recorded_rows():
        c = compare(row)
        worst = max(worst, abs(c["s_error"]), abs(c["gib_error"]))
        print(f"{c['label']:44} {c['s']:7.4f} {c['forecast_s']:7.4f} {c['s_error']:+6.1%} {c['gib']:7.3f} "
              f"{c['forecast_gib']:7.3f} {c['gib_error']:+6.1%} {c['swapped']} ({c['planned']})")
    print(f"worst error {worst:.1%} (limit {LIMIT:.0%})")
    return 0 if worst <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs every test (what CI runs), in two tiers by each test's own
# recorded time (tests/timings.json; tests/support/tiers.py), both on two workers (pytest-xdist):
#   quick  every test under a second that shares no costly fixture with a slower one (most of tests/unit,
#          and the quick tests of tests/integration and tests/server): about a minute
#   timed  the rest: tiny trainings on the CPU, the CLI in child processes, ComfyUI servers, the browser;
#          files with the longest recorded time first, work stolen between the workers as they finish
# Arguments go to both pytest runs (e.g. -x, -k NAME). UGPUM_RECORD_TEST_TIMES=tests/timings.json records
# this run's times into the file (commit it when tests were added or got slower or faster).
set -euo pipefail
cd "$(dirname "$0")/.."
# the expected time first (tests/support/tiers.py needs nothing but Python's standard library)
python3 -c 'import sys; sys.path.insert(0, "tests"); from support import tiers; print(tiers.announcement())' || true
bash scripts/setup.sh
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider -n 2)
start=$SECONDS
set +e
"${pytest[@]}" --dist load -m quick tests "$@"
quick=$?
echo "quick tier: $((SECONDS - start)) s"
"${pytest[@]}" --dist worksteal -m "not quick" --durations=20 tests "$@"
timed=$?
set -e
echo "all tests: $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s"
for rc in "$quick" "$timed"; do
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests in a tier: treated as a failure" >&2
    exit 1
  fi
done
[ "$quick" -eq 0 ] && [ "$timed" -eq 0 ]

#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs every test tier, unit tests first (what CI runs):
#   tests/unit         no training, no subprocess, no server: seconds
#   tests/integration  the real CLI in subprocesses, tiny trainings on the CPU
#   tests/server       a real ComfyUI server, and ComfyUI's frontend in Chromium
# The integration and server tiers run on two workers (pytest-xdist), a test file to a worker: most
# of their time is child processes and servers, which overlap on two cores.
# Arguments go to both pytest runs (e.g. -x, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=20)
set +e
"${pytest[@]}" tests/unit "$@"
unit=$?
"${pytest[@]}" -n 2 --dist loadfile tests/integration tests/server "$@"
rest=$?
set -e
for rc in "$unit" "$rest"; do
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests in a tier: treated as a failure" >&2
    exit 1
  fi
done
[ "$unit" -eq 0 ] && [ "$rest" -eq 0 ]

#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the main job: python -m ugpum demo (extra args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m ugpum demo "$@"

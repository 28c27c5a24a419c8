"""The pack in ComfyUI's real web frontend, in a real browser (marker ``browser``).

A ComfyUI server (the packaged copy, or ``COMFYUI_PATH``) runs with its real frontend package
(tests/support/browser.py) and the system Chromium, driven by Playwright, does what a user does:

* every workflow of example_workflows/ is listed in the Templates panel, opens from it without a
  missing-node dialog, and every node of ours shows its widgets (values within their options and
  ranges) and a tooltip on every widget and on its title;
* the klein demo workflow, with a tiny random-weight FLUX.2 under the file name the workflow's Loader
  names, is queued with the Run button and runs to the end: the Trainer shows its progress bar and a
  live preview, the loss curve and before/after images reach the preview nodes, the Sample Preview
  shows before and after, and ComfyUI's LoRA lists then offer the trained file.

The registry metadata (pyproject.toml [tool.comfy], [project.urls], the icon) is checked by the Comfy
Registry's own validator, ``comfy node validate`` of the PyPI package comfy-cli (installed once into
~/.cache/ugpum/comfy-cli, about 30 s and 340 MB).

Screenshots (PNG) go into the test's tmp_path: ``workflow_<name>.png``, ``running.png`` and
``finished.png``; ``UGPUM_SCREENSHOTS=<dir>`` copies them there as well.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from support.browser import Chromium, FrontendServer, browser_or_skip, frontend_root, frontend_version
from support.comfy_server import REPO, PACK_DIR_NAME, comfyui_or_skip, execution_error, private_copy


WORKFLOWS = sorted((REPO / "example_workflows").glob("*.json"))
KLEIN = REPO / "example_workflows" / "ugpum_klein9b_lora.json"
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
SETTINGS = {                                # a returning user's settings, so no tour or banner covers the canvas
    "Comfy.TutorialCompleted": True,
    "Comfy.Minimap.Visible": False,
    "Comfy.Graph.CanvasInfo": False,
    "Comfy.VueNodes.Enabled": False,        # the classic canvas nodes (the default of these frontends)
    "Comfy.EnableTooltips": True,
    "LiteGraph.Node.TooltipDelay": 50,
    "LiteGraph.Canvas.MinFontSizeForLOD": 1,  # text stays drawn when the whole workflow fits the window
}
# What the run changes in the klein workflow, as a user would in the widgets: a tiny model trains a few
# steps at 64 px on the CPU. The stock text encoder, VAE and distilled-model branch need real FLUX.2
# [klein] weights (no small stand-in loads in ComfyUI's stock loaders), so they are muted and the
# Trainer / Sample Preview run with the stand-in encoders the tiny model allows.
RUN_WIDGETS = {
    "UGPUMPartitionPlanner": {"resolution": 64, "rank": 4, "grad_accum": 1},
    "UGPUMLoRATrainer": {"steps": 4, "sample_every": 2, "save_name": "loranne_tiny",
                         "sample_prompt": "loranne, waving"},
    "UGPUMSamplePreview": {"width": 256, "height": 256, "prompt": "loranne, waving, on a beach"},
}
STOCK_BRANCH_TYPES = {"CLIPLoader", "VAELoader", "UNETLoader", "LoraModelLoader", "CLIPTextEncode", "CFGGuider",
                      "RandomNoise", "KSamplerSelect", "Flux2Scheduler", "EmptyFlux2LatentImage",
                      "SamplerCustomAdvanced", "VAEDecode", "SaveImage"}
RUN_TIMEOUT_S = 240


def workflow_stamp(workflow: Path) -> str:
    """What a screenshot of `workflow` records of it: its name and the sha256 of its file."""
    import hashlib
    return f"{workflow.name} sha256={hashlib.sha256(workflow.read_bytes()).hexdigest()}"


def prepare_models(models: Path) -> None:
    """Every file the workflows name, by name (empty placeholders: the combos list them), and the
    tiny FLUX.2 (ComfyUI's own module, seeded random weights) as the klein base model."""
    from test_comfy_nodes import write_tiny
    for workflow in WORKFLOWS:
        for node in json.loads(workflow.read_text())["nodes"]:
            folder = {"UGPUMLoader": "diffusion_models", "UNETLoader": "diffusion_models",
                      "CLIPLoader": "text_encoders", "VAELoader": "vae"}.get(node["type"])
            if folder:
                (models / folder / node["widgets_values"][0]).touch()
    klein_base = next(n for n in json.loads(KLEIN.read_text())["nodes"] if n["type"] == "UGPUMLoader")
    write_tiny(models / "diffusion_models" / klein_base["widgets_values"][0])


@pytest.fixture(scope="module")
def frontend_server(tmp_path_factory):
    browser_or_skip()
    comfyui = comfyui_or_skip()
    if not os.environ.get("COMFYUI_PATH"):
        comfyui = private_copy(comfyui, tmp_path_factory.mktemp("comfyui-src") / "ComfyUI")
    server = FrontendServer(comfyui, tmp_path_factory.mktemp("comfyui-frontend"), frontend_root())
    prepare_models(server.models)
    settings = server.base / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(SETTINGS))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def chromium(frontend_server):
    browser = Chromium()
    yield browser
    browser.close()


class Page:
    """One tab on the server's frontend, with the page's errors collected."""

    def __init__(self, chromium: Chromium, server: FrontendServer):
        self.server = server
        self.page = chromium.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.goto(server.url)
        self.page.wait_for_function("() => window.app && window.app.graph && window.app.canvas "
                                    "&& window.LiteGraph && Object.keys(LiteGraph.registered_node_types).length > 100",
                                    timeout=90_000)
        self.dismiss_banners()

    def dismiss_banners(self) -> None:
        self.page.keyboard.press("Escape")
        for close in self.page.locator('button:has(i[class*="lucide--x"])').all():
            box = close.bounding_box() if close.is_visible() else None
            if box and box["y"] < 30:                       # the x of the "Introducing Nodes 2.0" banner
                close.click()
        for close in self.page.locator(".p-message-close-button, [aria-label='Close banner']").all():
            if close.is_visible():
                close.click()

    def js(self, expression: str, arg=None):
        return self.page.evaluate(expression, arg)

    def visible_dialogs(self) -> list[str]:
        return self.js("() => Array.from(document.querySelectorAll('.p-dialog'))"
                       ".filter(d => d.offsetParent !== null).map(d => d.innerText.slice(0, 400))")

    def open_template(self, stem: str) -> None:
        """Templates panel (left bar) -> the pack's card -> the workflow in a new tab."""
        self.page.get_by_text("Templates", exact=True).first.click()
        card = self.page.locator("[role=dialog]").get_by_text(stem, exact=True).first   # not a tab of that name
        card.wait_for(timeout=30_000)
        card.click()
        self.page.wait_for_function("(stem) => app.graph._nodes.some(n => n.type === 'UGPUMLoader') "
                                    "&& document.title.includes(stem)", arg=stem, timeout=30_000)
        self.page.wait_for_timeout(500)
        self.fit()

    def fit(self) -> None:
        self.js("() => app.canvas.deselectAll?.()")
        self.page.locator("canvas#graph-canvas, canvas.graph-canvas, canvas").first.focus()
        self.page.keyboard.press(".")                       # fit the view to the whole workflow
        self.page.wait_for_timeout(400)

    def nodes(self) -> list[dict]:
        return self.js("""() => app.graph._nodes.map(n => ({id: n.id, type: n.type, mode: n.mode, title: n.title,
            registered: !!LiteGraph.registered_node_types[n.type], has_errors: !!n.has_errors,
            widgets: (n.widgets || []).map(w => ({name: w.name, type: w.type, value: w.value,
                                                  options: w.options ? {values: Array.isArray(w.options.values) ? w.options.values : null,
                                                                        min: w.options.min, max: w.options.max} : {}}))}))""")

    def hover_tooltip(self, node_id: int, widget: str | None) -> str:
        """The tooltip ComfyUI shows when the pointer rests on a widget (or, for None, on the title)."""
        point = self.js("""([id, name]) => {
            const n = app.graph.getNodeById(id);
            let y;
            if (name === null) y = n.pos[1] - LiteGraph.NODE_TITLE_HEIGHT / 2;
            else { const w = n.widgets.find(w => w.name === name); y = n.pos[1] + (w.last_y ?? w.y) + LiteGraph.NODE_WIDGET_HEIGHT / 2; }
            const x = n.pos[0] + (name === null ? 40 : n.size[0] / 2);
            const c = app.canvas.ds.convertOffsetToCanvas([x, y]);
            const r = app.canvas.canvas.getBoundingClientRect();
            return [r.left + c[0], r.top + c[1]]; }""", [node_id, widget])
        tip = self.page.locator(".node-tooltip")
        for _ in range(3):                                  # the first rest after a page opens can go unseen
            self.page.mouse.move(5, 5)
            self.page.wait_for_timeout(60)
            self.page.mouse.move(point[0] - 2, point[1])
            self.page.mouse.move(point[0], point[1])
            try:
                tip.first.wait_for(state="visible", timeout=2000)
                return tip.first.inner_text()
            except Exception:
                continue
        return ""

    def screenshot(self, path: Path, workflow: Path | None = None) -> Path:
        """The page as a PNG; `workflow`: the workflow file it shows, whose name and content hash the PNG
        records (text chunk `ugpum-workflow`, see `workflow_stamp`), so a picture of an older workflow in
        the docs is found out (tests/unit/test_docs_paths.py)."""
        self.page.mouse.move(900, 990)                      # over empty canvas: no tooltip in the picture
        self.page.wait_for_timeout(150)
        self.page.screenshot(path=str(path))
        if workflow is not None:
            from PIL import Image, PngImagePlugin
            info = PngImagePlugin.PngInfo()
            info.add_text("ugpum-workflow", workflow_stamp(workflow))
            Image.open(path).save(path, pnginfo=info)
        target = os.environ.get("UGPUM_SCREENSHOTS")
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(target) / path.name)
        return path

    def close(self) -> None:
        self.page.close()


@pytest.fixture
def page(chromium, frontend_server):
    p = Page(chromium, frontend_server)
    yield p
    p.close()


def widget_tooltips(server: FrontendServer, node_type: str) -> dict[str, str]:
    node = server.object_info()[node_type]
    out = {}
    for section in ("required", "optional"):
        for name, spec in node["input"].get(section, {}).items():
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            out[name] = opts.get("tooltip", "")
    return out


# ------------------------------------------------------------------------------------------ tests

@pytest.mark.browser
def test_every_widget_of_ours_declares_a_tooltip(frontend_server):
    """The frontend shows a widget's tooltip only where the node declares one."""
    from test_comfy_nodes import widget_inputs
    info = frontend_server.object_info()
    missing = [f"{node_type}.{name}" for node_type in sorted(info) if node_type.startswith("UGPUM")
               for name, _, opts in widget_inputs(info[node_type]) if not opts.get("tooltip", "").strip()]
    assert not missing, "widgets without a tooltip: " + ", ".join(missing)


@pytest.mark.browser
def test_server_lists_the_workflows_as_templates(frontend_server):
    listed = frontend_server.get_json("/api/workflow_templates")
    assert sorted(listed.get(PACK_DIR_NAME, [])) == sorted(w.stem for w in WORKFLOWS), listed
    ours = [line for line in frontend_server.log().splitlines() if PACK_DIR_NAME in line]
    assert ours and not any("IMPORT FAILED" in line for line in ours), ours


@pytest.mark.browser
@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.stem)
def test_workflow_opens_from_templates_with_widgets_and_tooltips(page, frontend_server, workflow, tmp_path):
    page.open_template(workflow.stem)
    shot = page.screenshot(tmp_path / f"workflow_{workflow.stem}.png", workflow)
    assert not page.visible_dialogs(), f"a dialog opened with the workflow: {page.visible_dialogs()} ({shot})"
    expected_types = sorted(n["type"] for n in json.loads(workflow.read_text())["nodes"])
    nodes = page.nodes()
    assert sorted(n["type"] for n in nodes) == expected_types
    missing = [n["type"] for n in nodes if not n["registered"] or n["has_errors"]]
    assert not missing, f"nodes the frontend does not know: {missing}"
    info = frontend_server.object_info()
    from test_comfy_nodes import widget_inputs
    problems = []
    for node in nodes:
        if not node["type"].startswith("UGPUM"):
            continue
        spec = info[node["type"]]
        declared = [name for name, _, _ in widget_inputs(spec)]
        shown = [w["name"] for w in node["widgets"] if w["name"] != "control_after_generate"]
        if shown != declared:
            problems.append(f"{node['type']}: widgets {shown}, declared {declared}")
        for w in node["widgets"]:
            values, low, high = w["options"].get("values"), w["options"].get("min"), w["options"].get("max")
            if values is not None and w["value"] not in values:
                problems.append(f"{node['type']}.{w['name']} = {w['value']!r}: not one of {values}")
            if isinstance(w["value"], (int, float)) and not isinstance(w["value"], bool):
                if (low is not None and w["value"] < low) or (high is not None and w["value"] > high):
                    problems.append(f"{node['type']}.{w['name']} = {w['value']}: outside [{low}, {high}]")
        tips = widget_tooltips(frontend_server, node["type"])
        title_tip = page.hover_tooltip(node["id"], None)
        if not title_tip or title_tip.strip() != spec["description"].strip():
            problems.append(f"{node['type']} title tooltip {title_tip!r}, description {spec['description'][:60]!r}")
        for w in node["widgets"]:
            if w["name"] == "control_after_generate" or w["type"] == "customtext":
                continue          # a text box is a page element: the browser, not the canvas, handles its pointer
            if not tips.get(w["name"]):
                continue          # test_every_widget_of_ours_declares_a_tooltip names these
            shown_tip = page.hover_tooltip(node["id"], w["name"])
            if shown_tip.strip() != tips[w["name"]].strip():
                problems.append(f"{node['type']}.{w['name']}: tooltip shown {shown_tip!r}, declared {tips[w['name']]!r}")
    assert not problems, "\n".join(problems) + f"\n(screenshot {shot})"
    assert not page.errors, page.errors


@pytest.mark.browser
def test_klein_workflow_runs_from_the_ui(page, frontend_server, tmp_path):
    server = frontend_server
    page.open_template(KLEIN.stem)
    edited = page.js("""([runWidgets, muted]) => {
        const out = {};
        for (const n of app.graph._nodes) {
            const values = runWidgets[n.type];
            if (values) for (const [name, value] of Object.entries(values)) {
                const w = n.widgets.find(w => w.name === name);
                w.value = value; w.callback?.(value, app.canvas, n);
            }
            if (n.type === 'UGPUMLoRATrainer' || n.type === 'UGPUMSamplePreview')
                for (const name of ['clip', 'vae']) n.disconnectInput(n.findInputSlot(name));
            if (muted.includes(n.type)) n.mode = 2;                                 // LiteGraph.NEVER: muted
            out[n.type] = n.id;
        }
        app.graph.setDirtyCanvas(true, true);
        window.__ugpum = {progress: [], previews: 0, executed: {}, executing: [], done: false, error: null};
        const api = app.api ?? window.comfyAPI?.api?.api;
        api.addEventListener('progress', e => window.__ugpum.progress.push([String(e.detail.node), e.detail.value, e.detail.max]));
        api.addEventListener('b_preview', () => window.__ugpum.previews++);
        api.addEventListener('b_preview_with_metadata', () => window.__ugpum.previews++);
        api.addEventListener('executing', e => window.__ugpum.executing.push(String(e.detail?.node ?? e.detail)));
        api.addEventListener('executed', e => window.__ugpum.executed[String(e.detail.node)] = e.detail.output);
        api.addEventListener('execution_success', () => window.__ugpum.done = true);
        api.addEventListener('execution_error', e => { window.__ugpum.error = e.detail; window.__ugpum.done = true; });
        return out; }""", [RUN_WIDGETS, sorted(STOCK_BRANCH_TYPES)])
    trainer, preview = str(edited["UGPUMLoRATrainer"]), str(edited["UGPUMSamplePreview"])
    started = time.monotonic()
    with page.page.expect_response(lambda r: r.url.endswith("/prompt") and r.request.method == "POST") as queued:
        page.page.get_by_role("button", name="Run", exact=True).first.click()
    answer = queued.value.json()
    assert "prompt_id" in answer and not answer.get("node_errors"), (
        f"the server refused (part of) the prompt the UI sent: {json.dumps(answer)[:3000]}")
    # while it trains: the Trainer's bar and its live preview
    running_shot = None
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        state = page.js("() => window.__ugpum")
        if state["done"]:
            break
        trainer_progress = [p for p in state["progress"] if p[0] == trainer]
        if running_shot is None and state["previews"] and trainer_progress and trainer_progress[-1][1] >= 2:
            page.page.wait_for_timeout(300)                 # the preview image decodes and draws
            running_shot = page.screenshot(tmp_path / "running.png")
        time.sleep(0.1)
    entry = server.wait(answer["prompt_id"], timeout=max(5.0, deadline - time.monotonic()))
    error = execution_error(entry)
    assert error is None and entry["status"]["status_str"] == "success", (
        json.dumps(error or entry["status"], indent=1)[:3000] + "\n" + server.log_tail())
    page.page.wait_for_function("() => window.__ugpum.done", timeout=30_000)
    elapsed = time.monotonic() - started
    state = page.js("() => window.__ugpum")
    steps = RUN_WIDGETS["UGPUMLoRATrainer"]["steps"]
    trainer_progress = [p for p in state["progress"] if p[0] == trainer]
    assert trainer_progress and trainer_progress[-1][1:] == [steps, steps], state["progress"]
    assert state["previews"] >= 1, "no live preview reached the page while training"
    assert running_shot is not None, "never saw the Trainer's bar and preview at the same time"
    # what the nodes show when it has finished
    page.fit()
    page.page.wait_for_timeout(800)
    shown = page.js("""() => Object.fromEntries(app.graph._nodes.map(n => [String(n.id),
        {type: n.type, images: (n.imgs || []).filter(i => i.complete && i.naturalWidth > 0).length,
         outputs: (window.__ugpum.executed[String(n.id)]?.images || []).length}]))""")
    assert shown[preview]["outputs"] == 2 and shown[preview]["images"] == 2, shown       # before, after
    image_nodes = {l[3] for l in json.loads(KLEIN.read_text())["links"] if l[1] == int(trainer) and l[5] == "IMAGE"}
    for node_id in image_nodes:                          # loss curve, before / after of the training samples
        assert shown[str(node_id)]["images"] >= 1, (node_id, shown[str(node_id)])
    saved = server.base / "models" / "loras" / "ugpum" / "loranne_tiny.safetensors"
    assert saved.is_file(), server.log_tail()
    finished_shot = page.screenshot(tmp_path / "finished.png")
    # ComfyUI's LoRA loaders now list the file (the list every stock LoRA loader draws from)
    assert "ugpum/loranne_tiny.safetensors" in server.get_json("/models/loras")
    print(f"\nklein workflow from the UI: {elapsed:.1f} s, frontend {frontend_version(frontend_root())}, "
          f"screenshots {running_shot} {finished_shot}")
    assert not page.errors, page.errors


# ------------------------------------------------------------------------------------------ registry

COMFY_CLI_VENV = Path(os.environ.get("UGPUM_COMFY_CLI_VENV", Path.home() / ".cache" / "ugpum" / "comfy-cli"))
ALLOWED_WARNINGS = ("License should be",)     # the registry accepts a pack without one; choosing it is the owners'


def comfy_cli() -> Path:
    import subprocess
    import sys
    comfy = COMFY_CLI_VENV / "bin" / "comfy"
    if not comfy.is_file():
        shutil.rmtree(COMFY_CLI_VENV, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(COMFY_CLI_VENV)], check=True)
        subprocess.run([str(COMFY_CLI_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                        "--disable-pip-version-check", "comfy-cli"], check=True)
    return comfy


def test_registry_metadata_is_complete():
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    comfy, urls = project["tool"]["comfy"], project["project"]["urls"]
    for key in ("PublisherId", "DisplayName", "Icon"):
        assert isinstance(comfy.get(key), str) and comfy[key].strip(), key
    assert urls.get("Repository", "").startswith("https://github.com/") and all(v.strip() for v in urls.values()), urls
    prefix = "https://raw.githubusercontent.com/ugpum/ComfyUI-UGPUM/main/"
    assert comfy["Icon"].startswith(prefix), comfy["Icon"]
    from PIL import Image
    with Image.open(REPO / comfy["Icon"][len(prefix):]) as icon:      # the file the raw URL will serve
        assert icon.format == "PNG" and icon.size[0] == icon.size[1] <= 400, (icon.format, icon.size)


def test_comfy_node_validate_passes():
    """What `comfy node publish` checks first: the [project] / [tool.comfy] configuration and ruff's
    exec / eval / one-line-statements rules (S102, S307, E702) over the repository."""
    import subprocess
    result = subprocess.run([str(comfy_cli()), "--skip-prompt", "--no-enable-telemetry", "node", "validate"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "All validation checks passed successfully" in output, output
    warnings = [line for line in output.splitlines()
                if ("Warning" in line or "Error" in line) and not any(a in line for a in ALLOWED_WARNINGS)]
    assert not warnings, output

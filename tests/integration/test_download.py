"""`ugpum download`: the catalog, the offline message, the local Hugging Face cache, resumable and
verified downloads that never leave a file under the final name unless it is complete.

No test reaches the network: sockets to anything but this machine fail (and are recorded), and the
one test that speaks HTTP does so to a small Hub look-alike on 127.0.0.1."""
import argparse
import hashlib
import http.server
import os
import re
import socket
import threading
from pathlib import Path

import pytest

from support.comfyui_tree import comfyui_tree
from ugpum.commands import download as dl
from ugpum.catalog import models as catalog
from ugpum.arch import get_spec
from ugpum.commands.download import AccessDenied, LocalFileSource, NoNetwork, Remote, VerifyError, fetch_file

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
MiB = 2**20


@pytest.fixture
def network_attempts(monkeypatch):
    """Make every connection to another machine fail, and record the attempts."""
    attempts = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(sock, address):
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and host not in LOOPBACK:
            attempts.append(address)
            raise OSError(f"tests may not reach {address}")
        return real_connect(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if host not in LOOPBACK and host is not None:
            attempts.append(host)
            raise socket.gaierror(f"tests may not resolve {host}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty Hugging Face home, offline, without tokens."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("HF_HUB_CACHE", "HF_TOKEN", "HF_ENDPOINT", "COMFYUI_PATH"):
        monkeypatch.delenv(var, raising=False)
    return home


def put_in_hub_cache(hf_home: Path, f: catalog.ModelFile, data: bytes, blob_name: str | None = None,
                     commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Lay a file out as huggingface_hub's cache does: blobs/<sha256>, snapshots/<commit>/<path>
    linking to the blob, refs/main naming the commit."""
    repo = hf_home / "hub" / ("models--" + f.repo_id.replace("/", "--"))
    blob = repo / "blobs" / (blob_name or hashlib.sha256(data).hexdigest())
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    snap = repo / "snapshots" / commit / f.path
    snap.parent.mkdir(parents=True)
    snap.symlink_to(os.path.relpath(blob, snap.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap


class FakeSource:
    """A source serving `data` the way the Hub does (size and SHA-256 first, then ranged bytes),
    able to fail once after some bytes, or to ignore ranges."""

    def __init__(self, data: bytes, sha256: str | None = None, fail_after: int | None = None,
                 error: BaseException | type = KeyboardInterrupt, honour_range: bool = True,
                 chunk: int = 256 * 1024):
        self.data, self.chunk = data, chunk
        self.sha256 = sha256 or hashlib.sha256(data).hexdigest()
        self.fail_after, self.error, self.honour_range = fail_after, error, honour_range
        self.reads: list[int] = []
        self.describes = 0

    def describe(self, f):
        self.describes += 1
        return Remote(len(self.data), self.sha256, f"fake://{f.repo_id}/{f.path}")

    def read(self, f, remote, offset):
        self.reads.append(offset)
        start = offset if self.honour_range else 0

        def chunks():
            sent = 0
            for i in range(start, len(self.data), self.chunk):
                if self.fail_after is not None and sent >= self.fail_after:
                    self.fail_after = None                      # fail once
                    raise self.error
                block = self.data[i:i + self.chunk]
                sent += len(block)
                yield block
        return start, chunks()


def klein_dit() -> catalog.ModelFile:
    return catalog.files_for("klein-9b-1024")[0]


def comfy_listing(folder: Path) -> list[str]:
    """What ComfyUI's loader would list in a models/ subfolder (model file extensions only)."""
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".sft", ".ckpt", ".pt"))


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    dl.add_download_parser(parser.add_subparsers(dest="command"))
    return dl.run_download(parser.parse_args(argv))


# ---------------------------------------------------------------------------------------------
# Catalog


def test_klein_9b_profile_files():
    """The profile trains on the klein 9B base model and downloads the distilled one its workflow renders with."""
    dit, te, vae = catalog.files_for("klein-9b-1024")
    assert (dit.folder, dit.filename, dit.repo_id) == (
        "diffusion_models", "flux-2-klein-base-9b.safetensors", "black-forest-labs/FLUX.2-klein-base-9B")
    assert dit.gated and not dit.licence.commercial
    assert (te.folder, te.filename) == ("text_encoders", "qwen_3_8b_fp8mixed.safetensors")
    assert (vae.folder, vae.filename) == ("vae", "flux2-vae.safetensors")
    assert catalog.files_for("klein-9b-1024", "fp8")[0].filename == "flux-2-klein-base-9b-fp8.safetensors"
    render = catalog.download_files_for("klein-9b-1024")[3]
    assert render.filename == "flux-2-klein-9b-fp8.safetensors" and len(catalog.download_files_for("klein-9b-1024")) == 4
    assert [f.filename for f in catalog.download_files_for("flux2-dev-1024")] == [
        f.filename for f in catalog.files_for("flux2-dev-1024")]                 # dev renders with what it trains on
    # the profile is the training profile of the same name
    from ugpum.train.config import PROFILES
    assert PROFILES["klein-9b-1024"]["model"] == catalog.PROFILES["klein-9b-1024"].model


def test_catalog_entries_are_known_models_with_sources():
    for needed in ("flux2-klein-9b", "flux2-klein-4b", "flux2-dev", "wan2.1-14b", "wan2.1-1.3b"):
        assert needed in catalog.MODELS
    assert [f.filename for f in catalog.files_for("flux2-dev")][0] == "flux2_dev_fp8mixed.safetensors"
    assert catalog.MODELS["flux2-dev"].dit["bf16"].gated
    source = Path(catalog.__file__).read_text().splitlines()
    for entry in catalog.MODELS.values():
        get_spec(entry.id)                                      # an id the planner knows
        for f in entry.all_files():
            assert f.url.startswith("https://huggingface.co/") and f.url.endswith(f.filename)
            assert f.path.endswith(f.filename)
            # every file name in the catalog has its source (a URL in a comment) just above it
            at = next(i for i, line in enumerate(source) if f'"{f.filename}"' in line)
            above = source[max(0, at - 8):at]
            assert any(line.strip().startswith("#") and "https://" in line for line in above), f.filename
    hint = dl.missing_hint("flux2-klein-9b", {"flux2-vae.safetensors", "flux-2-klein-9b.safetensors"})
    assert "text_encoders/qwen_3_8b_fp8mixed.safetensors" in hint and "python -m ugpum download flux2-klein-9b" in hint
    assert dl.missing_hint("flux2-klein-9b", [f.filename for f in catalog.files_for("flux2-klein-9b")]) is None
    with pytest.raises(catalog.UnknownName, match="known: klein-9b-1024"):
        catalog.files_for("sdxl")
    with pytest.raises(catalog.UnknownName, match="no fp8"):
        catalog.files_for("wan2.1-1.3b", "fp8")


def test_list_prints_sources(capsys):
    assert run_cli(["download", "klein-9b-1024", "--list"]) == 0
    out = capsys.readouterr().out
    for f in catalog.download_files_for("klein-9b-1024"):
        assert f.url in out
    assert "non-commercial use only" in out
    assert run_cli(["download", "nonsense", "--list"]) == 2


def test_list_json_gives_the_relative_paths_it_would_write(capsys):
    import json
    assert run_cli(["download", "wan14b-480-clip", "--list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [f["path"] for f in listed["files"]] == [
        "diffusion_models/wan2.1_t2v_14B_fp8_scaled.safetensors",
        "text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors", "vae/wan_2.1_vae.safetensors"]
    assert listed["dtype"] == "fp8" and all(f["commercial_use"] for f in listed["files"])


# ---------------------------------------------------------------------------------------------
# Offline


def test_offline_gives_one_message_with_files_sources_and_folders(tmp_path, hf_home, network_attempts, capsys):
    models = comfyui_tree(tmp_path / "ComfyUI") / "models"            # a ComfyUI that loads klein's text encoder
    models.rmdir()
    rc = run_cli(["download", "klein-9b-1024", "--models", str(models)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("Could not download") == 1                       # one message
    for f in catalog.download_files_for("klein-9b-1024"):
        assert f.filename in err and f.url in err
        assert f"to:   {models / f.folder / f.filename}" in err
    assert "HF_HUB_OFFLINE" in err
    # the gated DiT: which licence, where to accept it, how to give a token
    assert "FLUX Non-Commercial License" in err and "https://huggingface.co/black-forest-labs/FLUX.2-klein-base-9B" in err
    assert "HF_TOKEN" in err and "huggingface-cli login" in err
    assert network_attempts == []
    assert not models.exists()                                        # nothing written


def test_without_huggingface_hub_the_message_says_so(tmp_path, hf_home, network_attempts, monkeypatch):
    import builtins
    monkeypatch.delenv("HF_HUB_OFFLINE")
    real_import = builtins.__import__

    def no_hf(name, *args, **kwargs):
        if name == "huggingface_hub" or name.startswith("huggingface_hub."):
            raise ImportError("No module named 'huggingface_hub'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hf)
    report = dl.download("klein-9b-1024", tmp_path / "models", progress=False, log=lambda _: None)
    assert [o.status for o in report.outcomes] == ["missing"] * 4
    assert "pip install huggingface_hub" in dl.explain(report)
    assert network_attempts == []


# ---------------------------------------------------------------------------------------------
# The local Hugging Face cache


def test_prepopulated_cache_is_used_without_network(tmp_path, hf_home, network_attempts):
    vae = catalog.files_for("klein-9b-1024")[2]
    data = os.urandom(3 * MiB + 17)
    snap = put_in_hub_cache(hf_home, vae, data)
    try:                                  # the layout is the one huggingface_hub itself reads
        from huggingface_hub import try_to_load_from_cache
        assert Path(try_to_load_from_cache(vae.repo_id, vae.path, cache_dir=hf_home / "hub")) == snap
    except ImportError:
        pass
    models = tmp_path / "models"
    report = dl.download("klein-9b-1024", models, progress=False, log=lambda _: None)
    status = {o.file.role: o.status for o in report.outcomes}
    assert status == {"dit": "missing", "text_encoder": "missing", "vae": "cached"}
    assert (models / "vae" / "flux2-vae.safetensors").read_bytes() == data
    assert comfy_listing(models / "vae") == ["flux2-vae.safetensors"]
    assert sorted(p.name for p in (models / "vae").iterdir()) == ["flux2-vae.safetensors"]   # no leftovers
    assert snap.read_bytes() == data                                  # the cache is untouched
    assert network_attempts == []
    # the second run finds it in place
    again = dl.download("klein-9b-1024", models, progress=False, log=lambda _: None)
    assert {o.file.role: o.status for o in again.outcomes}["vae"] == "present"


def test_corrupt_cache_file_is_rejected(tmp_path, hf_home, network_attempts):
    vae = catalog.files_for("klein-9b-1024")[2]
    data = os.urandom(MiB)
    put_in_hub_cache(hf_home, vae, data, blob_name=hashlib.sha256(b"something else").hexdigest())
    models = tmp_path / "models"
    report = dl.download("klein-9b-1024", models, progress=False, log=lambda _: None)
    outcome = report.outcomes[2]
    assert outcome.status == "failed" and "SHA-256" in outcome.detail
    assert list((models / "vae").iterdir()) == []                     # neither final nor partial file
    assert "Failed:" in dl.explain(report)


# ---------------------------------------------------------------------------------------------
# Resumable, verified, renamed at the end


def test_interrupted_download_leaves_no_final_file_and_resumes(tmp_path):
    f, data = klein_dit(), os.urandom(3 * MiB + 123)
    dest = tmp_path / "models" / f.folder / f.filename
    source = FakeSource(data, fail_after=MiB, error=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        fetch_file(f, dest, source, progress=False)
    assert not dest.exists()
    assert comfy_listing(dest.parent) == []                           # ComfyUI lists nothing
    assert dl.partial_path(dest).stat().st_size == MiB

    fetch_file(f, dest, source, progress=False)                       # run again
    assert source.reads == [0, MiB]                                   # resumed where it stopped
    assert dest.read_bytes() == data
    assert sorted(p.name for p in dest.parent.iterdir()) == [f.filename]


def test_interruption_through_the_whole_command_keeps_other_files_out(tmp_path, hf_home):
    models = tmp_path / "models"
    source = FakeSource(os.urandom(2 * MiB), fail_after=MiB // 2, error=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        dl.download("klein-9b-1024", models, source=source, progress=False, log=lambda _: None)
    assert comfy_listing(models / "diffusion_models") == []
    assert not (models / "text_encoders").exists()


def test_partial_of_another_file_version_is_discarded(tmp_path):
    f = klein_dit()
    dest = tmp_path / f.filename
    with pytest.raises(KeyboardInterrupt):
        fetch_file(f, dest, FakeSource(os.urandom(2 * MiB), fail_after=MiB), progress=False)
    newer = FakeSource(os.urandom(2 * MiB))                           # the repository changed meanwhile
    fetch_file(f, dest, newer, progress=False)
    assert newer.reads == [0] and dest.read_bytes() == newer.data


def test_wrong_hash_is_discarded(tmp_path):
    f, data = klein_dit(), os.urandom(MiB)
    dest = tmp_path / f.filename
    with pytest.raises(VerifyError, match="SHA-256"):
        fetch_file(f, dest, FakeSource(data, sha256="0" * 64), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_stream_that_ends_early_is_retried_then_kept_for_later(tmp_path):
    f, data = klein_dit(), os.urandom(MiB)

    class Short(FakeSource):
        def describe(self, f):
            self.describes += 1
            return Remote(len(self.data) + 10, None, "fake://short")   # promises more than it sends

    source = Short(data)
    with pytest.raises(NoNetwork, match="stopped after"):
        fetch_file(f, tmp_path / f.filename, source, progress=False, retries=2, sleep=lambda _: None)
    assert source.reads == [0, MiB, MiB]
    assert not (tmp_path / f.filename).exists() and dl.partial_path(tmp_path / f.filename).stat().st_size == MiB


def test_more_bytes_than_announced_is_discarded(tmp_path):
    f, data = klein_dit(), os.urandom(MiB)

    class Long(FakeSource):
        def describe(self, f):
            return Remote(len(self.data) - 10, None, "fake://long")

    with pytest.raises(VerifyError, match="more than"):
        fetch_file(f, tmp_path / f.filename, Long(data), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_source_that_cannot_resume_starts_over(tmp_path):
    f, data = klein_dit(), os.urandom(2 * MiB)
    dest = tmp_path / f.filename
    source = FakeSource(data, fail_after=MiB, honour_range=False)
    with pytest.raises(KeyboardInterrupt):
        fetch_file(f, dest, source, progress=False)
    fetch_file(f, dest, source, progress=False)
    assert dest.read_bytes() == data


def test_lost_connection_is_retried_from_where_it_stopped(tmp_path):
    f, data = klein_dit(), os.urandom(2 * MiB)
    dest = tmp_path / f.filename
    source = FakeSource(data, fail_after=MiB, error=ConnectionResetError("reset by peer"))
    waits = []
    fetch_file(f, dest, source, progress=False, retry_wait=1.0, sleep=waits.append)
    assert source.reads == [0, MiB] and waits == [1.0] and source.describes == 2
    assert dest.read_bytes() == data


def test_connection_lost_for_good_keeps_the_partial(tmp_path):
    f = klein_dit()
    dest = tmp_path / f.filename

    class Dead(FakeSource):
        def describe(self, f):
            if self.describes:
                raise NoNetwork("no route to host")
            return super().describe(f)

    with pytest.raises(NoNetwork):
        fetch_file(f, dest, Dead(os.urandom(2 * MiB), fail_after=MiB, error=ConnectionResetError()),
                   progress=False, sleep=lambda _: None)
    assert not dest.exists() and dl.partial_path(dest).stat().st_size == MiB


def test_gated_repository_says_which_licence_and_how_to_give_a_token(tmp_path, hf_home):
    class Gated(FakeSource):
        def describe(self, f):
            if f.gated:
                raise AccessDenied(f"{f.repo_id} is gated: 403 Client Error", gated=True)
            return super().describe(f)

    models = tmp_path / "models"
    report = dl.download("klein-9b-1024", models, source=Gated(os.urandom(MiB)), progress=False,
                         log=lambda _: None)
    assert [o.status for o in report.outcomes] == ["denied", "downloaded", "downloaded", "denied"]
    text = dl.explain(report)
    assert "Access refused" in text and "403" in text
    assert "https://huggingface.co/black-forest-labs/FLUX.2-klein-base-9B" in text
    assert "https://huggingface.co/black-forest-labs/FLUX.2-klein-9b-fp8" in text     # the model it renders with
    assert "FLUX Non-Commercial License" in text and "LICENSE-FLUX-NON-COMMERICAL" in text
    assert "HF_TOKEN" in text and "huggingface-cli login" in text
    assert not (models / "diffusion_models").exists()


# ---------------------------------------------------------------------------------------------
# HubSource, against a Hub look-alike on this machine


class _HubLookalike(http.server.BaseHTTPRequestHandler):
    """HEAD /<repo>/resolve/<rev>/<path> answers like the Hub for a large file: a redirect to a
    storage host (here "localhost" rather than "127.0.0.1"), the SHA-256 as X-Linked-Etag, the size
    as X-Linked-Size. GET on the storage host honours Range; the first full GET breaks off halfway."""
    files: dict = {}
    log: list = []
    broke_once: set = set()

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.log.append(("HEAD", self.headers.get("Host"), self.path, self.headers.get("Authorization")))
        match = re.match(r"^/(.+?/.+?)/resolve/([^/]+)/(.+)$", self.path)
        if match and match[1].endswith("-gated"):
            self.send_response(403)
            self.send_header("X-Error-Code", "GatedRepo")
            self.send_header("X-Error-Message", f"Access to model {match[1]} is restricted.")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = self.files.get(match[3]) if match else None
        if data is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        sha = hashlib.sha256(data).hexdigest()
        self.send_response(302)
        self.send_header("Location", f"http://localhost:{self.server.server_port}/blobs/{sha}")
        self.send_header("X-Repo-Commit", "f" * 40)
        self.send_header("X-Linked-Etag", f'"{sha}"')
        self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("ETag", '"0123"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        self.log.append(("GET", self.headers.get("Host"), self.path, self.headers.get("Authorization"),
                         self.headers.get("Range")))
        sha = self.path.rsplit("/", 1)[-1]
        if self.path.startswith("/redirect/"):                        # a Hub URL that sends you to storage
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/blobs/{sha}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = next(d for d in self.files.values() if hashlib.sha256(d).hexdigest() == sha)
        start = int(re.match(r"bytes=(\d+)-", self.headers["Range"])[1]) if self.headers.get("Range") else 0
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if start == 0 and sha not in self.broke_once:                 # the connection drops halfway
            self.broke_once.add(sha)
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(data[start:])


@pytest.fixture
def hf_online(monkeypatch):
    """huggingface_hub as if online (the process may have imported it under HF_HUB_OFFLINE=1)."""
    hf = pytest.importorskip("huggingface_hub")
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False, raising=False)
    try:  # newer huggingface_hub fetches an "agent harness" list from huggingface.co for its User-Agent
        from huggingface_hub.utils import _detect_agent
        monkeypatch.setattr(_detect_agent, "_registry", {"standardEnvVars": [], "harnesses": {}})
    except (ImportError, AttributeError):
        pass
    return hf


@pytest.fixture
def hub_lookalike(network_attempts):
    _HubLookalike.files, _HubLookalike.log, _HubLookalike.broke_once = {}, [], set()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubLookalike)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", _HubLookalike
    server.shutdown()
    server.server_close()
    assert network_attempts == []


def test_hub_source_resumes_over_http_and_keeps_the_token_on_the_hub(tmp_path, hf_online, hub_lookalike):
    endpoint, hub = hub_lookalike
    f = klein_dit()
    data = os.urandom(3 * MiB + 5)
    hub.files[f.path] = data
    source = dl.HubSource(endpoint=endpoint, token="hf_secret_test_token", timeout=10)

    remote = source.describe(f)
    assert (remote.size, remote.sha256, remote.commit) == (len(data), hashlib.sha256(data).hexdigest(), "f" * 40)
    dest = tmp_path / f.folder / f.filename
    fetch_file(f, dest, source, progress=False, sleep=lambda _: None)
    assert dest.read_bytes() == data
    gets = [entry for entry in hub.log if entry[0] == "GET"]
    assert [g[4] for g in gets] == [None, f"bytes={len(data) // 2}-"]   # broke off, resumed by range
    heads = [entry for entry in hub.log if entry[0] == "HEAD"]
    assert all(h[3] == "Bearer hf_secret_test_token" for h in heads)   # the Hub gets the token...
    assert all(g[3] is None for g in gets)                             # ...the storage host does not


def test_hub_redirects_to_storage_without_the_token(tmp_path, hf_online, hub_lookalike):
    endpoint, hub = hub_lookalike
    data = os.urandom(MiB)
    sha = hashlib.sha256(data).hexdigest()
    hub.files["x"], hub.broke_once = data, {sha}
    source = dl.HubSource(endpoint=endpoint, token="hf_secret_test_token", timeout=10)
    start, chunks = source.read(klein_dit(), Remote(len(data), sha, f"{endpoint}/redirect/{sha}"), 1000)
    assert (start, b"".join(chunks)) == (1000, data[1000:])
    assert [(g[2].split("/")[1], g[3], g[4]) for g in hub.log] == [
        ("redirect", "Bearer hf_secret_test_token", "bytes=1000-"), ("blobs", None, "bytes=1000-")]


def test_hub_source_reports_gated_and_missing_files(hf_online, hub_lookalike):
    endpoint, _ = hub_lookalike
    source = dl.HubSource(endpoint=endpoint, token=False, timeout=10)
    gated = catalog.ModelFile("dit", "x.safetensors", "org/model-gated", "x.safetensors", catalog.FLUX_NON_COMMERCIAL,
                              gated=True)
    with pytest.raises(AccessDenied) as denied:
        source.describe(gated)
    assert denied.value.gated
    with pytest.raises(dl.NotOnHub):
        source.describe(catalog.ModelFile("vae", "y.safetensors", "org/model", "nope/y.safetensors", catalog.APACHE_2))


def test_unreachable_hub_is_no_network(hf_online, network_attempts):
    with socket.socket() as probe:                                     # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(NoNetwork):
        dl.HubSource(endpoint=f"http://127.0.0.1:{port}", token=False, timeout=5).describe(klein_dit())
    with pytest.raises(NoNetwork):                                     # and a name that does not resolve
        dl.HubSource(endpoint="https://huggingface.co", token=False, timeout=5).describe(klein_dit())
    assert network_attempts == ["huggingface.co"]                       # refused here, never sent


def test_local_file_source_reads_from_an_offset(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"0123456789")
    start, chunks = LocalFileSource(path).read(klein_dit(), None, 4)
    assert (start, b"".join(chunks)) == (4, b"456789")

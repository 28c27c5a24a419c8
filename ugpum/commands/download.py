"""`python -m ugpum download`: put a profile's DiT, text encoder and VAE into ComfyUI's models/ folder.

For each file of the profile (ugpum.catalog.models), in this order:
1. already in ``models/<folder>/<name>``: nothing to do (no network);
2. in the local Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``):
   copied from there, checked against the hash the cache file is named by, without any network call;
3. otherwise fetched from the Hub: size and SHA-256 from the Hub's metadata for the file, bytes
   streamed with a progress bar into ``.<name>.part`` next to the final name, resumed from where
   that partial file ends on the next run, checked, and only then renamed to the final name. An
   interrupted or failed download never leaves a file under the name ComfyUI lists.

Without network (or with ``HF_HUB_OFFLINE=1``) the command prints one message that lists every
missing file, where it comes from and where to put it. Gated repositories (FLUX.2 [klein] 9B,
FLUX.2 [dev]) get the licence to accept and the two ways to give a token.

The byte source is injectable (`Source`): `HubSource` talks to the Hub through huggingface_hub
(imported only when needed), `LocalFileSource` reads a file on disk (the cache, or a test's file).
"""
from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import re
import shutil
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..catalog import models as catalog
from ..folders import unusable_reason
from ..catalog.models import ModelFile
from .prog import in_own_words

CHUNK = 8 * 2**20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
TOKEN_HELP = ("give a token: set HF_TOKEN=hf_... in the environment, or run `huggingface-cli login` "
              "(`hf auth login` in newer huggingface_hub); create one at https://huggingface.co/settings/tokens")


# ---------------------------------------------------------------------------------------------
# The command line that fetches a profile's files (what train, doctor and this verb tell the user to run)


def download_command(name: str, models_dir: str | Path | None = None, dtype: str | None = None) -> str:
    """The shell command that fetches a profile's or model's files."""
    cmd = f"python -m ugpum download {name}"
    if dtype:
        cmd += f" --dtype {dtype}"
    return cmd + (f" --models {models_dir}" if models_dir else " --models <ComfyUI>/models")


def missing_hint(model_id: str, present_names, dtype: str | None = None,
                 models_dir: str | Path | None = None) -> str | None:
    """None when a model's DiT (default dtype unless given), text encoder and VAE are all among
    `present_names` (ComfyUI file names, e.g. from its loaders' lists); else one sentence naming the
    missing files and the command that fetches them."""
    entry = catalog.MODELS[model_id]
    present = set(present_names)
    missing = [f for f in entry.files(dtype) if f.filename not in present]
    if not missing:
        return None
    names_ = ", ".join(f"{f.folder}/{f.filename}" for f in missing)
    return (f"{entry.title}: missing {names_}; get them with "
            f"{download_command(model_id, models_dir, dtype)}")


# ---------------------------------------------------------------------------------------------
# Errors


class DownloadError(RuntimeError):
    pass


class NoNetwork(DownloadError):
    """The Hub cannot be reached (offline mode, no route, DNS, proxy...)."""


class AccessDenied(DownloadError):
    """The Hub refused the file: a gated repository whose licence was not accepted, or no token."""

    def __init__(self, message: str, gated: bool):
        super().__init__(message)
        self.gated = gated


class NotOnHub(DownloadError):
    """The repository exists but the file (or revision) does not: the catalog needs fixing."""


class VerifyError(DownloadError):
    """The bytes received do not match the size or SHA-256 the source announced."""


class NotEnoughSpace(DownloadError):
    pass


# ---------------------------------------------------------------------------------------------
# Sources


@dataclass
class Remote:
    """What a source says about one file before sending it."""
    size: int | None              # bytes, None if unknown
    sha256: str | None            # hex digest, None if the source does not say
    url: str                      # where the bytes come from (for messages)
    commit: str | None = None     # the repository revision it was resolved at


class Source(Protocol):
    def describe(self, f: ModelFile) -> Remote: ...

    def read(self, f: ModelFile, remote: Remote, offset: int) -> tuple[int, Iterator[bytes]]:
        """(offset the bytes start at, chunks). A source that cannot seek returns 0."""


class LocalFileSource:
    """A file on disk (a Hugging Face cache blob, or a file a test provides)."""

    def __init__(self, path: str | Path, sha256: str | None = None):
        self.path = Path(path)
        self.sha256 = sha256

    def describe(self, f: ModelFile) -> Remote:
        return Remote(self.path.stat().st_size, self.sha256, str(self.path))

    def read(self, f: ModelFile, remote: Remote, offset: int) -> tuple[int, Iterator[bytes]]:
        def chunks():
            with open(self.path, "rb") as src:
                src.seek(offset)
                while block := src.read(CHUNK):
                    yield block
        return offset, chunks()


def _hf():
    try:
        import huggingface_hub
    except ImportError:
        raise NoNetwork("the huggingface_hub package is not installed (pip install huggingface_hub)")
    return huggingface_hub


def _hf_error(name: str) -> type[BaseException]:
    """An exception class of huggingface_hub by name, wherever this version keeps it."""
    import importlib
    for module in ("huggingface_hub.errors", "huggingface_hub.utils"):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if isinstance(cls, type):
            return cls
    return type(f"_Missing{name}", (Exception,), {})  # never raised by this huggingface_hub


def offline_requested() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "on", "yes", "true"}


def _is_network_failure(err: BaseException) -> bool:
    """Connection refused, DNS, timeouts, proxies: whatever HTTP stack huggingface_hub uses."""
    if isinstance(err, (ConnectionError, TimeoutError, urllib.error.URLError)):
        return True
    names = {c.__name__ for c in type(err).__mro__}
    return bool(names & {"ConnectError", "ConnectionError", "NetworkError", "TransportError", "Timeout",
                         "TimeoutException", "ConnectTimeout", "ReadTimeout", "ProxyError",
                         "RemoteProtocolError", "ReadError", "gaierror"})


class HubSource:
    """The Hugging Face Hub, through huggingface_hub for metadata and plain HTTP range requests for
    the bytes (so a partial file resumes from where it ends)."""

    def __init__(self, endpoint: str | None = None, token: str | bool | None = None, timeout: float = 20.0):
        self.endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
        self.token = token        # None: HF_TOKEN or the login stored by `huggingface-cli login`
        self.timeout = timeout

    def describe(self, f: ModelFile) -> Remote:
        if offline_requested():
            raise NoNetwork("HF_HUB_OFFLINE is set")
        hf = _hf()
        url = hf.hf_hub_url(f.repo_id, f.path, revision=f.revision, endpoint=self.endpoint)
        try:
            meta = hf.get_hf_file_metadata(url, token=self.token, timeout=self.timeout,
                                           endpoint=self.endpoint)
        except _hf_error("GatedRepoError") as err:
            raise AccessDenied(f"{f.repo_id} is gated: {_first_line(err)}", gated=True) from err
        except _hf_error("RepositoryNotFoundError") as err:
            raise AccessDenied(f"{f.repo_id}: repository not found or not accessible with the "
                               f"current token ({_first_line(err)})", gated=f.gated) from err
        except (_hf_error("EntryNotFoundError"), _hf_error("RevisionNotFoundError")) as err:
            raise NotOnHub(f"{f.repo_id} has no {f.path} at {f.revision}: {_first_line(err)}") from err
        except _hf_error("OfflineModeIsEnabled") as err:
            raise NoNetwork("HF_HUB_OFFLINE is set") from err
        except Exception as err:
            if _is_network_failure(err):
                raise NoNetwork(f"cannot reach {url}: {_first_line(err)}") from err
            raise DownloadError(f"{url}: {_first_line(err)}") from err
        etag = (meta.etag or "").strip('"').lower()
        return Remote(size=meta.size, sha256=etag if _SHA256.match(etag) else None,
                      url=meta.location or url, commit=meta.commit_hash)

    def _headers(self, url: str) -> dict[str, str]:
        # Send the token only to the Hub itself, never to the storage host a large file redirects to.
        hub = urllib.parse.urlsplit(self.endpoint or "https://huggingface.co").netloc
        if urllib.parse.urlsplit(url).netloc != hub:
            return {}
        try:
            from huggingface_hub.utils import build_hf_headers
            return dict(build_hf_headers(token=self.token))
        except Exception:
            return {}

    def read(self, f: ModelFile, remote: Remote, offset: int) -> tuple[int, Iterator[bytes]]:
        headers = self._headers(remote.url)
        if offset:
            headers["Range"] = f"bytes={offset}-"
        request = urllib.request.Request(remote.url, headers=headers)
        try:
            response = urllib.request.build_opener(_KeepTokenOnHost).open(request, timeout=self.timeout)
        except urllib.error.HTTPError as err:
            if err.code == 416 and remote.size is not None and offset >= remote.size:
                return offset, iter(())              # the partial file is already complete
            raise DownloadError(f"{remote.url}: HTTP {err.code} {err.reason}") from err
        except Exception as err:
            if _is_network_failure(err):
                raise NoNetwork(f"cannot reach {remote.url}: {_first_line(err)}") from err
            raise
        start = 0
        if response.status == 206:
            match = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
            start = int(match[1]) if match else 0

        def chunks():
            with response:
                while block := response.read(CHUNK):
                    yield block
        return start, chunks()


class _KeepTokenOnHost(urllib.request.HTTPRedirectHandler):
    """Follow redirects, but drop the Authorization header when one leads to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            for key in [k for k in new.headers if k.lower() == "authorization"]:
                del new.headers[key]
        return new


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)


# ---------------------------------------------------------------------------------------------
# The local Hugging Face cache


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, resolved from the environment as huggingface_hub does."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def find_in_hub_cache(f: ModelFile, cache_dir: Path | None = None) -> tuple[Path, str | None] | None:
    """(path, sha256) of the file in the hub cache, or None. The cache layout is
    ``models--<org>--<name>/refs/<revision>`` (a commit hash), ``snapshots/<commit>/<path>`` (a link
    to ``blobs/<etag>``); for large files the etag is the content's SHA-256."""
    repo = (cache_dir or hub_cache_dir()) / ("models--" + f.repo_id.replace("/", "--"))
    commit = f.revision
    ref = repo / "refs" / f.revision
    if ref.is_file():
        commit = ref.read_text().strip()
    path = repo / "snapshots" / commit / f.path
    if not path.is_file():
        return None
    blob_name = Path(os.path.realpath(path)).name.lower()
    return path, blob_name if _SHA256.match(blob_name) else None


# ---------------------------------------------------------------------------------------------
# One file: partial name, resume, verify, rename


def partial_path(dest: Path) -> Path:
    """Where a download in progress lives: hidden, next to the final name, with an extension that
    ComfyUI's file lists ignore."""
    return dest.with_name(f".{dest.name}.part")


def _state_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.part.json")


class _Progress:
    def __init__(self, label: str, total: int | None, initial: int, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=initial, unit="B", unit_scale=True,
                                unit_divisor=1024, desc=label, leave=True, file=sys.stderr)
            except ImportError:
                print(f"{label}: {_gb(total)}", file=sys.stderr)

    def update(self, n: int):
        if self.bar is not None:
            self.bar.update(n)

    def reset(self):
        if self.bar is not None:
            self.bar.reset()

    def close(self):
        if self.bar is not None:
            self.bar.close()


def fetch_file(f: ModelFile, dest: str | Path, source: Source, *, progress: bool = True,
               retries: int = 3, retry_wait: float = 2.0, sleep: Callable[[float], None] = time.sleep,
               log: Callable[[str], None] | None = None) -> Path:
    """Bring one file to `dest` from `source`: resumable, verified, renamed into place at the end.

    On any failure (including Ctrl-C) `dest` is untouched; a partial download stays under
    ``.<name>.part`` and the next call resumes it if the source still announces the same file.
    """
    dest = Path(dest)
    remote = source.describe(f)                     # before touching the disk: may raise NoNetwork
    dest.parent.mkdir(parents=True, exist_ok=True)
    part, state_file = partial_path(dest), _state_path(dest)
    identity = {"repo": f.repo_id, "path": f.path, "size": remote.size, "sha256": remote.sha256}

    offset = part.stat().st_size if part.is_file() else 0
    if offset and (_read_state(state_file) != identity or (remote.size is not None and offset > remote.size)):
        part.unlink()                               # a partial of some other file or revision
        offset = 0
    if remote.size is not None:
        free = shutil.disk_usage(dest.parent).free
        if free < remote.size - offset:
            raise NotEnoughSpace(f"{dest.parent}: {_gb(free)} free, {dest.name} needs "
                                 f"{_gb(remote.size - offset)} more")
    state_file.write_text(json.dumps(identity))
    if log:
        log(f"{dest}: {_gb(remote.size)}" + (f", resuming at {_gb(offset)}" if offset else ""))

    digest = hashlib.sha256()
    if offset:
        with open(part, "rb") as done:              # the hash must cover the bytes already there
            while block := done.read(CHUNK):
                digest.update(block)
    bar = _Progress(dest.name, remote.size, offset, progress)
    try:
        with open(part, "ab") as out:
            attempt = 0
            while True:
                try:
                    try:
                        start, chunks = source.read(f, remote, offset)
                    except _TRANSIENT as err:
                        raise _SourceFailed() from err
                    if start != offset:             # the source could not resume: start over
                        out.seek(0)
                        out.truncate()
                        digest, offset = hashlib.sha256(), 0
                        bar.reset()
                    for block in _source_chunks(chunks):
                        out.write(block)
                        digest.update(block)
                        offset += len(block)
                        bar.update(len(block))
                    if remote.size is not None and offset < remote.size:   # the stream ended early
                        raise _SourceFailed() from ConnectionError(
                            f"the source stopped after {offset} of {remote.size} bytes")
                    break
                except _SourceFailed as failed:
                    err = failed.__cause__
                    attempt += 1
                    if attempt > retries:
                        raise NoNetwork(f"{f.filename}: connection lost after {_gb(offset)} "
                                        f"({_first_line(err)}); run the command again to resume") from err
                    out.flush()
                    sleep(retry_wait * 2 ** (attempt - 1))
                    again = source.describe(f)      # a fresh (signed) URL for the same content
                    if (again.size, again.sha256) != (remote.size, remote.sha256):
                        raise DownloadError(f"{f.filename} changed on the source during the download; "
                                            "run the command again") from err
                    remote = again
            out.flush()
            os.fsync(out.fileno())
    finally:
        bar.close()

    return _verified_into_place(f, remote, part, state_file, dest, offset, digest.hexdigest())


def _verified_into_place(f: ModelFile, remote, part: Path, state_file: Path, dest: Path, size: int,
                         sha256: str) -> Path:
    """The finished partial renamed to `dest` when its size and hash are the source's; else discarded."""
    problem = None
    if remote.size is not None and size != remote.size:
        problem = f"got {size} bytes, more than the {remote.size} the source announced"
    elif remote.sha256 is not None and sha256 != remote.sha256:
        problem = f"SHA-256 {sha256} does not match the source's {remote.sha256}"
    if problem:
        part.unlink(missing_ok=True)
        state_file.unlink(missing_ok=True)
        raise VerifyError(f"{f.filename} from {remote.url}: {problem}; the download was discarded")
    os.replace(part, dest)
    state_file.unlink(missing_ok=True)
    return dest


# What a source may raise while sending bytes that is worth a retry from the current offset.
_TRANSIENT = (NoNetwork, ConnectionError, TimeoutError, http.client.IncompleteRead, urllib.error.URLError)


class _SourceFailed(Exception):
    """A transient failure on the source's side of the copy (never the local disk's)."""


def _source_chunks(chunks: Iterator[bytes]) -> Iterator[bytes]:
    it = iter(chunks)
    while True:
        try:
            block = next(it)
        except StopIteration:
            return
        except _TRANSIENT as err:
            raise _SourceFailed() from err
        yield block


def _read_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _gb(n: int | None) -> str:
    return "unknown size" if n is None else f"{n / 1e9:.2f} GB"


# ---------------------------------------------------------------------------------------------
# A whole profile


@dataclass
class Outcome:
    file: ModelFile
    dest: Path
    status: str                   # "present", "cached", "downloaded", "missing", "denied", "failed"
    detail: str = ""


@dataclass
class Report:
    name: str
    models_dir: Path
    outcomes: list[Outcome] = field(default_factory=list)
    offline_reason: str | None = None
    dtype: str | None = None

    @property
    def ok(self) -> bool:
        return all(o.status in ("present", "cached", "downloaded") for o in self.outcomes)


def download(name: str, models_dir: str | Path, dtype: str | None = None, source: Source | None = None,
             *, use_cache: bool = True, progress: bool = True, log: Callable[[str], None] = print,
             **fetch_options) -> Report:
    """Bring every file of a profile or model into `models_dir`; never raises for a file that
    cannot be fetched (the report says why), only for a wrong name."""
    models_dir = Path(models_dir)
    files = catalog.download_files_for(name, dtype)
    report = Report(name, models_dir, dtype=dtype)
    source = source or HubSource()
    for f in files:
        dest = f.dest(models_dir)
        if dest.is_file():
            report.outcomes.append(Outcome(f, dest, "present"))
            log(f"already there: {dest}")
            continue
        cached = find_in_hub_cache(f) if use_cache else None
        try:
            if cached:
                path, sha = cached
                log(f"copying from the Hugging Face cache ({path})")
                fetch_file(f, dest, LocalFileSource(path, sha), progress=progress, log=log, **fetch_options)
                report.outcomes.append(Outcome(f, dest, "cached", str(path)))
                continue
            if report.offline_reason:
                report.outcomes.append(Outcome(f, dest, "missing", report.offline_reason))
                continue
            fetch_file(f, dest, source, progress=progress, log=lambda text: log(f"downloading {f.url}\n  to {text}"),
                       **fetch_options)
            report.outcomes.append(Outcome(f, dest, "downloaded"))
        except NoNetwork as err:
            report.offline_reason = str(err)
            report.outcomes.append(Outcome(f, dest, "missing", str(err)))
        except AccessDenied as err:
            report.outcomes.append(Outcome(f, dest, "denied", str(err)))
        except DownloadError as err:
            report.outcomes.append(Outcome(f, dest, "failed", str(err)))
        except OSError as err:                       # this disk, not the source: its words, never a bare errno
            why = (err.strerror or str(err)).lower()
            report.outcomes.append(Outcome(f, dest, "failed", f"cannot write {err.filename or dest}: {why}; the "
                                                               "files already in place are kept"))
    return report


def explain(report: Report) -> str:
    """One message for everything that is not in place yet: what, from where, to where, and why."""
    lines: list[str] = []
    missing = [o for o in report.outcomes if o.status == "missing"]
    denied = [o for o in report.outcomes if o.status == "denied"]
    failed = [o for o in report.outcomes if o.status == "failed"]
    if missing:
        lines += [f"Could not download from the Hugging Face Hub ({report.offline_reason}).",
                  f"Get these {len(missing)} file(s) for {report.name} by hand and put them here:", ""]
        for o in missing:
            lines += _file_block(o)
    if denied:
        lines += ["", "Access refused (licence not accepted, or no token given):", ""]
        for o in denied:
            lines += _file_block(o) + [f"    why:  {o.detail}"]
    if failed:
        lines += ["", "Failed:", ""]
        for o in failed:
            lines += _file_block(o) + [f"    why:  {o.detail}"]
    gated = [o.file for o in missing + denied if o.file.gated]
    if gated:
        lines += ["", "Gated repositories: open each page below, log in, and accept the licence; then"]
        lines += [f"  {TOKEN_HELP}."]
        for f in dict.fromkeys(gated):
            lines.append(f"  {f.page}  ({f.licence.name}: {f.licence.url})")
    if missing or denied or failed:
        lines += ["", "Then run again: " + download_command(report.name, report.models_dir, report.dtype)
                  + " (files already in place are kept; a partial download resumes)."]
    return "\n".join(lines).strip()


def _file_block(o: Outcome) -> list[str]:
    f = o.file
    note = f" ({f.licence.name}" + ("; gated: accept the licence at " + f.page if f.gated else "") + ")"
    return [f"  {catalog.ROLE_NAMES[f.role]}: {f.filename}{note}",
            f"    from: {f.url}",
            f"    to:   {o.dest}"]


# ---------------------------------------------------------------------------------------------
# CLI


def default_models_dir() -> Path | None:
    """ComfyUI's models/ folder when it can be known without guessing: ``$COMFYUI_PATH/models``, or
    the ComfyUI this pack is installed in (``ComfyUI/custom_nodes/<pack>/ugpum``)."""
    env = os.environ.get("COMFYUI_PATH")
    if env and (Path(env) / "main.py").is_file():
        return Path(env).expanduser() / "models"
    here = Path(__file__).resolve().parent            # .../custom_nodes/<pack>/ugpum
    root = here.parent.parent.parent
    if here.parent.parent.name == "custom_nodes" and (root / "main.py").is_file():
        return root / "models"
    return None


def add_download_parser(sub) -> None:
    p = sub.add_parser("download", help="fetch a profile's DiT, text encoder and VAE into ComfyUI's models/",
                       description="Fetch the files a profile or model needs into a ComfyUI models/ folder "
                                   "(diffusion_models/, text_encoders/, vae/). Known: "
                                   + ", ".join(catalog.names()))
    p.add_argument("name", nargs="?", metavar="PROFILE_OR_MODEL", help="e.g. klein-9b-1024 or flux2-dev")
    p.add_argument("--models", metavar="DIR", help="ComfyUI's models/ folder (default: $COMFYUI_PATH/models, "
                                                    "or the ComfyUI this pack is installed in)")
    p.add_argument("--dtype", choices=catalog.DTYPES, help="DiT weights: the 16-bit file or fp8 "
                                                           "(default: the profile's or model's)")
    p.add_argument("--list", action="store_true", help="list the files and their sources; download nothing")
    p.add_argument("--json", action="store_true", help="with --list: the files each profile and model (or the one "
                                                       "named) would write, as JSON (paths relative to the models/ "
                                                       "folder)")
    p.add_argument("--comfyui", metavar="DIR", help="the ComfyUI that will train on the files (default: the one "
                                                    "train uses: $COMFYUI_PATH, the ComfyUI around --models, ...); "
                                                    "one that cannot load the model is refused before any download")
    p.add_argument("--no-cache", action="store_true", help="do not copy from the local Hugging Face cache")


def run_download(args) -> int:
    if args.list or not args.name:
        try:
            if args.json:
                listed = planned_files(args.name, args.dtype) if args.name else \
                    {"profiles_and_models": [planned_files(name) for name in catalog.names()]}
                print(json.dumps(listed, indent=1))
            else:
                print(in_own_words(format_catalog(args.name)))
        except catalog.UnknownName as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    models = Path(args.models).expanduser() if args.models else default_models_dir()
    if models is None:
        print("error: give ComfyUI's models folder with --models DIR (or set COMFYUI_PATH)", file=sys.stderr)
        return 2
    try:
        check_comfyui(args.name, args.comfyui, models)
        unwritable = unwritable_models(args.name, models, args.dtype)
        if unwritable:                               # before any copy or download, and before advice to put files there
            print(f"error: {unwritable}", file=sys.stderr)
            return 2
        report = download(args.name, models, args.dtype, use_cache=not args.no_cache,
                          progress=sys.stderr.isatty())
    except catalog.UnknownName as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if report.ok:
        print(f"{report.name}: all {len(report.outcomes)} files are in {models}")
        return 0
    print(in_own_words(explain(report)), file=sys.stderr)
    return 1


def check_comfyui(name: str, comfyui: str | None, models: Path) -> None:
    """Before any byte is fetched: refuse (one sentence with the fix) when the ComfyUI that would train on
    these files (`train`'s, for the same --models) cannot load the model's text encoder. Without any
    ComfyUI here the files are fetched for the user's ComfyUI elsewhere; with every file in place, there is
    nothing to refuse."""
    from ..arch import get_spec
    from .bridge import comfy_bridge
    entry, _ = catalog.resolve(name)
    if all(f.dest(models).is_file() for f in catalog.download_files_for(name)):
        return
    bridge = comfy_bridge()
    found = bridge.locate_comfyui(comfyui, models)
    if found is not None:
        bridge.check_comfyui_for(found, get_spec(entry.id))


def unwritable_models(name: str, models: Path, dtype: str | None = None) -> str:
    """'' when every file of `name` missing from `models` can be written there, else one sentence naming
    the folder, why not and the fix (files already there need no writing: a read-only folder holding
    them all is fine)."""
    for f in catalog.download_files_for(name, dtype):
        dest = f.dest(models)
        if dest.is_file():
            continue
        reason = unusable_reason(dest.parent)
        if reason:
            return (f"--models {models}: {reason}, so {f.folder}/{f.filename} cannot be put there; give --models a "
                    "ComfyUI models folder you can write in, or make this one writable")
    return ""


def planned_files(name: str, dtype: str | None = None) -> dict:
    """What `download NAME` would write, for scripts and tests: each file's path relative to the
    models/ folder, its role, whether it trains or renders, its source and licence."""
    entry, profile = catalog.resolve(name)
    training = catalog.files_for(name, dtype)
    files = []
    for f in catalog.download_files_for(name, dtype):
        files.append({"path": f"{f.folder}/{f.filename}", "role": f.role,
                      "use": "train" if f in training else "render", "url": f.url, "gated": f.gated,
                      "licence": f.licence.name, "commercial_use": f.licence.commercial})
    return {"name": name, "model": entry.id, "dtype": dtype or (profile.dtype if profile else entry.default_dtype),
            "files": files}


def format_catalog(name: str | None = None) -> str:
    """The catalog (or one profile's or model's part of it) with each file's source."""
    chosen = catalog.resolve(name)[0] if name else None
    lines = []
    for profile in catalog.PROFILES.values():
        if name in (None, profile.id):
            lines.append(f"profile {profile.id}: {profile.model}, {profile.dtype}, {profile.width}x{profile.height}"
                         f"  (training profile (python -m ugpum train --profile {profile.id}))")
    for entry in catalog.MODELS.values():
        if chosen is not None and entry is not chosen:
            continue
        lines.append(f"\n{entry.id}: {entry.title} (default dtype {entry.default_dtype})")
        dit_licence = entry.all_files()[0].licence
        lines.append(f"  weights licence: {dit_licence.name}"
                     + ("" if dit_licence.commercial else " (non-commercial use only)") + f" {dit_licence.url}")
        render = entry.render_file()
        if render is not None:
            lines.append(f"  LoRAs train on this base model; the workflow renders with {render.filename}")
        for f in entry.all_files() + ([render] if render is not None else []):
            tag = next((d for d, x in entry.dit.items() if x is f), "") if f.role == "dit" else ""
            tag = "render" if f is render else tag
            lines.append(f"  {f.folder + '/' + f.filename:<58} {tag:<6} {f.url}"
                         + ("  [gated]" if f.gated else ""))
    return "\n".join(lines).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ugpum.commands.download")
    add_download_parser(parser.add_subparsers(dest="command", required=True))
    return run_download(parser.parse_args(["download", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    sys.exit(main())

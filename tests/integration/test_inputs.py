"""Every input is checked before work starts (issue 15), through the real command line (`main`, in this
process where a refusal comes before any work; in child processes where the process itself matters: the
umask, argparse's exit, an unwritable --out): damaged model files, bad images, settings out of range, an
output folder that cannot be written. Each refusal is one sentence naming the file or setting, with no traceback and nothing
written. Also: what the pack writes honours the umask, every image is decoded once, and a plan that
nothing simple fits names what would."""
from __future__ import annotations

import io
import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from comfy_bridge import find_comfyui
from support.cli_run import main_here
from ugpum.commands import main
from ugpum.formats.atomic import atomic_path
from ugpum.train.dataset import load_bucketed_image, load_image_folder

REPO = Path(__file__).resolve().parents[2]
DATASET = REPO / "demo_datasets" / "loranne"
BASE = ["--profile", "tiny-flux2", "--devices", "cpu", "--sample-every", "0", "--steps", "2"]
needs_comfyui = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")


def cli(*args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    """`python -m ugpum ARGS` in a child process."""
    return subprocess.run([sys.executable, "-m", "ugpum", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          preexec_fn=None if umask is None else (lambda: os.umask(umask)))


def assert_one_sentence(rc: int, stdout: str, stderr: str, *named: str) -> str:
    """Exit code 2 and one line on stderr, 'error: ...', naming each of `named`; no traceback."""
    assert "Traceback" not in stdout + stderr, stdout + stderr
    assert rc == 2, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for name in named:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def assert_nothing_written(out: Path) -> None:
    """The run wrote nothing: no folder, or (the engine makes it first) an empty one."""
    assert not out.exists() or not any(out.rglob("*")), sorted(out.rglob("*"))


# ------------------------------------------------------------------------ building bad inputs

def split_file(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join_file(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def truncated(good: Path, bad: Path) -> list[str]:
    header, data = split_file(good)
    cut = len(data) - 1000
    first_cut = next(k for k in by_offset(header) if header[k]["data_offsets"][1] > cut)
    join_file(bad, header, data[:cut])
    return [str(bad), repr(first_cut), "truncated"]


TENSOR = "double_blocks.0.img_attn.qkv.weight"


def shape_disagrees(good: Path, bad: Path) -> list[str]:
    header, data = split_file(good)
    header[TENSOR]["shape"][0] += 1                              # the offsets still span the old shape
    join_file(bad, header, data)
    return [str(bad), repr(TENSOR), "data_offsets"]


def overlapping(good: Path, bad: Path) -> list[str]:
    header, data = split_file(good)
    header[TENSOR]["data_offsets"] = [o - 4 for o in header[TENSOR]["data_offsets"]]
    join_file(bad, header, data)
    return [str(bad), repr(TENSOR), "overlaps"]


def absurd_size(good: Path, bad: Path) -> list[str]:
    header, data = split_file(good)
    begin = header[TENSOR]["data_offsets"][0]
    header[TENSOR].update(shape=[2**40, 2**40], data_offsets=[begin, begin + 4 * 2**80])    # 4 YiB of F32
    join_file(bad, header, data)
    return [str(bad), repr(TENSOR), "holds only"]


def absurd_header_length(good: Path, bad: Path) -> list[str]:
    bad.write_bytes(struct.pack("<Q", 2**62) + good.read_bytes()[8:])
    return [str(bad), "header length"]


DEFECTS = {"truncated": truncated, "shape-disagrees": shape_disagrees, "overlapping": overlapping,
           "absurd-size": absurd_size, "absurd-header-length": absurd_header_length}


def png_claiming(path: Path, width: int, height: int) -> None:
    """A 1x1 PNG whose header (IHDR, its CRC recomputed) claims width x height: a valid header, a few
    bytes of data, what a decompression bomb looks like before decoding."""
    buf = io.BytesIO()
    Image.new("1", (1, 1)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    path.write_bytes(bytes(data))


def noise_image(size=(64, 48), seed: int = 0) -> Image.Image:
    w, h = size
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def cut_file(path: Path, fmt: str) -> None:
    buf = io.BytesIO()
    noise_image().save(buf, fmt)
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) * 2 // 3])


IMAGES = {
    "decompression-bomb": ("bomb.png", lambda p: png_claiming(p, 30000, 30000), "decompression bomb"),
    "over-64-megapixels": ("huge.png", lambda p: png_claiming(p, 9000, 9000), "9000x9000"),
    "4x4": ("speck.png", lambda p: Image.new("RGB", (4, 4)).save(p), "4x4"),
    "truncated-jpeg": ("cut.jpg", lambda p: cut_file(p, "JPEG"), "truncated"),
    "truncated-png": ("cut.png", lambda p: cut_file(p, "PNG"), "cut short or damaged"),
}


# ------------------------------------------------------------------------ the refusals, run at once

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, comfy) -> Path:
    """A real tiny FLUX.2 file: ComfyUI's own module's state dict, seeded random values."""
    import torch
    from safetensors.torch import save_file

    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    path = tmp_path_factory.mktemp("model") / "tiny-flux2.safetensors"
    save_file({k: v.contiguous() for k, v in build_random(get_spec("tiny-flux2"), torch.float32).state_dict().items()},
              str(path))
    return path


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, tiny_model) -> dict[str, tuple[subprocess.CompletedProcess, list[str], Path]]:
    """Every refused command line of this module: case -> (finished run, what its sentence must name,
    its --out)."""
    root = tmp_path_factory.mktemp("refusals")
    cases: dict[str, tuple[list[str], list[str], Path]] = {}
    for case, damage in DEFECTS.items():
        named = damage(tiny_model, root / f"{case}.safetensors")
        out = root / f"out-{case}"
        cases[f"model-{case}"] = (["--dataset", str(DATASET), "--model", str(root / f"{case}.safetensors"),
                                   "--out", str(out)], named, out)
    for case, (name, make, said) in IMAGES.items():
        folder = root / f"images-{case}"
        folder.mkdir()
        make(folder / name)
        (folder / name).with_suffix(".txt").write_text("loranne")
        out = root / f"out-{case}"
        cases[f"image-{case}"] = (["--dataset", str(folder), "--out", str(out)], [str(folder / name), said], out)
    in_the_way = root / "a-file"
    in_the_way.write_text("not a folder")
    cases["out-under-a-file"] = (["--dataset", str(DATASET), "--out", str(in_the_way / "run")],
                                 ["--out", str(in_the_way), "is a file"], in_the_way / "run")
    cases["out-is-a-file"] = (["--dataset", str(DATASET), "--out", str(in_the_way)],
                              ["--out", str(in_the_way), "is a file, not a folder"], root / "nothing")
    config = root / "huge.toml"
    config.write_text("resolution = 100000\n")
    cases["config-resolution-100000"] = (["--dataset", str(DATASET), "--config", str(config),
                                          "--out", str(root / "out-config")],
                                         ["setting 'resolution' = 100000", "4096"], root / "out-config")
    return {case: (main_here("train", *BASE, *args), named, out) for case, (args, named, out) in cases.items()}


@needs_comfyui
@pytest.mark.parametrize("case", [f"model-{c}" for c in DEFECTS])
def test_a_damaged_model_file_is_named_before_any_work(refusals, case):
    """Found by the header check (against the file's size) before the dataset, the cache or the model."""
    done, named, out = refusals[case]
    assert_one_sentence(done.returncode, done.stdout, done.stderr, *named)
    assert not out.exists()                                       # no cache, no run folder


@needs_comfyui
@pytest.mark.parametrize("case", [f"image-{c}" for c in IMAGES])
def test_a_bad_image_is_named_before_any_work(refusals, case):
    """From the image's header alone: nothing is decoded, cached or trained."""
    done, named, out = refusals[case]
    assert_one_sentence(done.returncode, done.stdout, done.stderr, *named)
    assert_nothing_written(out)


@needs_comfyui
@pytest.mark.parametrize("case", ["out-under-a-file", "out-is-a-file", "config-resolution-100000"])
def test_an_unusable_out_or_setting_is_named_before_any_work(refusals, case):
    done, named, out = refusals[case]
    assert_one_sentence(done.returncode, done.stdout, done.stderr, *named)
    assert not out.exists()


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder this user cannot write in: mode 0500, or for root (whom modes do not stop) a read-only
    tmpfs; skipped where neither can be had."""
    folder = tmp_path / "locked"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o500)
        yield folder
        folder.chmod(0o700)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"running as root and cannot mount a read-only tmpfs: {done.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_an_unwritable_out_gets_the_fix_before_any_work(read_only_folder):
    done = cli("train", *BASE, "--dataset", str(DATASET), "--out", str(read_only_folder / "run"))
    line = assert_one_sentence(done.returncode, done.stdout, done.stderr, f"--out {read_only_folder / 'run'}",
                               str(read_only_folder))
    assert "read-only filesystem" in line or "permission denied" in line, line
    assert "give --out a folder" in line
    assert not (read_only_folder / "run").exists()


# ------------------------------------------------------------------------ settings (the same code in-process)

@pytest.mark.parametrize("toml, args, named", [
    ('resolution = "1024"', [], "setting 'resolution' = '1024': must be a whole number"),
    ("resolution = 100000", [], "setting 'resolution' = 100000: must be a multiple of 16 from 64 to 4096"),
    ("resolution = 1000", [], "setting 'resolution' = 1000: must be a multiple of 16"),
    ("rank = 128", [], "setting 'rank' = 128: must be at most 64, the smallest layer a LoRA on tiny-flux2 adapts"),
    ("rank = 2.5", [], "setting 'rank' = 2.5: must be a whole number"),
    ("batch = true", [], "setting 'batch' = True: must be a whole number"),
    ("", ["--steps", "0"], "setting 'steps' = 0: must be from 1 to"),
    ("", ["--batch", "0"], "setting 'batch' = 0: must be from 1 to 256"),
    ("batch = 1000", [], "setting 'batch' = 1000: must be from 1 to 256"),
    ('lr = "1e-4"', [], "setting 'lr' = '1e-4': must be a finite number"),
    ("lr = 0", [], "setting 'lr' = 0: must be in (0, 1]"),
    ("lr = nan", [], "setting 'lr' = nan: must be a finite number"),
    ("seed = -1", [], "setting 'seed' = -1: must be from 0 to"),
    ("seed = 1.5", [], "setting 'seed' = 1.5: must be a whole number"),
    ("", ["--frames", "5"], "setting 'frames' = 5"),                        # an image model: one frame
    ("[train]\nmodel = \"tiny-wan\"\nframes = 4", [], "setting 'frames' = 4"),   # Wan: 4k+1
    ("frames = 1001\nmodel = \"tiny-wan\"", [], "setting 'frames' = 1001: at most 257"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 and "\n" not in v else None)
def test_settings_are_type_and_range_checked_against_the_model(tmp_path, capsys, toml, args, named):
    """From the command line and from a TOML config; the nodes pass the same TrainConfig.validate."""
    config = tmp_path / "config.toml"
    config.write_text(toml + "\n")
    out = tmp_path / "run"
    rc = main(["train", *BASE, "--dataset", str(DATASET), "--config", str(config), *args, "--out", str(out)])
    captured = capsys.readouterr()
    line = assert_one_sentence(rc, captured.out, captured.err, named)
    assert "Error" not in line and not out.exists()


def test_a_wrongly_typed_flag_is_refused_by_name():
    done = cli("train", *BASE, "--dataset", str(DATASET), "--steps", "ten", "--out", "/nonexistent/run")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "argument --steps: invalid int value: 'ten'" in done.stderr


# ------------------------------------------------------------------------ what the pack writes

@needs_comfyui
def test_every_file_a_run_writes_honours_the_umask(tmp_path):
    """LoRA, checkpoints, feature caches, metrics and plan: 0644 under umask 022 (safetensors alone
    would write 0600, which a ComfyUI running as another user cannot read)."""
    out = tmp_path / "run"
    done = cli("train", *BASE, "--dataset", str(DATASET), "--out", str(out), umask=0o022)
    assert done.returncode == 0, done.stdout + done.stderr
    files = [p for p in out.rglob("*") if p.is_file()]
    kinds = {p.relative_to(out).parts[0] for p in files}
    assert {"ugpum_lora.safetensors", "checkpoints", "cache", "metrics.jsonl", "plan.json"} <= kinds, kinds
    modes = {str(p.relative_to(out)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {"0o644"}, modes


def test_atomic_writes_take_the_mode_the_umask_gives(tmp_path):
    import torch
    from safetensors.torch import save_file
    before = os.umask(0o027)
    try:
        with atomic_path(tmp_path / "lora.safetensors") as tmp:
            save_file({"a": torch.zeros(2)}, str(tmp))                # safetensors itself writes 0600
    finally:
        os.umask(before)
    assert (tmp_path / "lora.safetensors").stat().st_mode & 0o777 == 0o640


# ------------------------------------------------------------------------ images are decoded once

def test_each_image_is_decoded_once(tmp_path, monkeypatch):
    """Listing the dataset reads headers only; the pixels are decoded when the latent is made. Counted
    at Pillow's decoder (ImageFile.load with data still to decode), for each format the dataset takes."""
    for i, fmt in enumerate(["png", "jpg", "webp", "bmp"]):
        noise_image(seed=i).save(tmp_path / f"{fmt}.{fmt}")
        (tmp_path / f"{fmt}.txt").write_text("loranne")
    Image.open(tmp_path / "jpg.jpg").save(tmp_path / "turned.jpg", exif=_exif_turned())   # EXIF-rotated
    (tmp_path / "turned.txt").write_text("loranne")
    decoded: list[str] = []
    load = ImageFile.ImageFile.load

    def counting_load(image):
        if image.tile:                                            # something left to decode
            decoded.append(Path(image.filename).name)
        return load(image)
    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    items = load_image_folder(tmp_path, resolution=64)
    assert decoded == [] and len(items) == 5
    turned = next(i for i in items if i.path.name == "turned.jpg")
    assert turned.bucket[0] < turned.bucket[1]                    # a 64x48 picture turned upright
    for item in items:
        assert load_bucketed_image(item).shape[1:] == (item.bucket[1], item.bucket[0])
    assert sorted(decoded) == sorted(i.path.name for i in items)


def _exif_turned() -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = 6                                              # rotate 90 degrees to display
    return exif


# ------------------------------------------------------------------------ a plan nothing simple fits

@pytest.mark.parametrize("args", [
    ["--model", "flux2-klein-9b", "--gpu", "4GiB", "--dtype", "fp8"],
    ["--model", "flux2-klein-9b", "--gpu", "3GiB", "--gpu", "3GiB", "--dtype", "fp8"],
], ids=["one-gpu", "two-gpus"])
def test_nothing_simple_fits_names_the_smallest_gpu_that_would(capsys, args):
    assert main(["plan", *args]) == 2
    line = assert_one_sentence(2, *capsys.readouterr())
    found = re.search(r"Nothing simple would fit: (a GPU|2 GPUs) with (\d+) GiB( each)? would \(--gpu (\d+)GiB", line)
    assert found, line
    gib = int(found[2])
    count = args.count("--gpu")
    rest = [a for a in args if a not in ("--gpu", "4GiB", "3GiB")]
    assert main(["plan", *rest, *["--gpu", f"{gib}GiB"] * count]) == 0                 # that size fits
    assert main(["plan", *rest, *["--gpu", f"{gib - 1}GiB"] * count]) == 2             # 1 GiB less does not
    capsys.readouterr()


def test_nothing_fits_at_any_size_names_the_settings_that_would(capsys):
    args = ["--model", "flux2-dev", "--resolution", "2048", "--batch", "4", "--recompute", "none"]
    assert main(["plan", *args, "--gpu", "4GiB"]) == 2
    line = assert_one_sentence(2, *capsys.readouterr())
    found = re.search(r"with fp8 weights \(--dtype fp8\), every block recomputed in backward \(--recompute all\), "
                      r"batch 1 \(--batch 1\), resolution 512 \(--resolution 512\), a GPU with (\d+) GiB would", line)
    assert found and "not even a GPU with 512 GiB" in line, line
    gib = int(found[1])
    lean = ["--model", "flux2-dev", "--resolution", "512", "--batch", "1", "--recompute", "all", "--dtype", "fp8"]
    assert main(["plan", *lean, "--gpu", f"{gib}GiB"]) == 0
    assert main(["plan", *lean, "--gpu", f"{gib - 1}GiB"]) == 2
    capsys.readouterr()

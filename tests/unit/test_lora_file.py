"""LoRA safetensors in ComfyUI's key format, atomic writes and the dataset hash."""

import contextlib
import json
import resource
from pathlib import Path

import pytest
import safetensors
import torch
from PIL import Image
from safetensors.torch import save_file

from ugpum.formats.atomic import atomic_path, write_json_atomic
from ugpum.formats.lora_file import LoraFileError, load_lora, lora_metadata, save_lora
from ugpum.train.cache import dataset_hash
from ugpum.train.dataset import ImageItem

MODULES = ["double_blocks.0.img_attn.qkv", "single_blocks.7.linear1", "blocks.12.self_attn.q"]


def lora_pairs(rank=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        m: (torch.randn(rank, 32 + i, generator=g), torch.randn(48 + i, rank, generator=g))
        for i, m in enumerate(MODULES)
    }


def raw_file(path):
    with safetensors.safe_open(str(path), framework="pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, handle.metadata()


def leftovers(folder: Path, final_name: str):
    return sorted(p.name for p in folder.iterdir() if p.name != final_name)


# ---------------------------------------------------------------- save format


def test_save_writes_comfyui_keys_with_alpha(tmp_path):
    path = save_lora(tmp_path / "my.safetensors", lora_pairs(), rank=4, alpha=2.0, dtype=torch.float32)
    tensors, metadata = raw_file(path)
    expected = set()
    for m in MODULES:
        expected |= {f"diffusion_model.{m}.lora_A.weight", f"diffusion_model.{m}.lora_B.weight", f"diffusion_model.{m}.alpha"}
    assert set(tensors) == expected
    a = tensors["diffusion_model.single_blocks.7.linear1.lora_A.weight"]
    b = tensors["diffusion_model.single_blocks.7.linear1.lora_B.weight"]
    alpha = tensors["diffusion_model.single_blocks.7.linear1.alpha"]
    assert a.shape == (4, 33) and b.shape == (49, 4) and a.dtype == torch.float32
    assert alpha.ndim == 0 and alpha.item() == 2.0
    assert torch.equal(a, lora_pairs()["single_blocks.7.linear1"][0])
    assert metadata["modelspec.sai_model_spec"] == "1.0.0"
    assert metadata["ugpum.rank"] == "4" and float(metadata["ugpum.alpha"]) == 2.0
    assert "modelspec.date" in metadata and metadata["ugpum.trainer_version"].startswith("ugpum")
    assert leftovers(tmp_path, "my.safetensors") == []


def test_save_bf16_by_default_keeps_alpha_exact(tmp_path):
    path = save_lora(tmp_path / "l.safetensors", lora_pairs(), rank=4, alpha=0.3)
    tensors, _ = raw_file(path)
    assert tensors["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"].dtype == torch.bfloat16
    assert tensors["diffusion_model.double_blocks.0.img_attn.qkv.alpha"].dtype == torch.float32
    assert tensors["diffusion_model.double_blocks.0.img_attn.qkv.alpha"].item() == pytest.approx(0.3)


def test_metadata_from_lora_metadata_is_stored(tmp_path):
    meta = lora_metadata(
        architecture="Flux.2-klein-9b/lora",
        base_model="flux-2-klein-base-9b",
        title="my cat",
        implementation="https://github.com/black-forest-labs/flux2",
        target_modules=["single_blocks.7.linear1", "double_blocks.0.img_attn.qkv", "single_blocks.7.linear1"],
        steps=500,
        resolution=(1024, 768),
        dataset_hash="abc123",
        date="2026-01-01T00:00:00+00:00",
    )
    path = save_lora(tmp_path / "l.safetensors", lora_pairs(), rank=4, alpha=4, metadata=meta)
    _, stored = raw_file(path)
    assert stored["modelspec.architecture"] == "Flux.2-klein-9b/lora"
    assert stored["modelspec.implementation"] == "https://github.com/black-forest-labs/flux2"
    assert stored["modelspec.title"] == "my cat"
    assert stored["modelspec.date"] == "2026-01-01T00:00:00+00:00"
    assert stored["ugpum.base_model"] == "flux-2-klein-base-9b"
    assert json.loads(stored["ugpum.target_modules"]) == ["double_blocks.0.img_attn.qkv", "single_blocks.7.linear1"]
    assert stored["ugpum.steps"] == "500" and json.loads(stored["ugpum.resolution"]) == [1024, 768]
    assert stored["ugpum.dataset_hash"] == "abc123" and stored["ugpum.rank"] == "4"


def test_save_accepts_flat_comfyui_dict(tmp_path):
    flat = {}
    for m, (a, b) in lora_pairs().items():
        flat[f"diffusion_model.{m}.lora_A.weight"] = a
        flat[f"diffusion_model.{m}.lora_B.weight"] = b
        flat[f"diffusion_model.{m}.alpha"] = torch.tensor(8.0)
    path = save_lora(tmp_path / "flat.safetensors", flat, rank=4, alpha=8, dtype=torch.float32)
    loaded, _ = load_lora(path)
    assert set(loaded) == set(MODULES)
    assert torch.equal(loaded[MODULES[0]]["A"], lora_pairs()[MODULES[0]][0])
    with pytest.raises(LoraFileError, match="alpha"):
        save_lora(tmp_path / "other.safetensors", flat, rank=4, alpha=2)


@pytest.mark.parametrize(
    "tensors, kwargs, message",
    [
        ({"m": (torch.zeros(4, 8), torch.zeros(8, 4))}, {"rank": 8}, "rank 4, expected 8"),
        ({"m": (torch.zeros(4, 8), torch.zeros(8, 3))}, {"rank": 4}, "A must be \\[rank, in\\]"),
        ({"m": (torch.zeros(4, 8, 1), torch.zeros(8, 4))}, {"rank": 4}, "A must be"),
        ({"m": (torch.zeros(4, 8),)}, {"rank": 4}, "expected \\(A, B\\)"),
        ({"m": (torch.zeros(4, 8), torch.zeros(8, 4))}, {"rank": 4, "dtype": torch.float16}, "dtype"),
        ({"m": (torch.zeros(4, 8), torch.zeros(8, 4))}, {"rank": 4, "metadata": {"steps": 5}}, "steps"),
        ({}, {"rank": 4}, "no tensors"),
        ({"diffusion_model.m.lora_A.weight": torch.zeros(4, 8)}, {"rank": 4}, "lacks its lora_A or lora_B"),
        ({"diffusion_model.m.weight": torch.zeros(4, 8)}, {"rank": 4}, "not a LoRA key"),
    ],
)
def test_save_rejects_bad_input_and_writes_nothing(tmp_path, tensors, kwargs, message):
    with pytest.raises(LoraFileError, match=message) as caught:
        save_lora(tmp_path / "bad.safetensors", tensors, alpha=1.0, **kwargs)
    assert "bad.safetensors" in str(caught.value)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- atomic save


@contextlib.contextmanager
def file_size_limit(size: int):
    """This process may write files of at most `size` bytes (a real RLIMIT_FSIZE: writes past it fail with
    EFBIG, as Python ignores SIGXFSZ), for the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_failure_mid_write_leaves_no_file(tmp_path):
    with file_size_limit(1000), pytest.raises(OSError, match="would be larger than this system lets a process write"):
        save_lora(tmp_path / "l.safetensors", lora_pairs(), rank=4, alpha=4)     # the header fits, the tensors not
    assert list(tmp_path.iterdir()) == []


def test_failure_keeps_the_previous_file(tmp_path):
    path = save_lora(tmp_path / "l.safetensors", lora_pairs(seed=1), rank=4, alpha=4, dtype=torch.float32)
    before = path.read_bytes()
    with file_size_limit(1000), pytest.raises(OSError):
        save_lora(path, lora_pairs(seed=2), rank=4, alpha=4)
    assert path.read_bytes() == before
    assert leftovers(tmp_path, "l.safetensors") == []


def test_tensor_that_cannot_be_saved_leaves_no_file(tmp_path):
    pairs = lora_pairs()
    pairs["blocks.12.self_attn.q"] = (torch.empty(4, 34, device="meta"), torch.empty(50, 4, device="meta"))
    with pytest.raises(Exception):
        save_lora(tmp_path / "l.safetensors", pairs, rank=4, alpha=4)
    assert list(tmp_path.iterdir()) == []


def test_atomic_path_success_and_failure(tmp_path):
    final = tmp_path / "out.bin"
    with atomic_path(final) as temp:
        assert temp.parent == tmp_path and temp != final
        temp.write_bytes(b"complete")
        assert not final.exists()  # nothing under the final name until the end
    assert final.read_bytes() == b"complete"
    assert leftovers(tmp_path, "out.bin") == []

    with pytest.raises(KeyboardInterrupt):
        with atomic_path(final) as temp:
            temp.write_bytes(b"half")
            raise KeyboardInterrupt
    assert final.read_bytes() == b"complete"
    assert leftovers(tmp_path, "out.bin") == []


def test_atomic_path_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        with atomic_path(tmp_path / "no_such_dir" / "x.json"):
            pass
    with pytest.raises(FileNotFoundError, match=r"nothing was written for .*x\.json"):
        with atomic_path(tmp_path / "x.json"):
            pass
    assert list(tmp_path.iterdir()) == []


def test_write_json_atomic(tmp_path):
    path = tmp_path / "state.json"
    write_json_atomic(path, {"step": 3, "name": "käse"})
    assert json.loads(path.read_text(encoding="utf-8")) == {"step": 3, "name": "käse"}
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object()})
    assert json.loads(path.read_text(encoding="utf-8"))["step"] == 3
    assert leftovers(tmp_path, "state.json") == []


# ---------------------------------------------------------------- load


def test_round_trip(tmp_path):
    pairs = lora_pairs()
    path = save_lora(tmp_path / "l.safetensors", pairs, rank=4, alpha=1.5, metadata={"ugpum.steps": "9"}, dtype=torch.float32)
    loaded, metadata = load_lora(path)
    assert set(loaded) == set(MODULES)
    for m, (a, b) in pairs.items():
        assert torch.equal(loaded[m]["A"], a) and torch.equal(loaded[m]["B"], b)
        assert loaded[m]["alpha"] == 1.5
    assert metadata["ugpum.steps"] == "9"


def test_load_down_up_names_and_missing_alpha(tmp_path):
    path = tmp_path / "downup.safetensors"
    save_file(
        {
            "diffusion_model.single_blocks.7.linear1.lora_down.weight": torch.ones(8, 16),
            "diffusion_model.single_blocks.7.linear1.lora_up.weight": torch.ones(32, 8),
        },
        str(path),
    )
    loaded, metadata = load_lora(path)
    assert loaded["single_blocks.7.linear1"]["A"].shape == (8, 16)
    assert loaded["single_blocks.7.linear1"]["B"].shape == (32, 8)
    assert loaded["single_blocks.7.linear1"]["alpha"] == 8.0  # no alpha: scale 1
    assert metadata == {}


def kohya_file(tmp_path):
    path = tmp_path / "kohya.safetensors"
    save_file(
        {
            "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.ones(2, 16),
            "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.ones(24, 2),
            "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(1.0),
        },
        str(path),
    )
    return path


def test_load_kohya_names_with_known_modules(tmp_path):
    known = ["double_blocks.0.img_attn.qkv", "double_blocks.0.img_attn.proj", "single_blocks.0.linear1"]
    loaded, _ = load_lora(kohya_file(tmp_path), known_modules=known)
    assert list(loaded) == ["double_blocks.0.img_attn.qkv"]
    assert loaded["double_blocks.0.img_attn.qkv"]["alpha"] == 1.0


def test_load_kohya_names_errors(tmp_path):
    path = kohya_file(tmp_path)
    with pytest.raises(LoraFileError, match=r"kohya\.safetensors.*pass known_modules"):
        load_lora(path)
    with pytest.raises(LoraFileError, match=r"kohya\.safetensors.*matches no module"):
        load_lora(path, known_modules=["single_blocks.0.linear1"])
    with pytest.raises(LoraFileError, match="same with underscores"):
        load_lora(path, known_modules=["double_blocks.0.img_attn.qkv", "double_blocks.0.img_attn_qkv"])


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({"diffusion_model.m.lora_A.weight": torch.ones(2, 4)}, "m' lacks"),
        ({"diffusion_model.m.lora_A.weight": torch.ones(2, 4), "diffusion_model.m.lora_B.weight": torch.ones(4, 3)}, "A must be"),
        ({"diffusion_model.m.lora_A.weight": torch.ones(2, 4), "diffusion_model.m.lora_down.weight": torch.ones(2, 4)}, "twice"),
        ({"transformer.m.lora_A.weight": torch.ones(2, 4)}, "neither"),
        ({"diffusion_model.m.dora_scale": torch.ones(4)}, "not a LoRA key"),
        ({}, "holds no LoRA tensors"),
    ],
)
def test_load_rejects_bad_files_naming_them(tmp_path, tensors, message):
    path = tmp_path / "odd.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(LoraFileError, match=message) as caught:
        load_lora(path)
    assert "odd.safetensors" in str(caught.value)


def test_load_corrupt_or_missing_file(tmp_path):
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(LoraFileError, match=r"corrupt\.safetensors is not a readable safetensors"):
        load_lora(corrupt)
    with pytest.raises(LoraFileError, match=r"absent\.safetensors does not exist"):
        load_lora(tmp_path / "absent.safetensors")


# ---------------------------------------------------------------- dataset hash


def make_items(folder: Path, captions: dict[str, str], colors: dict[str, tuple]):
    folder.mkdir(parents=True, exist_ok=True)
    items = []
    for name, caption in captions.items():
        Image.new("RGB", (16, 16), colors[name]).save(folder / name)
        items.append(ImageItem(folder / name, caption, (16, 16)))
    return items


def test_dataset_hash_tracks_content_not_order_or_names(tmp_path):
    colors = {"a.png": (1, 2, 3), "b.png": (4, 5, 6)}
    items = make_items(tmp_path / "one", {"a.png": "cat", "b.png": "dog"}, colors)
    h = dataset_hash(items)
    assert len(h) == 64 and h == dataset_hash(items)
    assert dataset_hash(list(reversed(items))) == h

    renamed = make_items(tmp_path / "two", {"x.png": "cat", "y.png": "dog"}, {"x.png": (1, 2, 3), "y.png": (4, 5, 6)})
    assert dataset_hash(renamed) == h

    assert dataset_hash([items[0], ImageItem(items[1].path, "wolf", (16, 16))]) != h
    assert dataset_hash(items + [items[0]]) != h  # repeats change training
    Image.new("RGB", (16, 16), (9, 9, 9)).save(items[1].path)
    assert dataset_hash(items) != h

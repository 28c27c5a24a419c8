"""Family and variant from a safetensors header alone, on files laid out like real checkpoints:
ComfyUI's own modules give the names and shapes (full size on the meta device, no memory)."""
import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from comfy_bridge import build_meta, build_random, find_comfyui
from ugpum.arch import UnknownModel, get_spec, recognise
from ugpum.formats.safetensors_header import HeaderError

pytestmark = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")
FULL = ["flux2-klein-4b", "flux2-klein-9b", "flux2-dev", "wan2.1-1.3b", "wan2.1-14b"]
DT = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32"}


def header_only(path, shapes: dict, dtype=torch.bfloat16):
    """A safetensors header with a sparse (unwritten) data section of the right size: enough for anything
    that reads only headers (recognise checks the header against the file's size)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        dt = dtype if len(shape) == 2 else torch.bfloat16        # fp8 files keep norms/biases in bf16
        n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        header[name] = {"dtype": DT[dt], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


@pytest.mark.parametrize("model_id", FULL)
@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_full_size_headers(tmp_path, model_id, prefix, dtype):
    spec = get_spec(model_id)
    shapes = {prefix + k: tuple(v.shape) for k, v in build_meta(spec, torch.bfloat16).state_dict().items()}
    found, got_prefix, got_dtype = recognise(header_only(tmp_path / "m.safetensors", shapes, dtype))
    assert (found.id, got_prefix, got_dtype) == (model_id, prefix, "fp8" if dtype != torch.bfloat16 else "bf16")
    assert found.params == spec.params


def test_klein_base_is_told_apart_by_file_name_only(tmp_path):
    shapes = {k: tuple(v.shape) for k, v in build_meta(get_spec("flux2-klein-9b"), torch.bfloat16).state_dict().items()}
    assert recognise(header_only(tmp_path / "flux-2-klein-base-9b.safetensors", shapes))[0].id == "flux2-klein-base-9b"


@pytest.mark.parametrize("model_id", ["tiny-flux2", "tiny-wan"])
@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_tiny_real_checkpoints(tmp_path, model_id, prefix):
    sd = build_random(get_spec(model_id), torch.float32).state_dict()
    path = tmp_path / "tiny.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in sd.items()}, str(path))
    spec, got_prefix, dtype = recognise(path)
    assert (spec.id, got_prefix, dtype) == (model_id, prefix, "fp32")


def test_other_files_get_clear_errors(tmp_path):
    other = tmp_path / "vae.safetensors"
    save_file({"decoder.conv_in.weight": torch.zeros(4, 4)}, str(other))
    with pytest.raises(UnknownModel, match="vae.safetensors: not a FLUX.2 or Wan"):
        recognise(other)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(HeaderError, match="junk.safetensors: not a safetensors file"):
        recognise(junk)
    with pytest.raises(HeaderError, match="no such file"):
        recognise(tmp_path / "missing.safetensors")

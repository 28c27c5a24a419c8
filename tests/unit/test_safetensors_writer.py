"""The streaming safetensors writer: what it writes is what safetensors itself reads back."""
import pytest
import torch
from safetensors.torch import load_file

from ugpum.formats.safetensors_writer import write_streaming


def test_streamed_file_reads_back_with_every_shape_and_dtype(tmp_path):
    tensors = {
        "weight": torch.randn(3, 5).to(torch.bfloat16),
        "scale": torch.tensor(0.25),                                   # 0-d, as fp8 weight scales are
        "fp8": torch.randn(4, 2).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 3),
        "ids": torch.arange(7, dtype=torch.int64),
    }
    shapes = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
    path = write_streaming(tmp_path / "m.safetensors", shapes, lambda name, shape, dtype: tensors[name],
                           metadata={"who": "test"})
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(back[k].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else back[k],
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)


def test_a_wrong_shape_leaves_no_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    with pytest.raises(ValueError, match="declared"):
        write_streaming(path, {"a": ((2, 2), torch.float32)}, lambda *_: torch.zeros(3))
    assert list(tmp_path.iterdir()) == []

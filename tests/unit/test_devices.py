import builtins
import json
import os
import sys
import types

import pytest

from ugpum.planning import devices
from ugpum.planning.devices import GIB, LINKS, PRESETS, Device, parse_device_spec, parse_device_specs


# --- specs typed by hand -------------------------------------------------------------------


@pytest.mark.parametrize("spec, gib", [("16GiB", 16), ("24GB", 24), ("12g", 12), ("7.5 GiB", 7.5)])
def test_sizes_are_binary_whatever_the_suffix(spec, gib):
    device = parse_device_spec(spec)
    assert device.total_bytes == int(gib * GIB)
    assert device.free_bytes == device.total_bytes
    assert device.torch_device is None
    assert device.tflops_bf16 == devices.REFERENCE_TFLOPS == PRESETS["rtx4090"]["tflops_bf16"]
    assert device.link == "pcie4x16" and device.host_gbps == 25.0
    assert device.label == spec


def test_preset_takes_its_memory_speed_and_link():
    device = parse_device_spec("rtx5090")
    assert device.total_bytes == 32 * GIB
    assert device.tflops_bf16 == pytest.approx(209.5 * 0.8)
    assert device.link == "pcie5x16" and device.host_gbps == 50.0
    assert parse_device_spec("RTX 4060Ti-16G").link == "pcie4x8"


def test_link_override_on_preset_and_size():
    slow = parse_device_spec("rtx5080@pcie4x4")
    assert slow.link == "pcie4x4" and slow.host_gbps == 6.5
    assert slow.tflops_bf16 == PRESETS["rtx5080"]["tflops_bf16"]
    assert slow.label == "rtx5080@pcie4x4"
    small = parse_device_spec("16GiB@pcie3x4")
    assert (small.total_bytes, small.host_gbps) == (16 * GIB, 3.3)


def test_presets_are_sane():
    for name, preset in PRESETS.items():
        assert preset["link"] in LINKS, name
        assert 10 < preset["tflops_bf16"] < 1000, name
        assert preset["memory_bytes"] >= 8 * GIB, name          # the smallest cards people train on
        assert len(preset["compute_capability"]) == 2, name      # base_compute = auto reads it
    # Ordered as the cards are: a 4090 is faster than a 4080, slower than a 5090.
    rates = {name: p["tflops_bf16"] for name, p in PRESETS.items()}
    assert rates["rtx4080"] < rates["rtx4090"] < rates["rtx5090"] < rates["h200"]


@pytest.mark.parametrize("spec", ["rtx9999", "16TiB", "", "0GiB", "gib", "cuda:x"])
def test_bad_spec_names_itself_and_the_choices(spec):
    with pytest.raises(ValueError) as err:
        parse_device_spec(spec)
    message = str(err.value)
    assert repr(spec) in message
    if spec not in ("0GiB",):
        assert "rtx4090" in message and "pcie4x4" in message


def test_bad_link_lists_the_links():
    with pytest.raises(ValueError, match=r"'pcie9x3'.*pcie4x16.*pcie5x16"):
        parse_device_spec("rtx4090@pcie9x3")


def test_cuda_spec_without_such_device():
    with pytest.raises(ValueError, match="cuda:7"):
        parse_device_spec("cuda:7")


def test_link_cannot_be_forced_on_a_real_device():
    with pytest.raises(ValueError, match="only applies"):
        parse_device_spec("cpu@pcie4x4")


def test_cpu_is_the_host_with_its_ram():
    cpu = parse_device_spec("cpu")
    assert cpu.torch_device == "cpu"
    assert cpu.total_bytes > GIB
    assert 0 < cpu.free_bytes <= cpu.total_bytes


def test_several_specs_commas_and_auto(monkeypatch):
    fake = Device("cuda:0 Fake", "cuda:0", GIB, GIB, 1.0, 1.0, "pcie4x16")
    monkeypatch.setattr(devices, "detect_devices", lambda probe=True: [fake])
    got = parse_device_specs(["rtx4090, rtx3090", "auto", "16GiB"])
    assert [d.label for d in got] == ["rtx4090", "rtx3090", "cuda:0 Fake", "16GiB"]


# --- links ----------------------------------------------------------------------------------


def test_gpu_to_gpu_staged_through_host_adds_both_hops():
    a, b = parse_device_spec("rtx4090"), parse_device_spec("rtx4090@pcie4x4")
    # 1 / (1/25 + 1/6.5)
    assert devices.gpu_to_gpu_gbps(a, b) == pytest.approx(5.159, abs=1e-3)
    assert devices.gpu_to_gpu_gbps(a, a) == pytest.approx(12.5)
    h200 = parse_device_spec("h200")
    assert devices.gpu_to_gpu_gbps(h200, h200) == devices.NVLINK_GBPS


def test_link_names_and_rates_for_unlisted_links():
    assert devices.link_name(4, 16) == "pcie4x16"
    assert devices.link_name(None, 16) == "unknown"
    assert devices.link_gbps("pcie4x16") == 25.0
    assert devices.link_gbps("pcie4x2") == pytest.approx(3.2)
    assert devices.link_gbps("unknown") == devices.UNKNOWN_LINK_GBPS


@pytest.mark.parametrize("raw, expected", [
    ("00000000:65:00.0", "0000:65:00.0"),
    ("0000:65:00.0", "0000:65:00.0"),
    (b"00000000:0A:00.0\x00", "0000:0a:00.0"),
    ("65:00.0", "0000:65:00.0"),
    ("00000001:C1:00.0", "0001:c1:00.0"),
])
def test_bus_id_normalisation(raw, expected):
    assert devices.normalize_pci_bus_id(raw) == expected


def test_bus_id_garbage_raises():
    with pytest.raises(ValueError):
        devices.normalize_pci_bus_id("GPU-1234")


def test_torch_bus_id_matches_nvml_form():
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x65, pci_device_id=0)
    assert devices._torch_bus_id(props) == devices.normalize_pci_bus_id("00000000:65:00.0")


def test_preset_for_cuda_names():
    assert devices.preset_for_name("NVIDIA GeForce RTX 4090") is PRESETS["rtx4090"]
    assert devices.preset_for_name("NVIDIA GeForce RTX 4060 Ti") is PRESETS["rtx4060ti-16g"]
    assert devices.preset_for_name("NVIDIA H200") is PRESETS["h200"]
    assert devices.preset_for_name("NVIDIA GeForce RTX 4090 D") is None


# --- detection on a machine without a GPU ------------------------------------------------------


def test_detect_without_cuda_is_empty(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert devices.detect_devices() == []
    assert devices.detect_devices(probe=False) == []
    assert devices.peer_access_matrix() == []


def test_to_json_round_trips():
    device = Device("cuda:1 NVIDIA GeForce RTX 4090", "cuda:1", 24 * GIB, 23 * GIB, 150.0, 24.1,
                    "pcie4x16", compute_capability=(8, 9), sm_count=128, pcie_gen_max=4,
                    pcie_gen_now=1, pcie_width_max=16, pcie_width_now=16,
                    pci_bus_id="0000:65:00.0")
    text = json.dumps(device.to_json())
    assert json.loads(text)["compute_capability"] == [8, 9]
    assert Device.from_json(json.loads(text)) == device
    hand = parse_device_spec("16GiB@pcie4x4")
    assert Device.from_json(json.loads(json.dumps(hand.to_json()))) == hand


# --- NVML -----------------------------------------------------------------------------------


def test_nvml_package_missing_gives_no_links(monkeypatch):
    real_import = builtins.__import__

    def refuse_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    monkeypatch.setattr(builtins, "__import__", refuse_pynvml)
    assert devices._read_nvml_links() == {}


class _NVMLError(Exception):
    pass


def _fake_pynvml(gpus, init_fails=False):
    """A pynvml stand-in: gpus is a list of dicts with bus, gen, width, gen_now, nvlinks."""
    nvml = types.ModuleType("pynvml")
    nvml.NVML_FEATURE_ENABLED = 1
    nvml.NVML_NVLINK_MAX_LINKS = 18
    nvml.shutdowns = 0

    def init():
        if init_fails:
            raise _NVMLError("NVML Shared Library Not Found")

    def shutdown():
        nvml.shutdowns += 1

    def gen_max(h):
        if h["gen"] is None:
            raise _NVMLError("Not Supported")
        return h["gen"]

    def nvlink_state(h, link):
        if link >= 18 or not h.get("nvlinks"):
            raise _NVMLError("Not Supported")
        return 1 if link < h["nvlinks"] else 0

    nvml.nvmlInit = init
    nvml.nvmlShutdown = shutdown
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = lambda k: gpus[k]
    nvml.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=h["bus"])
    nvml.nvmlDeviceGetMaxPcieLinkGeneration = gen_max
    nvml.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: h["gen_now"]
    nvml.nvmlDeviceGetMaxPcieLinkWidth = lambda h: h["width"]
    nvml.nvmlDeviceGetCurrPcieLinkWidth = lambda h: h["width"]
    nvml.nvmlDeviceGetNvLinkState = nvlink_state
    nvml.nvmlDeviceGetDisplayActive = lambda h: h.get("display", 0)
    return nvml


def test_nvml_init_failure_gives_no_links(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([], init_fails=True))
    assert devices._read_nvml_links() == {}


def test_nvml_links_keyed_by_normalised_bus_id(monkeypatch):
    gpus = [
        {"bus": b"00000000:B3:00.0", "gen": 4, "gen_now": 1, "width": 4},
        {"bus": "00000000:65:00.0", "gen": None, "gen_now": 1, "width": 16},
        {"bus": "00000000:19:00.0", "gen": 5, "gen_now": 5, "width": 16, "nvlinks": 18, "display": 1},
    ]
    fake = _fake_pynvml(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    links = devices._read_nvml_links()
    assert links["0000:b3:00.0"] == {"gen_max": 4, "gen_now": 1, "width_max": 4,
                                     "width_now": 4, "nvlinks": 0, "display": False}
    assert links["0000:65:00.0"]["gen_max"] is None  # unsupported query -> None, not a crash
    assert links["0000:19:00.0"]["nvlinks"] == 18 and links["0000:19:00.0"]["display"] is True
    assert fake.shutdowns == 1


# --- matmul-rate cache ----------------------------------------------------------------------


def test_rate_cache_written_atomically_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("UGPUM_CACHE_DIR", str(tmp_path / "cache"))
    replaced = []
    real_replace = os.replace

    def spy_replace(src, dst):
        replaced.append((str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(devices.os, "replace", spy_replace)
    calls = []

    def measure():
        calls.append(1)
        return 123.5

    assert devices.cached_matmul_tflops("NVIDIA GeForce RTX 4090", measure) == 123.5
    assert devices.cached_matmul_tflops("NVIDIA GeForce RTX 4090", measure) == 123.5
    assert len(calls) == 1  # measured once, then read back

    path = tmp_path / "cache" / "matmul_tflops.json"
    assert json.loads(path.read_text()) == {"NVIDIA GeForce RTX 4090": 123.5}
    # Written beside the target and renamed over it; no temp file left behind.
    assert len(replaced) == 1
    src, dst = replaced[0]
    assert os.path.dirname(src) == os.path.dirname(dst) and dst == str(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["matmul_tflops.json"]

    # A second model is added without losing the first.
    assert devices.cached_matmul_tflops("NVIDIA H200", lambda: 700.0) == 700.0
    assert json.loads(path.read_text()) == {"NVIDIA GeForce RTX 4090": 123.5, "NVIDIA H200": 700.0}


def test_rate_cache_survives_a_corrupt_file(monkeypatch, tmp_path):
    monkeypatch.setenv("UGPUM_CACHE_DIR", str(tmp_path))
    (tmp_path / "matmul_tflops.json").write_text("{half a fi")
    assert devices.cached_matmul_tflops("X", lambda: 42.0) == 42.0
    assert json.loads((tmp_path / "matmul_tflops.json").read_text()) == {"X": 42.0}


def test_failed_write_leaves_no_temp_file(monkeypatch, tmp_path):
    monkeypatch.setenv("UGPUM_CACHE_DIR", str(tmp_path))

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(devices.os, "replace", broken_replace)
    assert devices.cached_matmul_tflops("X", lambda: 1.0) == 1.0  # still answers
    assert list(tmp_path.iterdir()) == []

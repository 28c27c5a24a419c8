"""What compute devices exist: memory, speed, host link, peer access.

A `Device` is whatever the planner balances blocks over. It comes from one of three places:
- a real CUDA device (`detect_devices`, spec "cuda:N" or "auto"), measured when asked to;
- a preset or a bare size typed by hand ("rtx4090", "16GiB@pcie4x4") to plan for hardware
  that is not in this machine;
- the host itself ("cpu"), the tier that block swap offloads to.

Bandwidths are GB/s with GB = 1e9 bytes (as link specs are quoted); memory is in bytes.
Everything here imports and answers on a machine without a GPU or without NVML.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable

from ..formats.atomic import remove_abandoned, write_json_atomic
from ..wording import EngineError

log = logging.getLogger(__name__)

GIB = 1024**3

# Host link, one direction, GB/s that real pinned copies reach (not the raw line rate).
# PCIe 3 x16 / 4 x16 / 5 x16 reach about 13 / 25 / 50 on consumer boards; an x4 slot gets a
# quarter, slightly better per lane. "sxm" is a data-centre part on an NVLink fabric: its host
# side is PCIe 5 x16 (an H200 measured 55 pinned), peers are reached through NVLINK_GBPS.
LINKS: dict[str, float] = {
    "pcie3x1": 0.8,
    "pcie3x4": 3.3,
    "pcie3x8": 6.5,
    "pcie3x16": 13.0,
    "pcie4x1": 1.6,
    "pcie4x4": 6.5,
    "pcie4x8": 13.0,
    "pcie4x16": 25.0,
    "pcie5x1": 3.2,
    "pcie5x4": 13.0,
    "pcie5x8": 25.0,
    "pcie5x16": 50.0,
    "sxm": 50.0,
}

# GPU<->GPU over NVLink 4 (H100/H200 SXM): 450 GB/s per direction on the datasheet
# (900 GB/s both ways together); a plain peer copy reaches about 0.8 of that.
NVLINK_GBPS = 360.0

# Realistic GB/s per lane by PCIe generation, for links the table above does not list
# (a detected x2 slot, a gen-2 riser). Doubles each generation, like the line rate.
_GBPS_PER_LANE = {1: 0.2, 2: 0.4, 3: 0.82, 4: 1.6, 5: 3.2, 6: 6.4}

# What a link we could not read is assumed to be: the common consumer x16 slot.
UNKNOWN_LINK = "unknown"
UNKNOWN_LINK_GBPS = LINKS["pcie4x16"]

# Dense bf16 tensor-core TFLOP/s with fp32 accumulate, from the vendor's public spec sheets,
# times a derating to what a large bf16 matmul sustains in practice (clocks and power limits).
# This is the same quantity the detection probe measures, so a preset and a measured card
# compare directly. Whole-model efficiency (attention, norms, copies) is cost.py's business.
# GeForce cards run bf16 with fp32 accumulate at half their fp16-accumulate rate: marketing
# tables quote the latter, and often the 2:4 sparse figure on top; neither applies to training.
_GEFORCE_DERATE = 0.8
# Cards not in a whitepaper table are scaled from their family's flagship per SM and GHz of boost clock:
# Ampere GeForce 71 / (82 SMs x 1.695 GHz) = 0.511, Ada 165.2 / (128 x 2.52) = 0.512 dense TFLOP/s.
# compute_capability says which 8-bit tensor cores a card has (8.6 Ampere: int8; 8.9 Ada, 9.0 Hopper,
# 12.0 Blackwell GeForce: fp8 and int8), for base_compute = auto (ugpum.compute.modes.fastest_mode_for).
PRESETS: dict[str, dict] = {
    # Ampere GA106: 28 SMs x 1.777 GHz x 0.511 = 25.4 dense. The 12 GB desktop card.
    "rtx3060": {"memory_bytes": 12 * GIB, "tflops_bf16": round(25.4 * _GEFORCE_DERATE, 1),
                "link": "pcie4x16", "compute_capability": (8, 6)},
    # Ampere GA104: 46 SMs x 1.725 GHz x 0.511 = 40.5 dense; 8 GB.
    "rtx3070": {"memory_bytes": 8 * GIB, "tflops_bf16": round(40.5 * _GEFORCE_DERATE, 1),
                "link": "pcie4x16", "compute_capability": (8, 6)},
    # Ampere GA102 whitepaper: RTX 3090 BF16 tensor, fp32 acc, 71 dense (142 sparse).
    "rtx3090": {"memory_bytes": 24 * GIB, "tflops_bf16": round(71.0 * _GEFORCE_DERATE, 1),
                "link": "pcie4x16", "compute_capability": (8, 6)},
    # Ada AD107: 24 SMs x 2.46 GHz x 0.512 = 30.2 dense; 8 GB, wired x8.
    "rtx4060": {"memory_bytes": 8 * GIB, "tflops_bf16": round(30.2 * _GEFORCE_DERATE, 1),
                "link": "pcie4x8", "compute_capability": (8, 9)},
    # Ada whitepaper rate per SM (as the 4090) x 34 SMs x 2.535 GHz: 44.1 dense.
    # The card is wired x8 electrically, whatever the slot.
    "rtx4060ti-16g": {"memory_bytes": 16 * GIB, "tflops_bf16": round(44.1 * _GEFORCE_DERATE, 1),
                      "link": "pcie4x8", "compute_capability": (8, 9)},
    # Ada AD104: 46 SMs x 2.475 GHz x 0.512 = 58.3 dense; 12 GB.
    "rtx4070": {"memory_bytes": 12 * GIB, "tflops_bf16": round(58.3 * _GEFORCE_DERATE, 1),
                "link": "pcie4x16", "compute_capability": (8, 9)},
    # Ada whitepaper: RTX 4080 fp32-acc 97.5 dense (194.9 sparse).
    "rtx4080": {"memory_bytes": 16 * GIB, "tflops_bf16": round(97.5 * _GEFORCE_DERATE, 1),
                "link": "pcie4x16", "compute_capability": (8, 9)},
    # Ada whitepaper: RTX 4090 BF16 fp32-acc 165.2 dense (330.4 sparse).
    "rtx4090": {"memory_bytes": 24 * GIB, "tflops_bf16": round(165.2 * _GEFORCE_DERATE, 1),
                "link": "pcie4x16", "compute_capability": (8, 9)},
    # Blackwell GeForce: 1801 "AI TOPS" is fp4 sparse; /2 dense, /4 fp16-acc bf16, /2 fp32 acc
    # = 112.6 dense.
    "rtx5080": {"memory_bytes": 16 * GIB, "tflops_bf16": round(112.6 * _GEFORCE_DERATE, 1),
                "link": "pcie5x16", "compute_capability": (12, 0)},
    # Blackwell GeForce: RTX 5090 3352 fp4 sparse "AI TOPS" -> 209.5 bf16 fp32-acc dense.
    "rtx5090": {"memory_bytes": 32 * GIB, "tflops_bf16": round(209.5 * _GEFORCE_DERATE, 1),
                "link": "pcie5x16", "compute_capability": (12, 0)},
    # H200 SXM datasheet: BF16 989.4 dense (1979 sparse). This module's probe gave 780 from
    # idle but 640-680 once the card had run for a second (power-limited): 680 (0.69) is the
    # rate training sustains. Memory is what torch reports there (139.8 GiB), not "141 GB".
    "h200": {"memory_bytes": 150_109_880_320, "tflops_bf16": 680.0, "link": "sxm", "compute_capability": (9, 0)},
}

# The speed a bare size ("16GiB") is given: the RTX 4090's, the card most people training
# these models at home own. Only the ratio between devices steers the split; this sets the
# absolute step time the forecast shows for such what-if devices.
REFERENCE_TFLOPS = PRESETS["rtx4090"]["tflops_bf16"]
REFERENCE_LINK = "pcie4x16"

# The host as a device: it is the swap tier, not a place we compute blocks, so a constant
# (a many-core CPU without AMX does about this in bf16) beats a probe that costs seconds.
CPU_TFLOPS_BF16 = 1.0
CPU_MEMCPY_GBPS = 20.0  # one pageable memcpy stream in host RAM


# What a card that drives a display is assumed to give the desktop: the compositor's and the browser's
# buffers (about 0.3-1 GiB on Linux and Windows desktops). A card described by hand is taken to drive one; a
# detected GPU does when NVML says so (its free memory is read at start; this is room for the desktop to
# grow while training runs). The `desktop_gib` setting overrides both.
DESKTOP_BYTES = GIB // 2


@dataclass
class Device:
    label: str  # what the user sees: "cuda:0 NVIDIA H200", "rtx4090", "16GiB"
    torch_device: str | None  # "cuda:0", "cpu"; None for a device described by hand
    total_bytes: int
    free_bytes: int  # for hand-described devices == total_bytes
    tflops_bf16: float  # dense bf16 matmul rate actually achievable (measured or preset)
    host_gbps: float  # one-direction copy bandwidth to/from pinned host memory, GB/s
    link: str  # a LINKS key, or UNKNOWN_LINK
    compute_capability: tuple[int, int] | None = None
    sm_count: int | None = None
    pcie_gen_max: int | None = None
    pcie_gen_now: int | None = None
    pcie_width_max: int | None = None
    pcie_width_now: int | None = None
    pci_bus_id: str | None = None
    # What the plan leaves to the desktop: on a card described by hand, what a desktop holds; on a detected
    # GPU that drives a display (NVML), room for it to grow after the free memory was read
    desktop_bytes: int = 0
    speed_source: str = ""  # where tflops_bf16 comes from, in words (what the forecast assumes)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Device:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("compute_capability") is not None:
            values["compute_capability"] = tuple(values["compute_capability"])
        return cls(**values)


# ---------------------------------------------------------------------------------------------
# Specs typed by hand


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(gib|gb|g)$")
_CUDA = re.compile(r"^cuda:(\d+)$")


def parse_device_spec(spec: str, probe: bool = True) -> Device:
    """One device from a spec: "16GiB", "24GB", "rtx4090", "rtx5080@pcie4x4", "cuda:1", "cpu".

    Sizes are binary whatever the suffix: "24GB" is a 24 GB card, which holds 24 GiB (GPU
    memory is sold in binary units), so GiB, GB and G all mean 1024**3 bytes.
    "@<link>" overrides the host link of a preset or a size. `probe` applies to "cuda:N".
    """
    text = spec.strip().lower().replace(" ", "")
    base, _, link = text.partition("@")
    if link and link not in LINKS:
        raise ValueError(f"device spec {spec!r}: unknown link {link!r}; links: {', '.join(LINKS)}")

    if base == "cpu" or _CUDA.match(base):
        if link:
            raise ValueError(f"device spec {spec!r}: '@link' only applies to a preset or a size; "
                             f"{base} reports its own link")
        if base == "cpu":
            return host_device()
        return _detected_by_index(spec, int(_CUDA.match(base)[1]), probe)

    if base in PRESETS:
        preset = PRESETS[base]
        link = link or preset["link"]
        return _hand_described(spec.strip(), preset["memory_bytes"], preset["tflops_bf16"], link,
                               preset["compute_capability"], f"the {base} spec sheet's")

    size = _SIZE.match(base)
    if size:
        total = int(float(size[1]) * GIB)
        if not 2 * GIB <= total <= 1024 * GIB:      # below 2 GiB the CUDA context and workspace leave nothing
            raise ValueError(f"device spec {spec!r}: a GPU's memory must be from 2 to 1024 GiB (e.g. 16GiB)")
        return _hand_described(spec.strip(), total, REFERENCE_TFLOPS, link or REFERENCE_LINK,
                               speed=f"an RTX 4090's (a bare size; name the card, e.g. rtx4060ti-16g, for its own)")

    raise ValueError(_spec_help(spec))


def parse_device_specs(specs: list[str], probe: bool = True) -> list[Device]:
    """Devices from a list of specs; an item may hold several separated by commas, and "auto"
    stands for every CUDA device of this machine."""
    devices: list[Device] = []
    for item in specs:
        for spec in filter(None, (s.strip() for s in item.split(","))):
            if spec.lower() == "auto":
                devices.extend(detect_devices(probe=probe))
            else:
                devices.append(parse_device_spec(spec, probe=probe))
    return devices


# Without CUDA, "auto" falls back to the CPU for models this small (the tests' and demo's tiny models)
CPU_TRAINABLE_PARAMS = 100_000_000


class DeviceError(ValueError, EngineError):
    """The devices asked for cannot run the request; the message says what would."""


def with_desktop(devices: list[Device], desktop_gib: float | None) -> list[Device]:
    """`devices` with `desktop_gib` left to the desktop on every GPU (None: each device's own default)."""
    if desktop_gib is None:
        return devices
    return [replace(d, desktop_bytes=int(desktop_gib * GIB)) if d.torch_device != "cpu" else d for d in devices]


def resolve_devices(specs: list[str], spec, training: bool = False, probe: bool = True,
                    desktop_gib: float | None = None) -> list[Device]:
    """The devices a plan is made over, the same for every front end: this machine's GPUs for
    "auto"/"cuda:N", described ones (16GiB, rtx4090) as typed, the CPU for models small enough when
    no GPU is here. `training` also refuses what cannot train: described GPUs, the CPU for real models.
    `desktop_gib`: what each GPU leaves to the desktop (None: `DESKTOP_BYTES` on a card that drives one)."""
    devices = with_desktop(parse_device_specs(list(specs), probe=probe), desktop_gib)
    small = spec.params <= CPU_TRAINABLE_PARAMS
    if not devices:
        if small:
            return [host_device()]
        raise DeviceError(
            f"no CUDA GPU found, and {spec.id} ({spec.params / 1e9:.1f} B parameters) is too large to train on "
            "the CPU; to see a forecast for GPUs you plan to use, describe them instead, e.g. "
            "'rtx4090, rtx4090' or '16GiB@pcie4x4, 24GiB'")
    if training:
        check_trainable(devices, spec)
    return devices


def check_trainable(devices: list[Device], spec) -> None:
    """Refuse what cannot train: described GPUs (forecasts only), the CPU for real models."""
    described = [d.label for d in devices if d.torch_device is None]
    if described:
        raise DeviceError(f"training needs this machine's devices (auto, cuda:N or cpu), not described ones "
                          f"({', '.join(described)}); describe GPUs only to read a forecast")
    if spec.params > CPU_TRAINABLE_PARAMS and any(d.torch_device == "cpu" for d in devices):
        raise DeviceError(f"{spec.id} cannot train on the CPU; only the tiny test models do (use auto or cuda:N)")


def _spec_help(spec: str) -> str:
    return (f"unknown device spec {spec!r}: expected a size like '16GiB' or '24GB', a preset "
            f"({', '.join(PRESETS)}), 'cuda:N', 'cpu' or 'auto', optionally followed by "
            f"'@<link>' with link one of: {', '.join(LINKS)}")


def _hand_described(label: str, total: int, tflops: float, link: str,
                    capability: tuple[int, int] | None = None, speed: str = "") -> Device:
    """A card described by hand; a bare size (no capability given) is planned as the reference card."""
    return Device(label=label, torch_device=None, total_bytes=total, free_bytes=total,
                  tflops_bf16=tflops, host_gbps=LINKS[link], link=link,
                  compute_capability=capability or PRESETS["rtx4090"]["compute_capability"],
                  desktop_bytes=DESKTOP_BYTES, speed_source=speed)


def _detected_by_index(spec: str, index: int, probe: bool) -> Device:
    count = _cuda_device_count()
    if index >= count:
        have = f"cuda:0..cuda:{count - 1}" if count else "no CUDA devices"
        raise ValueError(f"device spec {spec!r}: this machine has {have}")
    return _describe_cuda_device(index, _read_nvml_links(), probe)


def host_device() -> Device:
    """The host RAM as a device (the swap tier)."""
    total, free = host_memory()
    return Device(label="cpu", torch_device="cpu", total_bytes=total, free_bytes=free,
                  tflops_bf16=CPU_TFLOPS_BF16, host_gbps=CPU_MEMCPY_GBPS, link="host")


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of this machine's RAM; (0, 0) where it cannot be read."""
    try:  # psutil comes with ComfyUI and works on Windows too
        import psutil

        mem = psutil.virtual_memory()
        return int(mem.total), int(mem.available)
    except ImportError:
        pass
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0, 0
    free = total
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    return total, free


# ---------------------------------------------------------------------------------------------
# Links


def link_name(gen: int | None, width: int | None) -> str:
    return f"pcie{gen}x{width}" if gen and width else UNKNOWN_LINK


def link_gbps(link: str) -> float:
    """Realistic one-direction GB/s of a link name, also for ones LINKS does not list."""
    if link in LINKS:
        return LINKS[link]
    match = re.fullmatch(r"pcie(\d+)x(\d+)", link)
    if match and int(match[1]) in _GBPS_PER_LANE:
        return _GBPS_PER_LANE[int(match[1])] * int(match[2])
    return UNKNOWN_LINK_GBPS


def gpu_to_gpu_gbps(a: Device, b: Device) -> float:
    """Forecast one-direction GB/s of an activation copy from a to b.

    Two SXM parts talk over NVLink. Real devices with peer access copy directly, as fast as
    the slower slot. Otherwise (every GeForce pair) the copy is staged through host memory:
    down one link, then up the other, one after the other, so the times add and the rate is
    1/(1/a + 1/b) (half a link when both are equal).
    """
    if a.link == "sxm" and b.link == "sxm":
        return NVLINK_GBPS
    slower = min(a.host_gbps, b.host_gbps)
    if _have_peer_access(a, b):
        return slower
    return 1.0 / (1.0 / a.host_gbps + 1.0 / b.host_gbps)


def _have_peer_access(a: Device, b: Device) -> bool:
    ia, ib = _cuda_index(a), _cuda_index(b)
    if ia is None or ib is None or ia == ib:
        return False
    try:
        import torch

        return bool(torch.cuda.can_device_access_peer(ia, ib))
    except Exception:
        return False


def _cuda_index(device: Device) -> int | None:
    match = _CUDA.match(device.torch_device or "")
    return int(match[1]) if match else None


def peer_access_matrix() -> list[list[bool]]:
    """m[i][j]: can cuda:i read cuda:j's memory directly. A device always reaches itself.
    [] without CUDA."""
    n = _cuda_device_count()
    if not n:
        return []
    import torch

    def can(i: int, j: int) -> bool:
        try:
            return i == j or bool(torch.cuda.can_device_access_peer(i, j))
        except Exception:
            return False

    return [[can(i, j) for j in range(n)] for i in range(n)]


# ---------------------------------------------------------------------------------------------
# NVML: PCIe link generation and width, matched to CUDA devices by PCI bus id


def normalize_pci_bus_id(bus_id: str | bytes) -> str:
    """"00000000:65:00.0" (NVML), "0000:65:00.0" (sysfs), "65:00.0" -> "0000:65:00.0"."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    match = re.fullmatch(r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])",
                         bus_id.strip().rstrip("\x00"))
    if not match:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain, bus, dev, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{function}"


def _read_nvml_links() -> dict[str, dict]:
    """Normalised bus id -> PCIe gen/width (max and now) and active NVLink count, for every
    GPU NVML sees. {} when nvidia-ml-py is missing or NVML cannot start: the fields stay None.

    The max values are what the slot and card can do together (the slot limits them); the
    current ones drop at idle to save power, so the link name uses the max.
    """
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception as err:  # no driver, no library, no permission
        log.info("NVML unavailable, PCIe links unknown: %s", err)
        return {}
    try:
        found = {}
        for k in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(k)

            def ask(getter: str, *args):
                try:
                    return getattr(pynvml, getter)(handle, *args)
                except Exception:  # NotSupported in VMs and on some boards
                    return None

            pci = ask("nvmlDeviceGetPciInfo")
            if pci is None:
                continue
            found[normalize_pci_bus_id(pci.busId)] = {
                "gen_max": ask("nvmlDeviceGetMaxPcieLinkGeneration"),
                "gen_now": ask("nvmlDeviceGetCurrPcieLinkGeneration"),
                "width_max": ask("nvmlDeviceGetMaxPcieLinkWidth"),
                "width_now": ask("nvmlDeviceGetCurrPcieLinkWidth"),
                "nvlinks": _active_nvlinks(pynvml, handle),
                "display": bool(ask("nvmlDeviceGetDisplayActive")),
            }
        return found
    except Exception as err:
        log.info("NVML query failed, PCIe links unknown: %s", err)
        return {}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _active_nvlinks(pynvml, handle) -> int:
    active = 0
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                active += 1
        except Exception:  # no NVLink, or past the last link
            break
    return active


# ---------------------------------------------------------------------------------------------
# CUDA detection


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def detect_devices(probe: bool = True) -> list[Device]:
    """Every CUDA device, with memory, speed and link. [] without CUDA; never raises.

    With `probe` the matmul rate is measured once per GPU model (then cached) and the host
    link every time (it depends on the slot, not the model); without, presets stand in.
    """
    count = _cuda_device_count()
    if not count:
        return []
    links = _read_nvml_links()
    devices = []
    for index in range(count):
        try:
            devices.append(_describe_cuda_device(index, links, probe))
        except Exception as err:  # one broken device must not hide the others
            log.warning("skipping cuda:%d: %s", index, err)
    return devices


def _describe_cuda_device(index: int, nvml_links: dict[str, dict], probe: bool) -> Device:
    import torch

    props = torch.cuda.get_device_properties(index)
    bus_id = _torch_bus_id(props)
    nvml = nvml_links.get(bus_id, {})
    link = "sxm" if nvml.get("nvlinks") else link_name(nvml.get("gen_max"), nvml.get("width_max"))
    free, total = torch.cuda.mem_get_info(index)
    preset = preset_for_name(props.name)

    tflops = preset["tflops_bf16"] if preset else REFERENCE_TFLOPS
    speed = "its spec sheet's" if preset else "an RTX 4090's (not measured, no preset for this card)"
    host_gbps = link_gbps(link)
    if probe:
        try:
            tflops = cached_matmul_tflops(props.name, lambda: measure_matmul_tflops(index))
            speed = f"measured here (cached in {_rates_file()})"
            host_gbps = measure_host_gbps(index)
        except Exception as err:  # out of memory, pinning refused: keep the table values
            log.warning("cuda:%d probe failed, using table values: %s", index, err)

    return Device(
        label=f"cuda:{index} {props.name}",
        torch_device=f"cuda:{index}",
        total_bytes=int(total),
        free_bytes=int(free),
        tflops_bf16=float(tflops),
        host_gbps=float(host_gbps),
        link=link,
        compute_capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
        pcie_gen_max=nvml.get("gen_max"),
        pcie_gen_now=nvml.get("gen_now"),
        pcie_width_max=nvml.get("width_max"),
        pcie_width_now=nvml.get("width_now"),
        pci_bus_id=bus_id,
        speed_source=speed,
        desktop_bytes=DESKTOP_BYTES if nvml.get("display") else 0,
    )


def _torch_bus_id(props) -> str | None:
    # torch reports the three numbers (no function number: a GPU is function 0).
    try:
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except (AttributeError, TypeError, ValueError):
        return None


def preset_for_name(name: str) -> dict | None:
    """The preset whose name a CUDA device name spells: "NVIDIA GeForce RTX 4090" -> rtx4090.
    Exact after dropping vendor words, so a 4090 D or a laptop 4090 gets none."""
    key = re.sub(r"[^a-z0-9]", "", name.lower()).replace("nvidia", "").replace("geforce", "")
    for preset_name, preset in PRESETS.items():
        if key == preset_name.split("-")[0]:
            return preset
    return None


def speed_assumed(device: Device) -> str:
    """The rate and host link a forecast takes for `device`, and where each comes from, in words."""
    source = f", {device.speed_source}" if device.speed_source else ""
    return (f"{device.tflops_bf16:.0f} TFLOP/s bf16{source}; host link {device.link} at "
            f"{device.host_gbps:.0f} GB/s")


# ---------------------------------------------------------------------------------------------
# Probes


def cache_dir() -> Path:
    root = os.environ.get("UGPUM_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ugpum"


def _rates_file() -> Path:
    return cache_dir() / "matmul_tflops.json"


def cached_matmul_tflops(device_name: str, measure: Callable[[], float]) -> float:
    """The rate stored for this GPU model, or `measure()` it once and store it."""
    path = _rates_file()
    try:
        rates = json.loads(path.read_text())
        if not isinstance(rates, dict):
            rates = {}
    except (OSError, ValueError):
        rates = {}
    if isinstance(rates.get(device_name), (int, float)):
        return float(rates[device_name])
    rates[device_name] = float(measure())
    try:
        _write_json_atomically(path, rates)
    except OSError as err:  # a read-only home must not stop training
        log.warning("could not cache matmul rate in %s: %s", path, err)
    return rates[device_name]


def _write_json_atomically(path: Path, data: dict) -> None:
    # Readers (another ComfyUI process) see the old file or the new one, never half of one; what a killed
    # writer left is cleared first.
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(path.parent)
    write_json_atomic(path, dict(sorted(data.items())))


def _timed_ms(index: int, work: Callable[[], None], repeats: int) -> float:
    """Mean milliseconds of `work` on cuda:index, timed with CUDA events."""
    import torch

    with torch.cuda.device(index):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats


def measure_matmul_tflops(index: int, n: int = 4096, seconds: float = 0.3) -> float:
    """bf16 n x n x n matmul TFLOP/s on cuda:index, in about `seconds`.

    Warm up for a third of the time first: an idle GPU sits at low clocks and takes tens
    of milliseconds to reach full speed. Random data (zeros run faster than real work).
    4096 is near the shapes a block multiplies at 1024^2 (4608 tokens x 4096 features).
    """
    import torch

    device = torch.device("cuda", index)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)

    def matmul():
        torch.matmul(a, b, out=out)

    batch = 10
    deadline = time.perf_counter() + seconds / 3
    while True:
        ms = _timed_ms(index, matmul, batch)
        if time.perf_counter() >= deadline:
            break
    repeats = max(batch, int(seconds * 2 / 3 * 1000 / ms))
    ms = _timed_ms(index, matmul, repeats)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def measure_host_gbps(index: int, nbytes: int = 256 * 1024**2, repeats: int = 3) -> float:
    """Pinned host<->cuda:index copy GB/s: the slower of the two directions.

    Activations go one way and their gradients come back the other, so the slower direction
    is the one a forecast must not overrate.
    """
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
    to_device = lambda: dev.copy_(host, non_blocking=True)  # noqa: E731
    to_host = lambda: host.copy_(dev, non_blocking=True)  # noqa: E731
    rates = []
    for copy in (to_device, to_host):
        _timed_ms(index, copy, 1)
        rates.append(nbytes / (_timed_ms(index, copy, repeats) * 1e-3) / 1e9)
    return min(rates)


def measure_gpu_to_gpu_gbps(src: int, dst: int, nbytes: int = 256 * 1024**2,
                            repeats: int = 5) -> float:
    """Measured GB/s of a cuda:src -> cuda:dst tensor copy, the way the router will copy
    (peer access if the driver offers it, else CUDA stages through the host). For benches."""
    import torch

    count = _cuda_device_count()
    if src == dst or not (0 <= src < count and 0 <= dst < count):
        raise ValueError(f"need two different devices among {count}, got cuda:{src}, cuda:{dst}")
    a = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", src))
    b = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", dst))

    def synchronize():
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)

    b.copy_(a)
    synchronize()
    # Wall clock: one event pair cannot span two devices' streams.
    start = time.perf_counter()
    for _ in range(repeats):
        b.copy_(a)
    synchronize()
    return nbytes * repeats / (time.perf_counter() - start) / 1e9

"""Triton kernels for what PyTorch's own ops do in more passes or on older tensor-core paths: each a custom op
(`lora_up`, `matmul_8bit`) with a PyTorch form for the CPU and for installs without Triton, its kernel in
`triton_kernels` (tests run both forms: the kernels in Triton's interpreter). Registering a Triton op imports
Triton, a second or more that every start of the CLI and of the node pack would pay: an op's module is imported
only when `turn_on` names it (a training run on CUDA: `turn_on_measured`), and the code that uses it reads it
from there."""
from __future__ import annotations

import importlib
from importlib.util import find_spec

import torch

HAS_TRITON = find_spec("triton") is not None       # (found, not imported)


def runs_kernel(t: torch.Tensor) -> bool:
    """Whether an op of this folder takes its Triton kernel for a tensor here (CUDA, Triton installed)."""
    return HAS_TRITON and t.device.type == "cuda"


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: the tiles a grid needs."""
    return -(-a // b)


# name -> (the op's module, its function, the module and the setting that take it)
KERNELS = {"lora-kernel": ("lora_up", "add_up_projection", "ugpum.compute.lora", "FUSED_UP_PROJECTION"),
           "int8-kernel": ("matmul_8bit", "scaled_mm_8bit", "ugpum.compute.modes.int8", "TRITON_KERNEL"),
           "fp8-lora-epilogue": ("matmul_8bit", "scaled_mm_8bit", "ugpum.compute.modes.fp8", "TRITON_KERNEL")}


# The kernels a GPU run measured faster than PyTorch's ops, klein 9B, recompute all, one H100 (bench/results/README.md,
# "The fifth call set"): lora-kernel 0.4798 -> 0.4732 s/step in bf16; int8-kernel 0.4611 -> 0.4117 in int8.
ON_BY_DEFAULT = ("lora-kernel", "int8-kernel")
# The compute capability a kernel needs on every training GPU to be turned on by default: fp8's GEMM on our kernel
# runs only on Hopper's tensor memory accelerator (elsewhere its op falls back to a float matmul).
NEEDS = {"fp8-lora-epilogue": (9, 0)}


def turn_on(name: str) -> None:
    """From now on run kernel `name` (a key of KERNELS) wherever its op runs on CUDA."""
    module, op, user, setting = KERNELS[name]
    found = getattr(importlib.import_module(f"{__name__}.{module}"), op)
    setattr(importlib.import_module(user), setting, found)


def measured_for(capability: tuple[int, int] | None) -> list[str]:
    """The kernels of ON_BY_DEFAULT that GPUs of this lowest compute capability take (None: not known, so only
    those that need none)."""
    return [name for name in ON_BY_DEFAULT
            if name not in NEEDS or (capability is not None and tuple(capability) >= NEEDS[name])]


def turn_on_measured(devices) -> list[str]:
    """Turn on the kernels of ON_BY_DEFAULT that every CUDA training device (torch devices or their names) takes
    (`measured_for`), when one is CUDA and Triton is installed; the names turned on (none on the CPU, where the
    ops' PyTorch forms run anyway)."""
    cuda = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
    if not HAS_TRITON or not cuda:
        return []
    capability = min(map(torch.cuda.get_device_capability, cuda)) if torch.cuda.is_available() else None
    names = measured_for(capability)
    for name in names:
        turn_on(name)
    return names

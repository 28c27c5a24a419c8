"""What the GPU benchmarks share: random-weight checkpoints, example inputs, capped devices, the LoRA
training setup, merging results, the command line that made them."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


GIB = 1024 ** 3
DEFAULT_ALLOC_CONF = "expandable_segments:True"
ENTRY_KEY = ("model", "cap_gib", "resolution", "frames", "slots", "offload", "compile")   # one result per key


def add_workload_arguments(p: argparse.ArgumentParser, steps: int, warmup: int) -> None:
    """The training shape and step counts every GPU benchmark takes."""
    p.add_argument("--steps", type=int, default=steps, help="training steps per case (the first --warmup are not timed)")
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--resolution", type=int, default=1024, help="square image side in pixels (Wan: one frame of it)")
    p.add_argument("--frames", type=int, default=1, help="Wan video frames (4k+1)")
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--compile", choices=["off", "on"], default="off", help="compiled blocks (ugpum.compute.compile)")


def checkpoint_path(args, spec) -> Path:
    if args.ckpt:
        return Path(args.ckpt)
    return Path(tempfile.gettempdir()) / "ugpum-bench" / f"{spec.id}.safetensors"


def write_random_checkpoint(spec, path: Path, device: str) -> float:
    """A ComfyUI-layout file ('model.diffusion_model.' keys, the module's dtypes) of random weights;
    returns seconds taken. Generated on `device`, written tensor by tensor."""
    from comfy_bridge import build_meta

    from ugpum.formats.safetensors_writer import write_streaming
    model = build_meta(spec, torch.bfloat16)
    shapes = {"model.diffusion_model." + k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    gen = torch.Generator(device).manual_seed(0)

    def make(name, shape, dtype):
        r = torch.randn(shape, generator=gen, device=device)
        if len(shape) >= 2:
            r = r * 0.02
        elif "norm" in name:
            r = 1 + 0.1 * r
        else:
            r = 0.02 * r
        return r.to(dtype)

    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    write_streaming(path, shapes, make)
    return time.time() - t0


def example_inputs(spec, w, device: str):
    if spec.family == "wan":
        x = torch.randn(w.batch, 16, spec.latent_frames(w.frames), w.height // 8, w.width // 8, device=device)
    else:
        x = torch.randn(w.batch, 128, w.height // 16, w.width // 16, device=device)
    ctx = torch.randn(w.batch, w.text_tokens, spec.context_dim, device=device)
    t = torch.rand(w.batch, device=device) * getattr(spec, "timestep_scale", 1.0)
    return x.to(torch.bfloat16), t, ctx.to(torch.bfloat16)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def real_device(device: str):
    from ugpum.planning.devices import detect_devices, host_device
    if device == "cpu":
        return host_device()
    index = torch.device(device).index or 0
    found = detect_devices(probe=True)
    if index >= len(found):
        raise ValueError(f"--device {device}: this machine has {len(found)} CUDA device(s)")
    return found[index]


def capped_device(real, cap_gib: float):
    """`real` with the memory of a `cap_gib` card: a real card's CUDA context takes its share of that
    (`plan.CUDA_CONTEXT`), so the allocator gets cap - context and the planner plans for the same."""
    from ugpum.planning.plan import CUDA_CONTEXT
    cap = int(cap_gib * GIB)
    context = CUDA_CONTEXT if (real.torch_device or "").startswith("cuda") else 0
    return dataclasses.replace(real, label=f"{real.label} capped at {cap_gib:g} GiB", total_bytes=cap,
                               free_bytes=int(cap - context))


def cap_devices(limits: dict[str, float]):
    """Cap the allocator of each CUDA device in `limits` ("cuda:N" -> bytes) with
    `torch.cuda.set_per_process_memory_fraction`, to play smaller cards; returns the undo. Devices
    that several stages share get one cap (the caller sums them)."""
    capped = []

    def undo():
        for index in capped:
            torch.cuda.set_per_process_memory_fraction(1.0, index)

    try:
        for device, limit in limits.items():
            index = torch.device(device).index or 0
            total = torch.cuda.get_device_properties(index).total_memory
            if limit > total:
                raise ValueError(f"cap of {limit / GIB:.2f} GiB on {device}: it has only {total / GIB:.2f} GiB")
            torch.cuda.set_per_process_memory_fraction(limit / total, index)
            capped.append(index)
    except BaseException:
        undo()                        # no device stays capped by a half-done call
        raise
    return undo


def lora_training_setup(model, spec, w, compile: str = "off"):
    """What every GPU bench trains: FLUX.2's in-place guard, per-block checkpointing and LoRA of rank
    `w.rank` on every block linear, the blocks compiled first when `compile` is on. Returns (guards, undo
    checkpointing and compilation, the LoRA set, its parameters)."""
    from ugpum.compute.recompute import recompute_blocks
    from ugpum.compute.compile import compile_blocks
    from ugpum.compute.inplace_guard import guard_inplace_residuals
    from ugpum.compute.lora import attach_lora, lora_targets
    block_paths = [b.path for b in spec.blocks]
    guards = guard_inplace_residuals(model, include_rms=False)
    undo_compile = compile_blocks(model, block_paths, compile)
    undo_checkpointing = recompute_blocks(model, block_paths)

    def undo_ckpt():
        undo_checkpointing()
        undo_compile()
    lora = attach_lora(model, lora_targets(block_paths, [b.linears for b in spec.blocks]),
                       rank=w.rank, alpha=float(w.rank))
    return guards, undo_ckpt, lora, [p for _, a in lora.items() for p in a.parameters()]


def merge_results(path: Path, entry: dict) -> list[dict]:
    entries = []
    if path.is_file():
        try:
            entries = json.loads(path.read_text())
        except ValueError:
            entries = []
        if not isinstance(entries, list):
            entries = []
    entries = [e for e in entries if tuple(e.get(k) for k in ENTRY_KEY) != tuple(entry.get(k) for k in ENTRY_KEY)]
    entries.append(entry)
    return entries


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def command_line() -> str:
    first = sys.argv[0]
    if Path(first).name == "__main__.py" and Path(first).parent.name == "ugpum":
        first = "-m ugpum"
    else:
        try:
            first = os.path.relpath(first)
        except ValueError:
            pass
    env = f"COMFYUI_PATH={os.environ['COMFYUI_PATH']} " if os.environ.get("COMFYUI_PATH") else ""
    return f"{env}python {' '.join([first] + sys.argv[1:])}"

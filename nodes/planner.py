"""Partition Planner: which blocks go on which GPU, and the forecast, before any weight is loaded."""
from __future__ import annotations


from comfy_api.latest import io, ui

from ugpum.arch import Workload
from ugpum.cli import format_plan
from ugpum.devices import host_device, parse_device_specs
from ugpum.plan import make_plan

from .errors import UGPUMError, user_errors
from .types import UGPUM_MODEL, UGPUM_PLAN, UGPUMModel, UGPUMPlan

NODE = "Partition Planner"
CHECKPOINTING = ["block", "none"]
# Without CUDA, 'auto' may fall back to the CPU for models this small (the tests' tiny FLUX.2 / Wan).
CPU_FALLBACK_MAX_PARAMS = 100_000_000


def resolve_devices(model: UGPUMModel) -> list:
    """The devices to plan over: measured GPUs for 'auto'/'cuda:N', described ones as typed."""
    devices = parse_device_specs(list(model.devices), probe=True)
    if devices:
        return devices
    if model.spec.params <= CPU_FALLBACK_MAX_PARAMS:
        return [host_device()]
    raise UGPUMError(
        f"{NODE}: no CUDA GPU found, and {model.model_id} ({model.spec.params / 1e9:.1f} B parameters) is "
        "too large to train on the CPU; to see a forecast for GPUs you plan to use, type them in the "
        "UGPUM Loader's devices field, e.g. 'rtx4090, rtx4090' or '16GiB@pcie4x4, 24GiB'.")


def parse_split(text: str, n_devices: int, n_blocks: int) -> list[int] | None:
    """'14, 18' -> [14, 18]: blocks per device, in device order; '' -> None (the planner chooses)."""
    text = text.strip()
    if not text:
        return None
    try:
        counts = [int(part) for part in text.replace(";", ",").split(",") if part.strip()]
    except ValueError:
        raise UGPUMError(f"{NODE}: manual split {text!r} is not a list of block counts; write one count "
                         f"per device, e.g. '{n_blocks // 2}, {n_blocks - n_blocks // 2}'.") from None
    if len(counts) != n_devices or any(c < 0 for c in counts) or sum(counts) != n_blocks:
        raise UGPUMError(f"{NODE}: manual split {text!r} must give {n_devices} non-negative block counts "
                         f"(one per device) adding up to {n_blocks}.")
    return counts


class PartitionPlanner(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="UGPUMPartitionPlanner",
            display_name="UGPUM Partition Planner",
            category="UGPUM",
            description="Splits the model's blocks over the GPUs from their free memory, speed and PCIe link, "
                        "and forecasts memory per GPU and seconds per step, next to one GPU with block swap, "
                        "and whether the text encoder fits one GPU to cache the captions or is split over "
                        "several for that step. Queue it alone to read the forecast before training.",
            is_output_node=True,
            inputs=[
                UGPUM_MODEL.Input("model"),
                io.Int.Input("resolution", default=1024, min=64, max=4096, step=16,
                             tooltip="Training resolution in pixels (square side; images and clips are "
                                     "bucketed to about this many pixels at their own aspect ratio: 640 "
                                     "gives 832x480 for Wan's 480p clips)."),
                io.Int.Input("batch", default=1, min=1, max=64,
                             tooltip="Samples per micro-batch (images or clips of one bucket and caption length)."),
                io.Int.Input("grad_accum", default=1, min=1, max=64, display_name="gradient accumulation",
                             tooltip="Micro-batches per optimizer step; with two or more GPUs they are "
                                     "pipelined, so more micro-batches keep every GPU busy."),
                io.Int.Input("rank", default=16, min=1, max=256, display_name="LoRA rank",
                             tooltip="LoRA rank (the trainer uses this value)."),
                io.Combo.Input("checkpointing", options=CHECKPOINTING, default="block",
                               tooltip="'block' recomputes each block in backward: much less memory, "
                                       "about 45% more compute."),
                io.Int.Input("frames", default=1, min=1, max=257, optional=True,
                             tooltip="Video frames per clip, taken from each clip's start (Wan only: "
                                     "4k+1 such as 17 or 33; 1 trains images). The forecast covers them. "
                                     "FLUX.2: 1."),
                io.String.Input("manual_split", default="", optional=True, display_name="manual split",
                                tooltip="Optional: blocks per device in device order, e.g. '14, 18'. "
                                        "Empty: the planner chooses."),
            ],
            outputs=[UGPUM_PLAN.Output("UGPUM_PLAN", display_name="plan"),
                     io.String.Output("report", display_name="report")],
        )

    @classmethod
    def execute(cls, model: UGPUMModel, resolution: int, batch: int, grad_accum: int, rank: int,
                checkpointing: str, frames: int = 1, manual_split: str = "") -> io.NodeOutput:
        if model.spec.frames_error(frames):
            raise UGPUMError(f"{NODE}: frames {frames}: {model.spec.frames_error(frames)}.")
        with user_errors(NODE):
            devices = resolve_devices(model)
            split = parse_split(manual_split or "", len(devices), len(model.spec.blocks))
            w = Workload(width=resolution, height=resolution, frames=frames, batch=batch,
                         checkpointing=checkpointing == "block", weight_dtype=model.weight_dtype, rank=rank)
            plan = make_plan(model.spec, devices, w, grad_accum=grad_accum, split=split)
        report = format_plan(plan)
        result = UGPUMPlan(model=model, plan=plan, devices=tuple(devices), workload=w,
                           grad_accum=grad_accum, report=report)
        return io.NodeOutput(result, report, ui=ui.PreviewText(report))

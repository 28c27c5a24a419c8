"""Partition Planner: which blocks go on which GPU, and the forecast, before any weight is loaded."""
from __future__ import annotations


from comfy_api.latest import io, ui

from ugpum.arch.base import RECOMPUTE_SETTINGS
from ugpum.compute.modes import EXACT, QUALITY_BOUND, SETTINGS as BASE_COMPUTE_SETTINGS
from ugpum.planning.devices import resolve_devices
from ugpum.compute.dtypes import training_dtype
from ugpum.planning.forecast import format_plan, plan_for_config
from ugpum.placement.schedules import SETTINGS as SCHEDULE_SETTINGS
from ugpum.train.config import load_config
from ugpum.wording import for_nodes

from .errors import UGPUMError, user_errors
from .types import UGPUM_MODEL, UGPUM_PLAN, UGPUMModel, UGPUMPlan

NODE = "Partition Planner"
RECOMPUTE_CHOICES = list(RECOMPUTE_SETTINGS)
SCHEDULE_CHOICES = list(SCHEDULE_SETTINGS)


def planning_config(model: UGPUMModel, resolution: int, batch: int, grad_accum: int, rank: int,
                    recompute: str, frames: int, schedule: str, base_compute: str = "bf16", replicas: int = 0):
    """The TrainConfig of the settings the plan depends on (the Trainer adds the rest to it)."""
    return load_config(overrides=dict(
        model=model.model_id, model_file=model.path, resolution=resolution, frames=frames, batch=batch,
        grad_accum=grad_accum, rank=rank, alpha=float(rank), recompute=recompute,
        weight_dtype=training_dtype(model.weight_dtype), devices=list(model.devices), schedule=schedule,
        base_compute=base_compute, replicas=replicas))


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
            description="Weighs the ways to train on the GPUs (one card, the model's blocks split over them, or a "
                        "copy on each training its share of the micro-batches) from their free memory, speed and "
                        "PCIe link, takes the fastest that fits, and forecasts memory per GPU and seconds per "
                        "step, with the layouts it weighed in one table, and whether the text encoder fits one GPU "
                        "to cache the captions or is split over several for that step. Queue it alone to read the "
                        "forecast before training.",
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
                io.Combo.Input("recompute", options=RECOMPUTE_CHOICES, default="auto",
                               tooltip="Blocks whose forward is recomputed in backward (per-block checkpointing): "
                                       "auto keeps the activations of as many blocks as the memory left after the "
                                       "weights holds, recomputing the rest; all recomputes every block (the least "
                                       "memory, about 45% more compute); none recomputes nothing (the most memory). "
                                       "The report says how many blocks keep their activations."),
                io.Int.Input("frames", default=1, min=1, max=257, optional=True,
                             tooltip="Video frames per clip, taken from each clip's start (Wan only: "
                                     "4k+1 such as 17 or 33; 1 trains images). The forecast covers them. "
                                     "FLUX.2: 1."),
                io.Combo.Input("schedule", options=SCHEDULE_CHOICES, default="auto", optional=True,
                               tooltip="Order of the micro-batches over the GPUs: auto takes the fastest for the "
                                       "split; 1f1b and gpipe pipeline them (gpipe holds every micro-batch's "
                                       "activations at once), sequential runs one at a time."),
                io.String.Input("manual_split", default="", optional=True, display_name="manual split",
                                tooltip="Optional: blocks per device in device order, e.g. '14, 18'. "
                                        "Empty: the planner chooses."),
                io.Combo.Input("base_compute", options=list(BASE_COMPUTE_SETTINGS), default=EXACT.name, optional=True,
                               display_name="base compute",
                               tooltip="Precision of the frozen base weights' matmuls: bf16, or 8-bit (fp8 on "
                                       "RTX 40/50 and H100/H200, int8 on RTX 30) with 1 byte a weight on the GPUs. "
                                       "auto takes the fastest forecast among the modes whose LoRA gradients stay "
                                       "within the quality bound of the exact base (cosine >= "
                                       f"{QUALITY_BOUND} per block), bf16 on a tie; bf16 asks for the exact base "
                                       "(the report says which and why). The LoRA trains in full precision "
                                       "either way."),
                io.Int.Input("replicas", default=0, min=0, max=64, optional=True,
                             tooltip="Copies of the model side by side, each training its share of a step's "
                                     "micro-batches on its own GPU(s), the LoRA gradients averaged every step. 0: "
                                     "the planner chooses by forecast (the report's table shows what it weighed); "
                                     "1: one copy, split over the GPUs; R: R copies over devices / R GPUs each "
                                     "(needs at least R micro-batches, gradient accumulation)."),
            ],
            outputs=[UGPUM_PLAN.Output("UGPUM_PLAN", display_name="plan"),
                     io.String.Output("report", display_name="report")],
        )

    @classmethod
    def execute(cls, model: UGPUMModel, resolution: int, batch: int, grad_accum: int, rank: int,
                recompute: str, frames: int = 1, schedule: str = "auto", manual_split: str = "",
                base_compute: str = "bf16", replicas: int = 0) -> io.NodeOutput:
        if model.spec.frames_error(frames):
            raise UGPUMError(f"{NODE}: frames {frames}: {model.spec.frames_error(frames)}.")
        with user_errors(NODE):
            config = planning_config(model, resolution, batch, grad_accum, rank, recompute, frames, schedule,
                                     base_compute, replicas)
            devices = resolve_devices(config.devices, model.spec)
            split = parse_split(manual_split or "", len(devices), len(model.spec.blocks))
            plan = plan_for_config(config, devices, split=split, spec=model.spec)
        report = for_nodes(format_plan(plan))           # its advice as the nodes' inputs
        result = UGPUMPlan(model=model, plan=plan, devices=tuple(devices), config=config, report=report)
        return io.NodeOutput(result, report, ui=ui.PreviewText(report))

"""A plan as text: the table `plan`, the Partition Planner node, `demo` and `doctor` print, and the
forecast on typical rigs for a machine without a GPU."""
from __future__ import annotations

from .arch import Workload, get_spec
from .arch.base import latent_frames
from .devices import parse_device_specs
from .plan import GIB, Plan, PlanError, plan_training

# What a machine without a GPU is shown instead: the most common cards first.
TYPICAL_RIGS = (("1x RTX 4090 (24 GiB, PCIe 4 x16)", ["rtx4090"]),
                ("2x 16 GiB cards (PCIe 4 x16)", ["16GiB", "16GiB"]),
                ("2x RTX 4060 Ti 16 GB", ["rtx4060ti-16g", "rtx4060ti-16g"]),
                ("RTX 5080 + RTX 4060 Ti 16 GB", ["rtx5080", "rtx4060ti-16g"]))


def _block_range(paths: list[str], a: int, b: int) -> str:
    if a == b:
        return "-"
    return f"{a}-{b - 1} ({paths[a]} .. {paths[b - 1]})"


def format_plan(plan: Plan) -> str:
    w = plan.workload
    clip = f", {w['frames']} frames ({latent_frames(w['frames'])} latent)" if w["frames"] > 1 else ""
    lines = [f"{plan.model}  {w['width']}x{w['height']}{clip}"
             + f"  batch {w['batch']}  grad-accum {plan.grad_accum}  rank {w['rank']}  {w['weight_dtype']}"
             + f"  checkpointing {'block' if w['checkpointing'] else 'none'}", ""]
    header = f"{'device':<24} {'blocks':<44} {'swapped':>7} {'forecast / budget GiB':>22} {'s/micro-batch':>13}"
    lines += [header, "-" * len(header)]
    for s in plan.stages:
        lines.append(f"{s.device[:24]:<24} {_block_range(plan.block_paths, *s.blocks):<44} "
                     f"{len(s.offloaded):>7} {s.forecast_gib:>10.1f} / {s.budget_gib:<9.1f} {s.seconds:>13.2f}")
    lines += ["", f"hidden state per boundary: {plan.boundary_mib:.1f} MiB; per step "
              f"{plan.crossing_bytes_per_step / 2**20:.0f} MiB between devices, "
              f"{plan.swap_bytes_per_step / GIB:.1f} GiB block swap",
              "s/step for 1..8 micro-batches:",
              "  sequential " + " ".join(f"{t:.2f}" for t in plan.step_s["sequential"]),
              "  pipelined  " + " ".join(f"{t:.2f}" for t in plan.step_s["pipelined"])]
    if plan.swap_forecast:
        sf = plan.swap_forecast
        lines.append(f"one GPU ({sf['device']}) with swap: {sf['predicted_step_s']:.2f} s/step, "
                     f"{len(sf['offloaded_blocks'])} blocks swapped, {sf['forecast_gib']:.1f} GiB")
    if plan.grad_accum > 1:
        lines.append(f"micro-batch schedule: {plan.schedule} ({plan.in_flight} micro-batch"
                     f"{'es' if plan.in_flight > 1 else ''} of activations held per stage)")
    lines += [f"predicted: {plan.predicted_step_s:.2f} s/step", "", plan.verdict]
    from .text_encoder_split import forecast_line
    text_encoder = forecast_line(plan)
    if text_encoder:
        lines += ["", text_encoder]
    return "\n".join(lines)


def plan_report(model_id: str = "flux2-klein-9b", grad_accum: int = 4) -> str:
    """The model at 1024², rank 16, on this machine's GPUs (if any) and on the typical rigs."""
    spec = get_spec(model_id)
    w = Workload(width=1024, height=1024, rank=16)
    here = parse_device_specs(["auto"], probe=False)
    rigs = ([("this machine", here)] if here else []) + \
        [(title, parse_device_specs(specs, probe=False)) for title, specs in TYPICAL_RIGS]
    parts = []
    for title, devices in rigs:
        try:
            text = format_plan(plan_training(spec, devices, w, grad_accum=grad_accum))
        except PlanError as e:
            text = f"does not fit: {e}"
        parts.append(f"=== {model_id} at 1024², rank 16, {grad_accum} micro-batches on {title} ===\n{text}\n")
    return "\n".join(parts)

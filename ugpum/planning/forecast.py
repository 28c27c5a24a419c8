"""One forecast, as text: the plan of a training configuration, which `plan`, the Partition Planner
node, `demo` and `doctor` all make through `plan_for_config` and print through `format_plan`, so the
same settings give the same numbers everywhere; every speed line says what it assumes (compiled or
eager blocks, weights and base compute, micro-batches and batch). Also the typical rigs shown to a
machine without a GPU. The text marks the settings it advises (ugpum/wording.py): whoever shows it words
them."""
from __future__ import annotations

import dataclasses

from ..arch import get_spec
from .devices import Device, parse_device_specs, resolve_devices, with_desktop
from .plan import GIB, MAX_MICRO_BATCHES, Plan, PlanError, alternatives_text
from .space import best_plan, host_limit

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
    clip = f", {w['frames']} frames ({w['latent_frames']} latent)" if w["frames"] > 1 else ""
    lines = [f"{plan.model}  {w['width']}x{w['height']}{clip}"
             + f"  batch {w['batch']}  grad-accum {plan.grad_accum}  rank {w['rank']}  {w['held_dtype']}"
             + f"  recompute {w.get('recompute', 'all')}"
             + f"  {'compiled' if w.get('compiled') else 'eager'}  base compute {w.get('base_compute', 'bf16')}", ""]
    header = f"{'device':<24} {'blocks':<44} {'swapped':>7} {'forecast / budget GiB':>22} {'s/micro-batch':>13}"
    lines += [header, "-" * len(header)]
    for r, copy in enumerate(plan.copies):
        for s in copy.stages:
            device = f"replica {r + 1}: {s.device}" if plan.replicas else s.device
            lines.append(f"{device[:24]:<24} {_block_range(plan.block_paths, *s.blocks):<44} "
                         f"{len(s.offloaded):>7} {s.forecast_gib:>10.1f} / {s.budget_gib:<9.1f} {s.seconds:>13.2f}")
    lines += ["", f"hidden state per boundary: {plan.boundary_mib:.1f} MiB; per step "
              f"{plan.crossing_bytes_per_step / 2**20:.0f} MiB between devices, "
              f"{plan.swap_bytes_per_step / GIB:.1f} GiB block swap",
              *([] if is_cpu_run(plan) or plan.replicas else [
                  "s/step for 1..8 micro-batches:",
                  "  sequential " + " ".join(f"{t:.2f}" for t in plan.step_s["sequential"][:MAX_MICRO_BATCHES]),
                  "  pipelined  " + " ".join(f"{t:.2f}" for t in plan.step_s["pipelined"][:MAX_MICRO_BATCHES])])]
    if plan.replicas:
        lines.append(f"replicas: {len(plan.replicas)} in {plan.runs_as}, micro-batches per step "
                     f"{'/'.join(map(str, plan.shares))}; LoRA gradients averaged each step"
                     + ("" if is_cpu_run(plan) else f": {plan.average_s:.2f} s/step"))
    if plan.swap_forecast:
        sf = plan.swap_forecast
        lines.append(f"one GPU ({sf['device']}) with swap: {sf['predicted_step_s']:.2f} s/step, "
                     f"{len(sf['offloaded_blocks'])} blocks swapped, {sf['forecast_gib']:.1f} GiB")
    if plan.grad_accum > 1:
        lines.append(f"micro-batch schedule: {plan.schedule} ({plan.in_flight} micro-batch"
                     f"{'es' if plan.in_flight > 1 else ''} of activations held per stage)")
    lines += [speed_line(plan), recompute_line(plan), host_line(plan), *(f"assumed: {a}" for a in plan.assumed),
              "", plan.verdict, *alternatives_text(plan), *layouts_table(plan)]
    from .text_encoder_split import forecast_line
    text_encoder = forecast_line(plan)
    if text_encoder:
        lines += ["", text_encoder]
    return "\n".join(lines)


def is_cpu_run(plan: Plan) -> bool:
    """A plan whose every stage is the host CPU: the tiny test models; the cost model knows GPUs only."""
    return all(st.torch_device == "cpu" for st in plan.stages)


def assumptions(plan: Plan) -> str:
    """What a forecast assumes, in words: blocks, weights, base compute, micro-batches, batch."""
    w = plan.workload
    blocks = "compiled blocks" if w.get("compiled") else "eager blocks (compile off)"
    per_step = f"{plan.grad_accum} micro-batch{'es' if plan.grad_accum > 1 else ''} of batch {w['batch']} per step"
    return (f"{blocks}, {w['held_dtype']} weights, base compute {w.get('base_compute', 'bf16')}, {per_step}, "
            f"{w['width']}x{w['height']}, rank {w['rank']}")


def speed_line(plan: Plan) -> str:
    """The forecast step time with what it assumes, or, for a CPU run, that there is no forecast."""
    if is_cpu_run(plan):
        return ("CPU run: no step-time forecast (the planner forecasts GPUs; on the CPU only the tiny test "
                "models train, in seconds)")
    return f"predicted: {plan.predicted_step_s:.2f} s/step ({assumptions(plan)})"


def host_line(plan: Plan) -> str:
    """The host memory the run needs at its peak, with the pinned copies of swapped blocks in it."""
    if plan.replicas:
        swapped = any(p.offloaded_blocks for p in plan.replicas)
        held = "" if not swapped else ", the replicas sharing one pinned copy of the blocks they swap" \
            if plan.runs_as == "one process" else ", each process with its own pinned copy of the blocks it swaps"
        return f"host memory: {plan.forecast_host_gib:.1f} GiB at the peak of training{held}"
    pinned = plan.swap_bytes_per_step / 2 / max(plan.grad_accum, 1) / GIB
    held = [f"{pinned:.1f} of it pinned copies of the swapped blocks"] if pinned else []
    if plan.inputs_on_host_gib:
        held.append(f"{plan.inputs_on_host_gib:.1f} the recomputed blocks' inputs")
    return f"host memory: {plan.forecast_host_gib:.1f} GiB at the peak of training" + "".join(", " + h for h in held)


def layouts_table(plan: Plan) -> list[str]:
    """The layouts the planner weighed, each with its best plan's forecast, the chosen one marked."""
    if not plan.layouts:
        return []
    lines = ["", "layouts weighed (* the plan above):",
             f"  {'layout':<28} {'s/step':>8} {'fullest GPU':>12} {'host':>9}  plan of each copy"]
    for r in plan.layouts:
        seconds = "-" if r["predicted_step_s"] is None or is_cpu_run(plan) else f"{r['predicted_step_s']:.2f}"
        gpu = "-" if r["gpu_gib"] is None else f"{r['gpu_gib']:.1f} GiB"
        host = "-" if r["host_gib"] is None else f"{r['host_gib']:.1f} GiB"
        what = "; ".join(x for x in (r["plan"], r["note"]) if x)
        lines.append(f"{'*' if r['chosen'] else ' '} {r['layout'][:28]:<28} {seconds:>8} {gpu:>12} {host:>9}  {what}")
    return lines


def recompute_line(plan: Plan) -> str:
    """Which blocks keep their activations (are not recomputed in backward), what that holds and saves."""
    n = sum(s.blocks[1] - s.blocks[0] for s in plan.stages)
    kept, gib = len(plan.kept_activations), sum(s.kept_gib for s in plan.stages)
    if plan.inputs_on_host_gib:
        return (f"recompute {plan.recompute}: every block recomputed in backward, its input waiting in host "
                f"memory until then ({plan.inputs_on_host_gib:.1f} GiB, copied out and back: "
                f"+{plan.inputs_on_host_s:.2f} s/micro-batch): the GPU cannot hold them"
                if kept == 0 else f"recompute {plan.recompute}: {kept} of {n} blocks keep their activations, the "
                f"other {n - kept} hold their inputs in host memory ({plan.inputs_on_host_gib:.1f} GiB, "
                f"+{plan.inputs_on_host_s:.2f} s/micro-batch): the GPU cannot hold them")
    if kept == 0:
        return f"recompute {plan.recompute}: every block recomputed in backward" + attention_kept_words(plan, n)
    saved = "" if is_cpu_run(plan) else f", {plan.recompute_saved_s:.2f} s/step saved"
    if plan.recompute == "none":
        return f"recompute none: every block keeps its activations (+{gib:.1f} GiB against recomputing them{saved})"
    return (f"recompute {plan.recompute}: {kept} of {n} blocks keep their activations (+{gib:.1f} GiB){saved}"
            + attention_kept_words(plan, n - kept))


def attention_kept_words(plan: Plan, recomputed: int) -> str:
    """What the recomputed blocks keep of their attention (`Workload.attention_kept`), in words ("" if nothing)."""
    if not plan.workload.get("attention_kept") or not recomputed:
        return ""
    gib = recomputed * plan.in_flight * get_spec(plan.model).kept_attention_bytes(plan.planned_workload()) / GIB
    return f"; those recomputed keep their self-attention outputs (+{gib:.1f} GiB), so their recompute skips it"


def plan_for_config(cfg, devices: list[Device] | None = None, split: list[int] | None = None,
                    spec=None, bucket: tuple[int, int] | None = None) -> Plan:
    """The plan of a training configuration (a `TrainConfig`): the one function behind `plan`,
    `doctor`, the demo's report and the Partition Planner. `devices` default to the config's; `spec`
    to its model's (pass the one read from a file's header); `bucket` (width, height) plans one
    non-square bucket instead of resolution²."""
    spec = spec or get_spec(cfg.model)
    if devices is None:
        devices = resolve_devices(list(cfg.devices), spec, desktop_gib=cfg.desktop_gib)
    else:
        devices = with_desktop(devices, cfg.desktop_gib)
    w = cfg.workload()
    if bucket:
        w = dataclasses.replace(w, width=bucket[0], height=bucket[1])
    return best_plan(spec, devices, w, grad_accum=cfg.grad_accum, schedule=cfg.schedule, split=split,
                     replicas=cfg.replicas, host_available=host_limit(devices))


def rigs_here_or_typical(rigs=TYPICAL_RIGS) -> list[tuple[str, list[Device], bool]]:
    """(title, devices, here): this machine's GPUs when it has any, then the typical rigs."""
    here = [d for d in parse_device_specs(["auto"], probe=False) if d.torch_device != "cpu"]
    out = [("this machine", here, True)] if here else []
    return out + [(title, parse_device_specs(specs, probe=False), False) for title, specs in rigs]


def plan_report(cfg, profile: str = "") -> str:
    """The configuration's plan on this machine's GPUs (if any) and on the typical rigs: the demo's
    plan_report.txt, with the same numbers `plan --profile PROFILE --gpu ...` prints."""
    name = f"profile {profile} ({cfg.model})" if profile else cfg.model
    parts = []
    for title, devices, _ in rigs_here_or_typical():
        try:
            text = format_plan(plan_for_config(cfg, devices))
        except PlanError as e:
            text = f"does not fit: {e}"
        parts.append(f"=== {name} on {title} ===\n{text}\n")
    return "\n".join(parts)

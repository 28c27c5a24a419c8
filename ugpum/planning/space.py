"""The plan space: every way the GPUs given can train the model, each with its forecast, and the fastest that
fits in GPU and host memory (`best_plan`: what every front end plans with).

The layouts of N GPUs for a step of m micro-batches:

* one card: one of the GPUs alone (its own plan: block swap, 8-bit base compute, recompute);
* the split: the model's blocks over all N (`plan.plan_training`), micro-batches pipelined over them;
* R replicas: R copies of the model, each over N / R of the GPUs (one card each when R = N, else a split),
  each training its consecutive share of the m micro-batches with its own plan; the LoRA gradients are
  summed on the first copy once a step (`replicas.py` counts that, the host memory the copies share, and
  whether one process can drive them).

A replica needs a micro-batch to train, so R <= m. The `replicas` setting fixes R (1: one copy, the split);
0 lets the forecast choose. On the CPU (the tiny test models) there is no forecast to choose by: one copy,
unless the setting asks for more.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..compute.modes import mode_named
from ..wording import setting
from .devices import Device, host_memory, speed_assumed
from .plan import GIB, Plan, PlanError, memory_assumed, plan_training
from .replicas import (assumed, averaging_seconds, host_gib, host_rate_shared, one_process_factor,
                       room_for_gradients, runs_as, shares)


CLOSE = 0.02          # forecasts this close count as a tie


def layouts_to_weigh(n: int, grad_accum: int, replicas: int, cpu: bool) -> list[tuple[int, int]]:
    """(copies, GPUs per copy) of every layout to weigh; the split (1, n) first."""
    if replicas:
        if n % replicas or replicas > max(grad_accum, 1):
            need = f"{n} device(s) do not divide into {replicas} replicas" if n % replicas else (
                f"{replicas} replicas need at least {replicas} micro-batches per step, one each")
            raise PlanError(f"{setting('replicas', replicas)}: {need}; set {setting('replicas', 0)} to let the "
                            f"planner choose, or {setting('replicas', 1)} for one copy over every device")
        return [(replicas, n // replicas)]
    if cpu:
        return [(1, n)]
    several = [(r, n // r) for r in range(2, n + 1) if n % r == 0 and r <= grad_accum]
    return [(1, n)] + sorted(several, key=lambda c: -c[0]) + ([(1, 1)] if n > 1 else [])


def title(copies: int, size: int, n: int, device: Device | None = None) -> str:
    """A layout's name in the table: one card (which), the split, replicas (of splits)."""
    if copies == 1 and size == 1:
        return f"one card ({device.label})" if n > 1 else "one card"
    if copies == 1:
        return f"split over {size} GPUs"
    return f"{copies} replicas" + ("" if size == 1 else f" of a {size}-GPU split")


def replicated(spec, groups: list[list[Device]], w, grad_accum: int, schedule: str) -> Plan:
    """The plan of len(groups) replicas, each over its devices, its share of the micro-batches, its own plan."""
    parts = shares(grad_accum, len(groups))
    roomy = room_for_gradients(spec, w, groups, parts)
    plans = [plan_training(spec, g, w, s, schedule, listed=False) for g, s in zip(roomy, parts)]
    slowed = host_rate_shared(roomy, plans)
    if slowed is not roomy:           # several swap: each at its share of host memory's rate
        plans = [plan_training(spec, g, w, s, schedule, listed=False) if p.offloaded_blocks else p
                 for g, s, p in zip(slowed, parts, plans)]
    how = runs_as()
    average = averaging_seconds(spec, w, plans, groups)
    step = max(p.predicted_step_s for p in plans) * one_process_factor(how) + average
    first = plans[0]
    devices = [d for g in groups for d in g]
    lines = list(dict.fromkeys(f"{d.label}: {memory_assumed(d)}; {speed_assumed(d)}" for d in devices
                               if d.torch_device != "cpu")) + assumed(spec, w, plans, groups, how)
    plan = dataclasses.replace(
        first, grad_accum=grad_accum, predicted_step_s=step, replicas=plans, shares=parts, average_s=average,
        runs_as=how, forecast_host_gib=host_gib(spec, plans, how), swap_forecast=None, alternatives=[],
        base_compute_note="", swap_bytes_per_step=sum(p.swap_bytes_per_step for p in plans),
        crossing_bytes_per_step=sum(p.crossing_bytes_per_step for p in plans), assumed=lines)
    plan.verdict = replicas_verdict(plan, devices)
    return plan


def replicas_verdict(plan: Plan, devices: list[Device]) -> str:
    """The sentence of a plan of replicas: how many, how each trains, how fast, how they run."""
    r, size = len(plan.replicas), len(plan.replicas[0].stages)
    where = "its own GPU" if size == 1 else f"its own {size} GPUs"
    if all(d.torch_device == "cpu" for d in devices):
        return f"A CPU run ({', '.join(d.label for d in devices)}) as {r} replicas: fits, no step-time forecast."
    each = "; ".join(sorted({copy_summary(p) for p in plan.replicas}))
    share = str(plan.shares[0]) if len(set(plan.shares)) == 1 else "/".join(map(str, plan.shares))
    return (f"{r} replicas, each on {where} training {share} of the {plan.grad_accum} "
            f"micro-batches ({each}): {plan.predicted_step_s:.2f} s/step with {plan.average_s:.2f} s averaging the "
            f"LoRA gradients, in {plan.runs_as}.")


def copy_summary(p: Plan) -> str:
    """One copy's plan in a few words: its weights or 8-bit base compute, and its swap or fullest GPU."""
    fill = f"{len(p.offloaded_blocks)} blocks swapped" if p.offloaded_blocks else \
        f"{max(s.forecast_gib for s in p.stages):.1f} GiB"
    quantised = mode_named(p.base_compute).quantises
    return f"{p.base_compute} compute, {fill}" if quantised else f"{p.workload['held_dtype']} weights, {fill}"


def row(name: str, copies: int, size: int, plan: Plan | None, why: str = "") -> dict:
    """One line of the layouts table."""
    if plan is None:
        return {"layout": name, "replicas": copies, "gpus_each": size, "predicted_step_s": None, "gpu_gib": None,
                "host_gib": None, "plan": "", "fits": False, "note": why, "chosen": False}
    return {"layout": name, "replicas": copies, "gpus_each": size, "predicted_step_s": plan.predicted_step_s,
            "gpu_gib": max(s.forecast_gib for p in plan.copies for s in p.stages), "host_gib": plan.forecast_host_gib,
            "plan": "; ".join(sorted({copy_summary(p) for p in plan.copies})), "fits": not why, "note": why,
            "chosen": False}


@dataclass
class Weighed:
    """One layout weighed: its row of the table, its best plan (None: it does not fit, `error` says why) and
    the devices of each copy that plan was made over."""
    row: dict
    plan: Plan | None
    groups: list[list[Device]]
    error: PlanError | None = None


def weighed(spec, devices: list[Device], w, grad_accum: int, schedule: str, split: list[int] | None,
            replicas: int, host_available: float | None) -> list[Weighed]:
    """Every layout weighed, the split first; their plans without the quantised alternatives a plan of one
    copy lists (`best_plan` adds the chosen one's)."""
    n, cpu = len(devices), all(d.torch_device == "cpu" for d in devices)
    out = []
    for copies, size in layouts_to_weigh(n, grad_accum, 1 if split else replicas, cpu):
        tries = [[[d]] for d in _distinct(devices)] if (copies, size) == (1, 1) and n > 1 else \
            [[devices[c * size:(c + 1) * size] for c in range(copies)]]          # (each: the copies' devices)
        best = Weighed({}, None, tries[0])
        for groups in tries:
            try:
                plan = replicated(spec, groups, w, grad_accum, schedule) if copies > 1 else \
                    plan_training(spec, groups[0], w, grad_accum, schedule, split if size == n else None,
                                  listed=False)
            except PlanError as e:
                best.error = best.error or e
                continue
            if best.plan is None or plan.predicted_step_s < best.plan.predicted_step_s:
                best = Weighed({}, plan, groups)
        name = title(copies, size, n, best.groups[0][0])
        short = "" if best.plan is None or host_available is None or \
            best.plan.forecast_host_gib * GIB <= host_available else \
            f"host memory: needs {best.plan.forecast_host_gib:.1f} GiB, {host_available / GIB:.1f} available"
        best.row = row(name, copies, size, best.plan, short or ("" if best.plan else "does not fit"))
        out.append(best)
    return out


def _distinct(devices: list[Device]) -> list[Device]:
    """The devices, one of each kind (the same memory, speed and link)."""
    seen, out = set(), []
    for d in devices:
        kind = (d.free_bytes, d.desktop_bytes, d.tflops_bf16, d.host_gbps, d.compute_capability)
        if kind not in seen:
            seen.add(kind)
            out.append(d)
    return out


def best_plan(spec, devices: list[Device], w, grad_accum: int = 1, schedule: str = "auto",
              split: list[int] | None = None, replicas: int = 0, host_available: float | None = None) -> Plan:
    """The plan a run uses: of the layouts weighed (`layouts_to_weigh`), the fastest whose forecast fits the
    GPUs and `host_available` bytes of host memory (None: not checked; where none fits it, the fastest), with
    the table of every layout weighed (`Plan.layouts`). `split`: block counts per device, the split alone."""
    if not devices:
        return plan_training(spec, devices, w, grad_accum, schedule, split)        # (its sentence)
    if split and replicas > 1:
        raise PlanError(f"a manual split places one copy of the model: set {setting('replicas', 1)} (or 0) with it, "
                        "or leave the split empty for replicas")
    options = weighed(spec, devices, w, grad_accum, schedule, split, replicas, host_available)
    made = [o for o in options if o.plan is not None]
    if not made:
        raise next(o.error for o in options if o.error is not None)
    fitting = [o for o in made if o.row["fits"]] or made
    fastest = min(o.plan.predicted_step_s for o in fitting)
    # within the forecast's noise of the fastest, the first weighed: the split before replicas, replicas before
    # one card (a split that holds every block, not one card streaming most of them, for 0.1 % less)
    chosen = next(o for o in fitting if o.plan.predicted_step_s <= fastest * (1 + CLOSE))
    chosen.row["chosen"] = True
    plan = chosen.plan
    if not plan.replicas:             # one copy: with the quantised plans it lists beside bf16 with swap
        plan = plan_training(spec, chosen.groups[0], w, grad_accum, schedule, split)
    plan.layouts = [o.row for o in options] if len(options) > 1 else []
    return plan


def host_limit(devices: list[Device]) -> float | None:
    """The host memory a plan over `devices` may fill: this machine's available RAM when they are its GPUs;
    None (not checked) for GPUs described by hand, whose host is not this one, and for the CPU."""
    if not any((d.torch_device or "").startswith("cuda") for d in devices):
        return None
    return host_memory()[1] or None

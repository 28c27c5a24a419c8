"""UGPUM core: LoRA training for diffusion transformers too big for one GPU, the blocks kept spread
over several GPUs in one process (no ComfyUI imports; the verbs in `ugpum.commands` and the nodes
build ComfyUI's models and hand them in).

What a library user calls:
    spec = get_spec("flux2-klein-9b")                       # or recognise("file.safetensors")[0]
    devices = resolve_devices(["auto"], spec)
    plan = plan_training(spec, devices, Workload(width=1024, height=1024), grad_accum=4)
    print(format_plan(plan))
    result = train(load_config("klein-9b-1024", overrides={...}), "out/", model=..., encoders=...)
Every error raised on purpose is an `EngineError`; messages mark the settings they advise, which
`ugpum.wording.plain` words as the settings' names (`log=lambda text: print(plain(text))`).
"""
from .startup import hold_stops as _hold_stops

_hold_stops()       # the command line's start-up: a stop is one sentence until its work begins (ugpum/startup.py)
from .arch import UnknownModel, Workload, get_spec, recognise  # noqa: E402
from .planning.devices import Device, DeviceError, parse_device_specs, resolve_devices  # noqa: E402
from .planning.forecast import format_plan  # noqa: E402
from .placement.place import place, place_by_plan  # noqa: E402
from .planning.plan import Plan, PlanError, make_plan, plan_training  # noqa: E402
from .train.config import ConfigError, TrainConfig, load_config  # noqa: E402
from .train.loop import TrainResult, train  # noqa: E402
from .compute.lora import attach_lora  # noqa: E402
from .wording import EngineError  # noqa: E402

__all__ = ["ConfigError", "Device", "DeviceError", "EngineError", "Plan", "PlanError", "TrainConfig", "TrainResult",
           "UnknownModel", "Workload", "attach_lora", "format_plan", "get_spec", "load_config", "make_plan", "parse_device_specs",
           "place", "place_by_plan", "plan_training", "recognise", "resolve_devices", "train"]

"""What flows along the pack's own wires: UGPUM_MODEL (Loader -> Planner, Trainer, Sample Preview)
and UGPUM_PLAN (Planner -> Trainer, Sample Preview). Plain dataclasses: no weights, no ComfyUI
objects, so ComfyUI's cache can hold them for free."""
from __future__ import annotations

from dataclasses import dataclass

from comfy_api.latest import io

from ugpum.arch import ArchSpec
from ugpum.planning.devices import Device
from ugpum.planning.plan import Plan
from ugpum.train.config import TrainConfig

UGPUM_MODEL = io.Custom("UGPUM_MODEL")
UGPUM_PLAN = io.Custom("UGPUM_PLAN")
LORA_MODEL = io.Custom("LORA_MODEL")   # the stock LoRA dict (name -> tensor) LoraModelLoader takes


@dataclass(frozen=True)
class UGPUMModel:
    """A DiT checkpoint known from its header alone; its weights are placed later, by a plan."""
    family: str                 # ArchSpec.family: "flux2", "wan", ...
    model_id: str               # ArchSpec id, e.g. "flux2-klein-base-9b"
    title: str                  # e.g. "Flux.2-klein-base-9b" (modelspec architecture prefix)
    path: str                   # absolute path of the .safetensors file
    file_name: str              # as listed in ComfyUI's diffusion_models
    key_prefix: str             # "", "diffusion_model." or "model.diffusion_model."
    stored_dtype: str           # block weights in the file: "fp8", "bf16", "fp16" or "fp32"
    weight_dtype: str           # the Loader's weight_dtype: the dtype the base weights load in (TrainConfig's)
    devices: tuple[str, ...]    # device specs as typed: ("auto",), ("cuda:0", "cuda:1"), ("rtx4090",)
    spec: ArchSpec

    def describe(self) -> str:
        spec = self.spec
        kinds: dict[str, int] = {}
        for block in spec.blocks:
            kinds[block.kind] = kinds.get(block.kind, 0) + 1
        blocks = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        cast = "" if self.weight_dtype == self.stored_dtype else f" -> {self.weight_dtype}"
        params = f"{spec.params / 1e9:.2f} B" if spec.params >= 1e8 else f"{spec.params / 1e6:.2f} M"
        lines = [f"{self.file_name}: {self.model_id} ({params} parameters)",
                 f"{len(spec.blocks)} blocks ({blocks}), hidden {spec.hidden}",
                 f"weights {self.stored_dtype}{cast}; devices: {', '.join(self.devices)}"]
        lines += list(spec.notes)
        return "\n".join(lines)


@dataclass(frozen=True)
class UGPUMPlan:
    """A plan and everything it was made from, so later nodes never re-derive it: `config` holds the
    planning settings (the Trainer adds its own to the same TrainConfig), `plan` is what trains."""
    model: UGPUMModel
    plan: Plan
    devices: tuple[Device, ...]
    config: TrainConfig
    report: str                 # the forecast as the Planner shows it

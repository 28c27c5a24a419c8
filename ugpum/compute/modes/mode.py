"""What a base-compute mode answers: the one interface each mode of this folder fills in (a subclass of
`ComputeMode`, and `MODE = <an instance>` in its module, which is how the registry finds it)."""
from __future__ import annotations

import torch


class ComputeMode:
    """How the frozen base Linears of the blocks compute under `base_compute = <name>`.

    - What it quantises: nothing (`quantises` False: the exact base, computed as loaded), or each weight
      per output channel and each activation per token (`quantise_rows`).
    - How its matmul runs: `matmul`, on a device whose tensor cores it names (`min_capability`, `needs`);
      `ugpum.compute.base_compute` runs it in a Linear (and its fp32 reference emulation anywhere).
    - Its memory per weight: `held_dtype`, the weight dtype whose bytes a base weight takes on the GPUs.
    - Its speed factors: `dense_speed`, the base's dense matmuls as multiples of their bf16 speed,
      (forward, backward), measured for compiled and eager blocks (the planner's cost model reads them) on
      the GPU `speed_measured_on` names; other GPUs are forecast with the same ratios, and plans say so.
    - Its quality: `gradient_cosine`, the per-block cosine of the LoRA gradients it gives against the exact
      base's, as measured (None: never measured, and base_compute = auto never takes it); `quality` words it
      beside its plans.
    """
    name: str = ""
    order: int = 0                      # its place in every list of modes (auto keeps the first on a tie)
    quantises: bool = True
    held_dtype: str | None = None       # None: the base is held as the run's weight dtype holds it
    dense_speed: dict[str, tuple[float, float]] = {"compiled": (1.0, 1.0), "eager": (1.0, 1.0)}
    speed_measured_on: dict[str, str] = {}   # per dense_speed key: the GPU (a name's words) it was measured on
    gradient_cosine: float | None = None
    # Host memory its runs held beyond the exact base's, GiB (measured: bench/calibration_fit.py); the planner adds
    # it to the family's figure.
    extra_host_gib: float = 0.0
    # The CUDA compute capability its kernels need, or None: it runs on any device. base_compute = auto
    # weighs only modes with tensor-core kernels (a capability), for their speed.
    min_capability: tuple[int, int] | None = None
    needs: str = ""                     # that capability in words, for refusals
    qmax: float = 1.0                   # the largest magnitude of its quantised grid
    min_rows: int = 0                   # the fewest rows its matmul kernel takes (fewer are padded with zeros)

    @property
    def quality(self) -> str:
        """Its quality in words, shown beside its plans."""
        if not self.quantises:
            return "the exact base"
        if self.gradient_cosine is None:
            return "LoRA gradients vs the bf16 base: not measured"
        return f"LoRA gradients vs the bf16 base: cosine {self.gradient_cosine:g} per block"

    def runs_on(self, capability: tuple[int, int] | None) -> bool:
        """Whether a device of this compute capability (None: no CUDA GPU) runs its kernels."""
        return self.min_capability is None or (capability is not None and tuple(capability) >= self.min_capability)

    def to_grid(self, t: torch.Tensor) -> torch.Tensor:
        """An fp32 tensor already scaled into [-qmax, qmax], as the quantised dtype."""
        raise NotImplementedError(f"{self.name} quantises nothing")

    def quantise_rows(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric per-row quantisation of a 2-D tensor: (q, scale [rows, 1] fp32), t ~= q * scale."""
        amax = t.detach().abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
        scale = amax / self.qmax
        return self.to_grid(t.float() / scale), scale

    def matmul(self, a: torch.Tensor, sa: torch.Tensor, b_t: torch.Tensor, sb: torch.Tensor | None,
               out_dtype: torch.dtype, lora: tuple | None = None) -> torch.Tensor:
        """(a * sa) @ (b_t^T * sb) on its kernel: a [M, K] quantised per row with sa [M, 1]; b_t [N, K]
        quantised with sb [N] (None for 1). Result [M, N] in out_dtype. `lora` (h [M, r], B [N, r], scale), only
        where `takes_lora`: + scale * h @ B^T, added by the same kernel."""
        raise NotImplementedError(f"{self.name} quantises nothing")

    def takes_lora(self) -> bool:
        """Whether `matmul` adds a LoRA's up-projection in its own kernel (then the LoRA's hook stands aside)."""
        return False

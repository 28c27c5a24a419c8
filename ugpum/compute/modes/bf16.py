"""base_compute = bf16: the exact base, its Linears computed as loaded (bf16 under autocast)."""
from __future__ import annotations

from .mode import ComputeMode


class Bf16(ComputeMode):
    name = "bf16"
    order = 0
    quantises = False
    dense_speed = {"compiled": (1.0, 1.0), "eager": (1.0, 1.0)}       # (the unit the other modes are measured in)


MODE = Bf16()

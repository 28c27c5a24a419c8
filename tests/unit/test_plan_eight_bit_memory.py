"""The 8-bit base's memory terms that differ from fp8 weights (issue 24): the head stays bf16 and no weight
is cast to a copy. (The rows measured through the CLI: tests/unit/test_calibration.py.)"""
from __future__ import annotations

import dataclasses

from ugpum.planning import cost
from ugpum.arch import Workload, get_spec
from ugpum.planning.devices import Device
from ugpum.planning.plan import GIB, StageCosts

WAN = get_spec("wan2.1-14b")
KLEIN = get_spec("flux2-klein-9b")


def _wan_16_fp8():
    return Workload(width=640, height=640, frames=17, rank=32, compiled=True, base_compute="fp8", held_dtype="fp8")


def test_the_head_stays_bf16_under_the_8bit_base_but_not_with_fp8_weights():
    w8 = _wan_16_fp8()
    fp8_weights = dataclasses.replace(w8, base_compute="bf16")
    dev = [Device("cuda:0 NVIDIA H200", "cuda:0", 139 * GIB, 139 * GIB, 769.0, 55.0, "pcie5x16", (9, 0))]
    extra = StageCosts(WAN, dev, w8, 1).head - StageCosts(WAN, dev, fp8_weights, 1).head
    assert extra == WAN.head_params          # one more byte each: only the blocks' Linears are quantised


def test_no_cast_copies_under_the_8bit_base():
    w8 = _wan_16_fp8()
    block = WAN.blocks[0]
    assert cost.cast_copy_bytes(block, w8) == 0
    assert cost.cast_copy_bytes(block, dataclasses.replace(w8, base_compute="bf16")) == 2 * block.params

"""The 8-bit base's GEMMs of one klein 9B step, alone (issue 41): each (M, N, K) the step runs, as many times as it
runs it (1024², recompute all with the attention kept: the fp8 kernel table of bench/results, the sixth call set),
on cuBLAS's bf16 GEMM (the reference) and fp8 GEMM (`torch._scaled_mm`, row-wise scales), `torch._int_mm`, and
our int8 Triton GEMM with each thread's loads and with Hopper's tensor memory accelerator
(`ugpum.compute.kernels.matmul_8bit.DESCRIPTORS`), each autotuned as training runs it and with fixed tiles; with and
without the LoRA term in the epilogue; and the backward's on-the-fly weight transpose, timed at every call's shape
(a step makes one a layer: 112 of the 294). One JSON row per variant: ms a step and ms per shape.

    python bench/gemm_8bit.py --rows OUT/gemm_8bit.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ugpum.compute.kernels import cdiv, matmul_8bit  # noqa: E402
from ugpum.formats.atomic import append_line  # noqa: E402

# (M, N, K): calls a step
SHAPES = {(4608, 36864, 4096): 48, (4608, 4096, 36864): 24, (4608, 4096, 16384): 24, (4608, 16384, 4096): 24,
          (4096, 24576, 4096): 16, (4096, 12288, 4096): 24, (4096, 4096, 24576): 8, (4096, 4096, 12288): 15,
          (4096, 4096, 4096): 24, (512, 24576, 4096): 16, (512, 12288, 4096): 24, (512, 4096, 12288): 15,
          (512, 4096, 24576): 8, (512, 4096, 4096): 24}
# (BM, BN, BK, warps, stages) the TMA kernel is also timed with, fixed
TILES = [(128, 256, 128, 8, 3), (128, 256, 128, 8, 4), (256, 128, 128, 8, 3), (128, 128, 128, 8, 4),
         (128, 128, 128, 4, 5), (128, 128, 256, 8, 3), (128, 256, 64, 8, 5), (256, 128, 64, 8, 5)]


def operands(m, n, k):
    a = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
    sa, sb = torch.rand(m, 1, device="cuda") / 127, torch.rand(n, device="cuda") / 127
    h, lb = torch.randn(m, 16, device="cuda", dtype=torch.bfloat16), torch.randn(n, 16, device="cuda",
                                                                                 dtype=torch.bfloat16)
    return a, sa, b, sb, h, lb


def time_ms(fn, repeats: int = 20) -> float:
    """Median of `repeats` timed calls (CUDA events), after three warm-up calls."""
    for _ in range(3):
        fn()
    starts, ends = ([torch.cuda.Event(enable_timing=True) for _ in range(repeats)] for _ in range(2))
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[repeats // 2]


_casts: dict = {}


def cast(a, b, dtype):
    """a and b as dtype, cast once per operand pair (before the timed calls, which then time only the GEMM)."""
    if (key := (a.data_ptr(), b.data_ptr(), dtype)) not in _casts:
        _casts[key] = a.to(dtype), b.to(dtype)
    return _casts[key]


def fixed_tiles(tile, fp8_inputs=False, lora=False):
    """The TMA kernel with these tiles (no autotuning), on the int8 operands or on them as fp8 e4m3."""
    from ugpum.compute.kernels import triton_kernels as k
    bm, bn, bk, warps, stages = tile

    def run(a, sa, b, sb, h, lb):
        if fp8_inputs:
            a, b = cast(a, b, torch.float8_e4m3fn)
        (m, kk), n = a.shape, b.shape[0]
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        k.scaled_mm_8bit_tma.fn[(cdiv(m, bm) * cdiv(n, bn),)](
            a, b, sa.reshape(-1), sb, c, h, lb, m, n, kk, 16 if lora else 0, 0.5, BM=bm, BN=bn, BK=bk, LORA=lora,
            BR=k.TILE_R, GROUP=8, num_warps=warps, num_stages=stages)
        return c
    return run


def op(descriptors: bool, lora: bool):
    def run(a, sa, b, sb, h, lb):
        matmul_8bit.DESCRIPTORS = descriptors
        return matmul_8bit.scaled_mm_8bit(a, sa, b, sb, torch.bfloat16, *((h, lb, 0.5) if lora else ()))
    return run


def fp8(a, sa, b, sb, h, lb):
    a8, b8 = cast(a, b, torch.float8_e4m3fn)
    return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.reshape(1, -1), out_dtype=torch.bfloat16)


def bf16(a, sa, b, sb, h, lb):                     # cuBLAS's bf16 GEMM at the same shape: the reference
    a16, b16 = cast(a, b, torch.bfloat16)
    return a16 @ b16.t()


VARIANTS = {"bf16-cublas": bf16, "fp8-cublas": fp8, "int_mm": lambda a, sa, b, sb, h, lb: torch._int_mm(a, b.t()),
            "int8-loads": op(False, False), "int8-loads-lora": op(False, True),
            "int8-tma": op(True, False), "int8-tma-lora": op(True, True),
            "weight-transpose": lambda a, sa, b, sb, h, lb: b.t().contiguous(),
            **{"int8-tma-" + "x".join(map(str, t)): fixed_tiles(t) for t in TILES},
            # fp8 on the same kernel, where its epilogue could add the LoRA (cuBLAS's cannot)
            **{"fp8-tma-" + "x".join(map(str, t)): fixed_tiles(t, fp8_inputs=True) for t in TILES[:4]},
            "fp8-tma-lora-" + "x".join(map(str, TILES[0])): fixed_tiles(TILES[0], fp8_inputs=True, lora=True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", required=True, help="JSON lines file the rows are appended to")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    a = p.parse_args(argv)
    from ugpum.compute import kernels
    kernels.turn_on("int8-kernel")
    inputs = {shape: operands(*shape) for shape in SHAPES}
    for name in a.variants:
        per_shape, error = {}, None
        for (m, n, k), calls in SHAPES.items():
            try:
                got = VARIANTS[name](*inputs[(m, n, k)])
                if "tma" in name and "lora" not in name:      # its product checked against cuBLAS's or the loads'
                    want = VARIANTS["fp8-cublas" if name.startswith("fp8") else "int8-loads"](*inputs[(m, n, k)])
                    assert (got.float() - want.float()).norm() <= 1e-2 * want.float().norm(), "wrong product"
                per_shape[f"{m}x{n}x{k}"] = round(time_ms(lambda: VARIANTS[name](*inputs[(m, n, k)]), 10), 4)
            except Exception as err:          # noqa: BLE001  (a variant this GPU or Triton cannot run: its row says so)
                error = f"{m}x{n}x{k}: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                break
        row = {"variant": name, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
        if error:
            row["error"] = error
        else:
            ms = sum(per_shape[f"{m}x{n}x{k}"] * calls for (m, n, k), calls in SHAPES.items())
            flop = sum(2 * m * n * k * calls for (m, n, k), calls in SHAPES.items())
            row.update(ms_per_step=round(ms, 2), tops=round(flop / ms / 1e9, 1), ms_per_shape=per_shape)
        print(json.dumps({k: v for k, v in row.items() if k != "ms_per_shape"}), flush=True)
        append_line(a.rows, json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

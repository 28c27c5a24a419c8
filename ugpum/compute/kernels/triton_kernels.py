"""The Triton kernels of `ugpum.compute.kernels`' ops, imported only where one runs (a CUDA device, Triton
installed, the op turned on): importing Triton takes a second or more."""
import triton
import triton.language as tl

TILE_R = 16                                     # the LoRA's rank is taken in steps of 16 (tl.dot's least K)


@triton.jit
def up_projection(h_ptr, b_ptr, rm, rn, M, N, R, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    # a LoRA's up-projection on one tile of the output, fp32: h[rm] @ b[rn]^T; h [M, R], b [N, R] row-major
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for r0 in range(0, R, BR):
        rr = r0 + tl.arange(0, BR)
        h = tl.load(h_ptr + rm[:, None] * R + rr[None, :], mask=(rm[:, None] < M) & (rr[None, :] < R), other=0.0)
        b = tl.load(b_ptr + rn[None, :] * R + rr[:, None], mask=(rn[None, :] < N) & (rr[:, None] < R), other=0.0)
        acc += tl.dot(h, b)
    return acc


@triton.jit
def rescaled_out(acc, rm, rn, sa_ptr, sb_ptr, c_ptr, h_ptr, lb_ptr, M, N, R, scale,
                 BM: tl.constexpr, BN: tl.constexpr, LORA: tl.constexpr, BR: tl.constexpr):
    # an 8-bit GEMM's epilogue on tile (rm, rn): c = acc * sa[:, None] * sb[None, :] (+ scale * h @ lb^T, LORA)
    sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
    sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
    c = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    if LORA:
        c += up_projection(h_ptr, lb_ptr, rm, rn, M, N, R, BM, BN, BR) * scale
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], c.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


# A pass over the layer's output, bound by memory: the 128 x 128 tile of 4 warps measured on the H100 (bench/results,
# the fifth call set: 25 ms a klein 9B step, ~60 % of HBM's bandwidth) and wider ones, the fastest kept per shape.
@triton.autotune(configs=[triton.Config({"BM": 128, "BN": 128}, num_warps=4),
                          triton.Config({"BM": 128, "BN": 128}, num_warps=8),
                          triton.Config({"BM": 64, "BN": 256}, num_warps=8),
                          triton.Config({"BM": 128, "BN": 256}, num_warps=8)],
                 key=["M", "N", "R"])
@triton.jit
def add_up_projection(out_ptr, h_ptr, b_ptr, y_ptr, M, N, R, scale,
                      BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    # the LoRA's up-projection added: y = out + scale * h @ b^T, all four row-major and contiguous:
    # out, y [M, N]; h [M, R]; b [N, R]
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = up_projection(h_ptr, b_ptr, rm, rn, M, N, R, BM, BN, BR)
    at, inside = rm[:, None] * N + rn[None, :], (rm[:, None] < M) & (rn[None, :] < N)
    y = tl.load(out_ptr + at, mask=inside, other=0.0).to(tl.float32) + acc * scale
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.autotune(configs=[triton.Config({"BM": 128, "BN": 256, "BK": 128}, num_warps=8, num_stages=3),
                          triton.Config({"BM": 256, "BN": 128, "BK": 128}, num_warps=8, num_stages=3),
                          triton.Config({"BM": 128, "BN": 128, "BK": 128}, num_warps=4, num_stages=4),
                          triton.Config({"BM": 64, "BN": 128, "BK": 128}, num_warps=4, num_stages=4)],
                 key=["M", "N", "K"])
@triton.jit
def scaled_mm_8bit(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, h_ptr, lb_ptr, M, N, K, R, scale,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LORA: tl.constexpr, BR: tl.constexpr):
    # the int8 base's matmul and rescale: c = (a @ b^T) * sa[:, None] * sb[None, :]; a [M, K], b [N, K],
    # c [M, N]: row-major and contiguous. LORA: + scale * h @ lb^T, a LoRA's up-projection (h [M, R], lb [N, R]),
    # computed from h and lb in the epilogue: no [M, N] term is read.
    # Programs go down a column of tiles first: the ones running together share b's tiles in L2.
    pid, rows = tl.program_id(0), tl.cdiv(M, BM)
    rm = (pid % rows) * BM + tl.arange(0, BM)
    rn = (pid // rows) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0)
        b = tl.load(b_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0)
        acc += tl.dot(a, tl.trans(b))
    rescaled_out(acc, rm, rn, sa_ptr, sb_ptr, c_ptr, h_ptr, lb_ptr, M, N, R, scale, BM, BN, LORA, BR)


# The same GEMM with its tiles brought in by Hopper's tensor memory accelerator (device-side descriptors, Triton 3.3+)
# instead of each thread's loads, in groups of GROUP row tiles that share b's tiles in L2. Its descriptors take
# scratch memory from the allocator Triton is given (`matmul_8bit`; inductor sets its own). Every constexpr comes
# from the configs or the call: inductor passes no default (GROUP = 8 as a default failed to compile there, H100).
@triton.autotune(configs=[triton.Config({"BM": 128, "BN": 256, "BK": 128, "GROUP": 8}, num_warps=8, num_stages=3),
                          triton.Config({"BM": 256, "BN": 128, "BK": 128, "GROUP": 8}, num_warps=8, num_stages=3),
                          triton.Config({"BM": 128, "BN": 128, "BK": 128, "GROUP": 8}, num_warps=8, num_stages=4),
                          triton.Config({"BM": 128, "BN": 128, "BK": 256, "GROUP": 8}, num_warps=8, num_stages=3),
                          triton.Config({"BM": 64, "BN": 128, "BK": 128, "GROUP": 8}, num_warps=4, num_stages=4)],
                 key=["M", "N", "K"])
@triton.jit
def scaled_mm_8bit_tma(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, h_ptr, lb_ptr, M, N, K, R, scale,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LORA: tl.constexpr, BR: tl.constexpr,
                       GROUP: tl.constexpr):
    # as scaled_mm_8bit, also for fp8 e4m3 a and b; K a multiple of 16 (a descriptor's rows are 16-byte aligned)
    pid, rows, cols = tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN)
    group_first = pid // (GROUP * cols) * GROUP
    group_rows = min(rows - group_first, GROUP)
    pm = group_first + (pid % (GROUP * cols)) % group_rows
    pn = (pid % (GROUP * cols)) // group_rows
    a_tiles = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_tiles = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    acc = tl.zeros((BM, BN), dtype=tl.int32 if a_ptr.dtype.element_ty == tl.int8 else tl.float32)
    for k0 in range(0, K, BK):     # (out_dtype named: Triton 3.6's dot takes fp32 unless told, refusing an int32 acc)
        acc = tl.dot(a_tiles.load([pm * BM, k0]), tl.trans(b_tiles.load([pn * BN, k0])), acc, out_dtype=acc.dtype)
    rescaled_out(acc, pm * BM + tl.arange(0, BM), pn * BN + tl.arange(0, BN), sa_ptr, sb_ptr, c_ptr, h_ptr, lb_ptr,
                 M, N, R, scale, BM, BN, LORA, BR)

"""The Triton kernels of :mod:`ttrace._stats_kernel` (imported by it on first use: importing
this module imports Triton). Defined at module level, so that Triton finds the helper
:func:`keep` among the kernels' globals when it compiles them."""

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

__all__ = ["extremes", "first", "keep"]


@triton.jit
def keep(hi, lo, top_ptr, bottom_ptr, out, BLOCK: tl.constexpr, K: tl.constexpr):
    # The K largest of hi and the K smallest of lo, in order, at out: each pass takes the
    # extreme and removes that one lane (ties keep their multiplicity).
    lanes = tl.arange(0, BLOCK)
    for j in tl.static_range(K):
        v, i = tl.max(hi, 0, return_indices=True)
        tl.store(top_ptr + out + j, v)
        hi = tl.where(lanes == i, float("-inf"), hi)
        v, i = tl.min(lo, 0, return_indices=True)
        tl.store(bottom_ptr + out + j, v)
        lo = tl.where(lanes == i, float("inf"), lo)


@triton.jit
def first(x_ptr, part_ptr, top_ptr, bottom_ptr, n, BLOCK: tl.constexpr,
          K: tl.constexpr, WIDEN: tl.constexpr):
    # One block: its counts and f64 sums, and its K extremes per side.
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    if WIDEN:
        x = x.to(tl.float32)  # 16-bit formats: exact in FP32, then in float64
    x = x.to(tl.float64)
    nan = inside & (x != x)
    pinf = inside & (x == float("inf"))
    ninf = inside & (x == float("-inf"))
    finite = inside & (x == x) & (x != float("inf")) & (x != float("-inf"))
    x0 = tl.where(finite, x, 0.0)
    base = part_ptr + pid.to(tl.int64) * 6
    tl.store(base + 0, tl.sum(nan.to(tl.int32), 0).to(tl.float64))
    tl.store(base + 1, tl.sum(pinf.to(tl.int32), 0).to(tl.float64))
    tl.store(base + 2, tl.sum(ninf.to(tl.int32), 0).to(tl.float64))
    tl.store(base + 3, tl.sum(x0, 0))
    tl.store(base + 4, tl.sum(x0 * x0, 0))
    tl.store(base + 5, tl.sum(tl.abs(x0), 0))
    keep(tl.where(finite, x, float("-inf")), tl.where(finite, x, float("inf")),
         top_ptr, bottom_ptr, pid.to(tl.int64) * K, BLOCK, K)


@triton.jit
def extremes(top_in, bottom_in, top_out, bottom_out, n, BLOCK: tl.constexpr,
             K: tl.constexpr):
    # One block of candidates: its K extremes per side.
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    keep(tl.load(top_in + offs, mask=inside, other=float("-inf")),
         tl.load(bottom_in + offs, mask=inside, other=float("inf")),
         top_out, bottom_out, pid.to(tl.int64) * K, BLOCK, K)

"""The statistics of a summarized tensor in a few fused Triton kernels, on a CUDA device.

One pass reads the tensor once: each program takes a block of ``BLOCK`` elements and writes
the block's NaN, +∞ and −∞ counts, Σx, Σx², Σ|x| over its finite elements (float64 from the
elements' values, exact in float64; the squares of float64 elements round once, as in the Rust
pass) and its ``k`` largest and ``k`` smallest finite values (−∞ / +∞ where it has fewer).
Further passes keep the ``k`` extremes of every ``BLOCK`` candidates until one block is left;
the block sums are added by torch in float64. So the extremes are exact (each block's ``k``
extremes contain every one of the tensor's ``k`` extremes that lies in it, ties counted by
position) and the sums carry float64 round-off of a sum in some order, which the comparison's
interval holds (``papers/summaries.md``). A handful of launches per tensor instead of two dozen
torch reductions, each re-reading the tensor: the host issues them faster than the device runs
a training step's kernels, and the device reads each byte once.

Used by :func:`ttrace._summaries._device_stats` where Triton is importable (it ships with
PyTorch's CUDA wheels) and ``k`` ≤ :data:`MAX_K`; elsewhere the torch reductions. The
kernels are in :mod:`ttrace._stats_triton`; importing this module imports no Triton:
:func:`stats` does, on its first call.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

__all__ = ["BLOCK", "MAX_K", "stats"]

#: Elements per program.
BLOCK = 4096
#: The most extremes per side the kernels keep (an unrolled loop of arg-max passes).
MAX_K = 16

_kernels: Dict[str, Any] = {}


def _build() -> Dict[str, Any]:
    from . import _stats_triton

    return {"first": _stats_triton.first, "extremes": _stats_triton.extremes}


def available() -> bool:
    """Whether Triton can be imported (it is not imported until :func:`stats` runs)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def stats(x: torch.Tensor, k: int) -> torch.Tensor:
    """The statistics vector ``[nan, +inf, -inf, Σx, Σx², Σ|x|, top k…, bottom k…]``
    (float64, where ``x`` lives) of the 1-D contiguous float tensor ``x`` (16, 32 or 64-bit
    elements), for 1 ≤ ``k`` ≤ :data:`MAX_K` and ``k`` ≤ its elements. No host
    synchronization."""
    if not 1 <= k <= MAX_K or x.dim() != 1 or not x.is_contiguous() or x.numel() < k:
        raise ValueError(f"stats: a 1-D contiguous tensor of at least k elements, "
                         f"1 <= k <= {MAX_K} (got k={k}, shape {tuple(x.shape)})")
    if not _kernels:
        _kernels.update(_build())
    n = x.numel()
    # Two allocations: the result (the sums, then the k extremes per side, which the last
    # level writes in place), and the block sums with every other level's top and bottom
    # candidates (freed once the step's launches are queued; the result is kept until the
    # step's statistics are gathered).
    sizes = [-(-n // BLOCK)]
    while sizes[-1] > 1:
        sizes.append(-(-sizes[-1] * k // BLOCK))
    result = torch.empty(6 + 2 * k, dtype=torch.float64, device=x.device)
    buffer = torch.empty(6 * sizes[0] + sum(2 * b * k for b in sizes[:-1]),
                         dtype=torch.float64, device=x.device)
    parts = buffer[: 6 * sizes[0]].view(sizes[0], 6)
    at = 6 * sizes[0]

    def candidates(level: int) -> "tuple[torch.Tensor, torch.Tensor]":
        nonlocal at
        if level == len(sizes) - 1:  # the last level: k per side, into the result
            return result[6: 6 + k], result[6 + k:]
        m = sizes[level] * k
        pair = buffer[at: at + m], buffer[at + m: at + 2 * m]
        at += 2 * m
        return pair

    top, bottom = candidates(0)
    _kernels["first"][(sizes[0],)](x, parts, top, bottom, n, BLOCK=BLOCK, K=k,
                                   WIDEN=x.element_size() == 2)
    for level in range(1, len(sizes)):
        next_top, next_bottom = candidates(level)
        _kernels["extremes"][(sizes[level],)](top, bottom, next_top, next_bottom, top.numel(),
                                              BLOCK=BLOCK, K=k)
        top, bottom = next_top, next_bottom
    torch.sum(parts, 0, out=result[:6])
    return result

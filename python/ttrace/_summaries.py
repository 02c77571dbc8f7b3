"""Per-tensor statistics computed where the tensor lives (``Tracer(..., summaries=True)``).

For each recorded tensor (this rank's shard): the counts of NaN, +∞ and −∞; over the finite
elements, in float64 from values exact in float64, Σx, Σx², Σ|x|; the ``k`` largest and ``k``
smallest finite values. The reductions run on the tensor's device as part of the step's work
(no host synchronization; a CPU tensor in one pass of the Rust core); at the end of the step
the small results of all tensors are
concatenated on each device and copied in one asynchronous transfer into pinned host memory,
followed by an event that only the writer thread waits for. What the statistics can and cannot
prove is in ``papers/summaries.md``; the Rust core writes and compares them.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _stats_kernel, _ttrace
from ._copies import to_host

__all__ = ["DEFAULT_K", "Pending", "ShardStats", "Summarizer"]

#: Extremes kept per side by default.
DEFAULT_K = 8


class ShardStats:
    """One tensor's statistics, still on its device: ``[nan, +inf, -inf, Σx, Σx², Σ|x|,
    top…, bottom…]`` as float64."""

    __slots__ = ("values", "dtype", "shape", "kept")

    def __init__(self, values: torch.Tensor, dtype: torch.dtype, shape: torch.Size,
                 kept: int) -> None:
        self.values = values
        self.dtype = dtype
        self.shape = shape
        #: Extremes computed per side (min(k, elements)).
        self.kept = kept


#: One device's share of a step: the host tensor, the event its transfer ends with (None on
#: the CPU), and per stats vector (its index in the step, (start, end) in the host tensor).
_Part = Tuple[torch.Tensor, Optional[Any], List[Tuple[int, Tuple[int, int]]]]


class Pending:
    """The statistics of one step on their way to the host."""

    def __init__(self, parts: List[_Part]) -> None:
        self._parts = parts

    def wait(self) -> List[List[float]]:
        """The statistics as Python floats, in the order they were gathered (waits for the
        transfers' events: call it on the writer thread)."""
        out: Dict[int, List[float]] = {}
        for host, event, slots in self._parts:
            if event is not None:
                event.synchronize()
            flat = host.tolist()
            for order, (start, end) in slots:
                out[order] = flat[start:end]
        return [out[i] for i in range(len(out))]


class Summarizer:
    """Computes :class:`ShardStats` on the tensors' devices and gathers them per step."""

    def __init__(self, k: int = DEFAULT_K) -> None:
        if not 1 <= k <= 1024:
            raise ValueError(f"k must be 1 to 1024 (got {k})")
        self.k = k
        #: Bytes of tensors summarized so far (each read once; reused statistics not counted).
        self.bytes_read = 0

    def summarize(self, t: torch.Tensor, fmt: str, scale: Optional[float] = None) -> ShardStats:
        """The statistics of ``t``, stored as ``fmt`` (times ``scale``, applied where ``t``
        lives, as the host copies apply it). On the CPU in one pass of the Rust core (on this
        thread, GIL released); on a device as torch reductions there, without synchronizing."""
        src = t.detach()
        if scale is not None:
            src = src * scale
        n = src.numel()
        kept = min(self.k, n)
        self.bytes_read += n * src.element_size()
        if src.device.type == "cpu":
            flat = src.reshape(-1).contiguous()
            values = _ttrace.summarize(flat.view(torch.uint8).numpy(), fmt, self.k)
            return ShardStats(torch.tensor(values, dtype=torch.float64), src.dtype, src.shape,
                              kept)
        return ShardStats(_device_stats(src, self.k), src.dtype, src.shape, kept)

    def gather(self, stats: List[ShardStats]) -> Pending:
        """Start moving ``stats`` to the host: one concatenation and one transfer per device
        (asynchronous into pinned memory on CUDA, ordered after the step's work by an event)."""
        by_device: Dict[Any, List[int]] = {}
        for i, s in enumerate(stats):
            by_device.setdefault(s.values.device, []).append(i)
        parts: List[_Part] = []
        for idx in by_device.values():
            flat = torch.cat([stats[i].values for i in idx])
            slots: List[Tuple[int, Tuple[int, int]]] = []
            at = 0
            for i in idx:
                n = stats[i].values.numel()
                slots.append((i, (at, at + n)))
                at += n
            host, event = to_host(flat)
            parts.append((host, event, slots))
        return Pending(parts)


#: Elements per chunk of the extremes' first pass (:func:`_extreme`), and the fewest chunks
#: for which it pays: on an H100 a topk over 8 M BF16 elements took 0.14 ms against 0.26 ms
#: chunked, over 33 M 0.41 ms against 0.36 ms.
_CHUNK = 4096
_MIN_CHUNKS = 4096


def _extreme(v: torch.Tensor, k: int, largest: bool) -> torch.Tensor:
    """The ``k`` largest (smallest) values of the 1-D ``v``, in order, from one pass over it:
    each chunk's maximum (minimum), the ``k`` chunks with the largest (smallest) of them, and
    the ``k`` extremes among their elements and the tail's. Exact: a chunk holding one of the
    ``k`` extremes, were it not among those ``k`` chunks, would be beaten by ``k`` chunks
    whose extremes are ``k`` elements at least as far out. (``topk`` over the whole tensor
    reads it once per radix digit.)"""
    n = v.numel()
    chunks = n // _CHUNK
    if chunks < max(4 * k, _MIN_CHUNKS):
        return v.topk(k, largest=largest).values
    head = v[: chunks * _CHUNK].view(chunks, _CHUNK)
    ends = head.amax(dim=1) if largest else head.amin(dim=1)
    picked = ends.topk(k, largest=largest).indices
    candidates = torch.cat([head[picked].reshape(-1), v[chunks * _CHUNK:]])
    return candidates.topk(k, largest=largest).values


#: Whether the fused kernels (:mod:`ttrace._stats_kernel`) serve CUDA tensors: unknown until
#: the first one, then whether Triton imported and compiled them.
_fused: Optional[bool] = None


def _device_stats(src: torch.Tensor, k: int) -> torch.Tensor:
    """The statistics vector of ``src`` where it lives, without host synchronization: on a
    CUDA device from the fused Triton kernels (:mod:`ttrace._stats_kernel`) when Triton is
    there; else from torch reductions — counts and extremes in the tensor's own dtype (its
    values are exact there), the sums in float64 over a float64 copy of the finite values
    (exact; on an H100 the copy and three reductions of it took 0.45 ms for 64 MB of BF16,
    reductions accumulating BF16 into float64 themselves 0.77 ms)."""
    global _fused
    x = src.reshape(-1)
    if x.element_size() == 1:
        x = x.float()  # FP8: exact in FP32, where every reduction below is defined
    f64 = torch.float64
    kept = min(k, x.numel())
    if x.is_cuda and 1 <= kept <= _stats_kernel.MAX_K and _fused is not False:
        if _fused is None:
            _fused = _stats_kernel.available()
        if _fused:
            try:
                return _stats_kernel.stats(x.contiguous(), kept)
            except Exception as e:  # a Triton that cannot build for this device
                _fused = False
                warnings.warn(f"ttrace: the fused statistics kernels failed ({e}); summaries "
                              "use torch reductions instead", RuntimeWarning, stacklevel=2)
    finite = torch.isfinite(x)
    counts = torch.stack([torch.isnan(x).sum(), torch.isposinf(x).sum(),
                          torch.isneginf(x).sum()]).to(f64)
    x0 = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    xd = x0.to(f64)
    sums = torch.stack([xd.sum(), torch.dot(xd, xd), torch.linalg.vector_norm(xd, 1)])
    del xd
    parts = [counts, sums]
    if kept:
        low = torch.full((), -math.inf, dtype=x.dtype, device=x.device)
        high = torch.full((), math.inf, dtype=x.dtype, device=x.device)
        parts.append(_extreme(torch.where(finite, x, low), kept, True).to(f64))
        parts.append(_extreme(torch.where(finite, x, high), kept, False).to(f64))
    return torch.cat(parts)


def entry_stats(values: List[float], kept: int, k: int) -> Optional[Dict[str, Any]]:
    """A summary entry's statistics fields from one gathered vector; ``None`` when its float64
    sums overflowed (a float64 tensor beyond about 1e154: nothing is summarized)."""
    nan, pinf, ninf, s1, s2, a1 = values[:6]
    if not all(math.isfinite(v) for v in (s1, s2, a1)):
        return None
    top = [v for v in values[6:6 + kept] if math.isfinite(v)]
    bottom = [v for v in values[6 + kept:6 + 2 * kept] if math.isfinite(v)]
    return {"nan": int(nan), "pinf": int(pinf), "ninf": int(ninf), "sum": s1, "sum_sq": s2,
            "sum_abs": a1, "k": k, "top": top, "bottom": bottom}

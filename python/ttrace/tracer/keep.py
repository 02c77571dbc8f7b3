"""What a recorded tensor becomes: a host copy (full traces) or its statistics (summaries),
shared with an earlier record of the same tensor in the step where that is safe."""

from __future__ import annotations

import weakref
from typing import Any, Optional, cast

import torch

from .._copies import Copier, HostCopy, checksum
from .._copies import bits as _bits
from .._summaries import ShardStats, Summarizer
from .record import _DTYPES, _StepRecord, _alias_key, _owns


def _owner(t: Any, local: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``local`` is (a DTensor's local shard, else itself)."""
    return t._local_tensor if local is not t and hasattr(t, "_local_tensor") else local


def _shares_by_identity(local: torch.Tensor) -> bool:
    """Whether a tensor handed on unchanged shares its first record's copy by identity,
    verified later by a checksum (devices: comparing contents there would make the host wait),
    rather than by comparing contents now (the CPU)."""
    return local.device.type != "cpu"


def host_copy(s: _StepRecord, copier: Copier, t: Any, local: torch.Tensor,
              scale: Optional[float], tid: str, module: str, share: bool = True) -> HostCopy:
    """The host copy of a recorded tensor ``tid`` of ``module`` (``local``, the local shard of
    ``t``, times ``scale``), shared with an earlier record of the same tensor in the step.

    The same tensor: the same memory (address, shape, strides, dtype) at the same version,
    still owned by the earlier record's holder. On the CPU its contents are then compared
    bitwise (torch can free a live tensor's storage and reuse the memory — DTensor's
    collectives do — and a collective or a ``.data`` write changes memory without counting a
    version). On a device that comparison would make the host wait: a record handed on from
    another module call (an output that is the next module's input, a gradient handed back)
    shares the copy and adds the checksum of the memory it sees, which the writer compares
    with the checksum taken when the copy was made (both computed on the device) — a
    difference is an error, never a silently wrong trace; a module call that already
    recorded the memory (an input it returns, perhaps written in place by a collective)
    copies it again, and the writer stores equal contents once. ``share=False``: every
    record is copied. Raises ``RuntimeError`` for a tensor whose storage torch has
    released."""
    # The tracer's own torch calls skip the attention-site mode (sites.py) that sees the
    # model's: a few microseconds each, on plain local tensors.
    with torch._C.DisableTorchFunction():
        return _host_copy(s, copier, t, local, scale, tid, module, share)


def _host_copy(s: _StepRecord, copier: Copier, t: Any, local: torch.Tensor,
               scale: Optional[float], tid: str, module: str, share: bool) -> HostCopy:
    key = _alias_key(local)
    same = (key, local._version, scale is not None)
    hit = s.copies.get(same) if key is not None else None
    if share and hit is not None and scale is None and isinstance(hit[1], HostCopy):
        candidate = cast(HostCopy, hit[1])
        if not _shares_by_identity(local):
            if hit[0]() is not None and torch.equal(_bits(candidate.tensor),
                                                    _bits(local.detach())):
                return candidate
        elif module not in hit[2] and _owns(hit[0](), local):
            hit[2].add(module)
            candidate.checks.append((tid, checksum(local)))
            return candidate
    copy = copier.copy(local, scale)
    s.made.append(copy)
    if key is not None:
        s.copies[same] = (weakref.ref(_owner(t, local)), copy, {module})
        if share and scale is None and _shares_by_identity(local):
            copy.origin = checksum(local)
    return copy


def statistics(s: _StepRecord, summarizer: Summarizer, t: Any, local: torch.Tensor,
               scale: Optional[float]) -> ShardStats:
    """Summaries only: the statistics of a recorded tensor, computed where it lives — or those
    of the same memory recorded earlier in the step (an input that is the previous module's
    output), when its first holder still owns that memory and nothing wrote to it since (the
    version counter its views share). No contents are compared, so nothing waits for the
    device."""
    key = _alias_key(local)
    same = (key, local._version, scale is not None)
    hit = s.copies.get(same) if key is not None else None
    if hit is not None and isinstance(hit[1], ShardStats) and _owns(hit[0](), local):
        return hit[1]
    with torch._C.DisableTorchFunction():  # as in host_copy
        stats = summarizer.summarize(local, _DTYPES[local.dtype], scale)
    if key is not None:
        s.copies[same] = (weakref.ref(_owner(t, local)), stats, set())
    return stats

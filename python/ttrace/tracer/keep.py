"""What a recorded tensor becomes: a host copy (full traces) or its statistics (summaries),
shared with an earlier record of the same tensor in the step where that is safe."""

from __future__ import annotations

import weakref
from typing import Any, Optional, cast

import torch

from .._copies import Copier, HostCopy
from .._summaries import ShardStats, Summarizer
from .record import _DTYPES, _StepRecord, _alias_key, _bits, _owns


def _owner(t: Any, local: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``local`` is (a DTensor's local shard, else itself)."""
    return t._local_tensor if local is not t and hasattr(t, "_local_tensor") else local


def host_copy(s: _StepRecord, copier: Copier, t: Any, local: torch.Tensor,
              scale: Optional[float]) -> HostCopy:
    """The host copy of a recorded tensor (``local``, the local shard of ``t``, times
    ``scale``), shared with an earlier id whose contents are the same tensor's — on the CPU,
    after a bitwise comparison (on a CUDA device the comparison would wait for the device: the
    tensor is copied again, asynchronously, and the writer stores equal contents once). Raises
    ``RuntimeError`` for a tensor whose storage torch has released."""
    key = _alias_key(local)
    same = (key, local._version, scale is not None)
    hit = s.copies.get(same) if key is not None else None
    if (hit is not None and hit[0]() is not None and scale is None
            and local.device.type == "cpu" and isinstance(hit[1], HostCopy)):
        candidate = cast(HostCopy, hit[1])
        if torch.equal(_bits(candidate.tensor), _bits(local.detach())):
            return candidate
    copy = copier.copy(local, scale)
    s.made.append(copy)
    if key is not None:
        s.copies[same] = (weakref.ref(_owner(t, local)), copy)
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
    stats = summarizer.summarize(local, _DTYPES[local.dtype], scale)
    if key is not None:
        s.copies[same] = (weakref.ref(_owner(t, local)), stats)
    return stats

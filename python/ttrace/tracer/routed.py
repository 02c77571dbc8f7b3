"""Grouped experts called with their token counts, recorded expert by expert.

A grouped-experts module (see :mod:`ttrace.tracer.selection`: its experts' weights stacked in
3-D parameters) called as torchtitan's ``GroupedExperts`` is — ``forward(x,
tokens_per_expert)``, the signature of Megatron-LM's grouped MLPs too (whose 2-D weights are
not read as stacked experts): the rows of ``x`` are the tokens routed to this rank's experts,
grouped expert by expert, and the second argument an integer vector with one count per local
expert (summing to the rows) —
holds a ragged batch: under expert parallelism each rank holds other experts and a number of
rows that depends on the routing, which no layout of one tensor can express. Its tensors are
therefore recorded per expert: ``{module}.{e}`` for the global expert ``e``, its rows (input,
output and their gradients) and its slice of every stacked parameter's gradient. Rank r of
``k`` owners holds experts ``r·E/k … (r+1)·E/k − 1`` (torchtitan's ``Shard(0)`` on its ``ep``
mesh dimension, read from the parameters when they are DTensors); its rows of an expert are the
tokens every rank routed to it, in source-rank then token order — the reference's rows of that
expert when the ranks hold contiguous shares of the batch (the alignment of
``Tracer(experts=...)``, whose ``owned`` tensors these are under data parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..errors import UnsupportedLayoutError


@dataclass(frozen=True)
class Routing:
    """One call's split of its rows: the input holding them, and per local expert its global
    index, first row and row count."""

    #: Index (among the call's tensor inputs) of the rows.
    rows_input: int
    #: The rows in all.
    rows: int
    #: (global expert, first row, rows) per local expert, in order.
    experts: Tuple[Tuple[int, int, int], ...]
    #: Global experts in all.
    total: int

    def pieces(self, t: torch.Tensor) -> List[Tuple[int, torch.Tensor]]:
        """``t`` (a tensor of the call's rows along dimension 0) cut into its experts' rows."""
        return [(e, t.narrow(0, start, n)) for e, start, n in self.experts]


def routing(module: torch.nn.Module, inputs: Sequence[Any], dp: int, dp_coord: int,
            dtensor: Optional[type], name: str) -> Optional[Routing]:
    """How a grouped-experts call splits its rows by expert, or ``None`` when the call is not
    one with token counts (a floating-point 2-D input and, after it, an integer vector with one
    entry per local expert that sums to its rows). Raises
    :class:`~ttrace.errors.UnsupportedLayoutError` for an expert placement it cannot read."""
    stacked = [p for p in module.parameters(recurse=False) if p.dim() >= 3]
    if not stacked:
        return None
    found = None
    for i, x in enumerate(inputs):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() == 2):
            continue
        for c in inputs[i + 1:]:
            if (isinstance(c, torch.Tensor) and c.dim() == 1 and not c.is_floating_point()
                    and not c.is_complex() and c.dtype != torch.bool):
                found = (i, x, c)
                break
        if found is not None:
            break
    if found is None:
        return None
    i, x, c = found
    counts = [int(v) for v in c.detach().to("cpu").tolist()]
    local = len(counts)
    if sum(counts) != x.shape[0] or any(v < 0 for v in counts):
        return None
    owner, owners, total = _owner(stacked[0], local, dp, dp_coord, dtensor, module, name)
    if owners == 1 and dp > 1:
        raise UnsupportedLayoutError(
            f"module {name!r}: every expert on each of {dp} data ranks, each its own tokens' "
            "rows (a split of each expert's rows whose lengths follow the routing): grouped "
            "experts called with token counts are read under expert parallelism over the "
            "data ranks only", "Layout")
    if total != owners * local:
        raise UnsupportedLayoutError(
            f"module {name!r}: {local} token counts for {total} experts over {owners} owners "
            "(each owner's experts must be the count's entries)", "Layout")
    experts, start = [], 0
    for j, n in enumerate(counts):
        experts.append((owner * local + j, start, n))
        start += n
    return Routing(i, x.shape[0], tuple(experts), total)


def _owner(p: torch.Tensor, local: int, dp: int, dp_coord: int, dtensor: Optional[type],
           module: torch.nn.Module, name: str) -> Tuple[int, int, int]:
    """(this rank's owner coordinate, the owners, the global experts) of a stacked parameter
    ``p`` whose calls count ``local`` experts: from a DTensor's ``Shard(0)`` dimension, else
    from the module's ``num_experts`` over the data ranks."""
    if dtensor is not None and isinstance(p, dtensor):
        from torch.distributed.tensor import Shard

        dt: Any = p
        mesh, coord = dt.device_mesh, dt.device_mesh.get_coordinate()
        total = int(dt.shape[0])
        along = [(d, pl) for d, pl in enumerate(dt.placements)
                 if int(mesh.mesh.shape[d]) > 1 and getattr(pl, "dim", None) == 0
                 and pl.is_shard()]
        if not along:
            return 0, 1, total
        if len(along) > 1 or type(along[0][1]) is not Shard or coord is None:
            raise UnsupportedLayoutError(
                f"module {name!r}: its experts are sharded along several mesh dimensions "
                f"({dt.placements}); ttrace reads one Shard(0) expert dimension", "Layout")
        d = along[0][0]
        owner, owners = int(coord[d]), int(mesh.mesh.shape[d])
        if owners != dp or owner != dp_coord:
            raise UnsupportedLayoutError(
                f"module {name!r}: its experts are sharded over {owners} ranks (this one "
                f"coordinate {owner}) but the data ranks are {dp} (this one {dp_coord}): "
                "ttrace reads experts sharded over the data ranks, in their order (expert "
                "parallelism over another group is not supported yet)", "Layout")
        return owner, owners, total
    declared = getattr(module, "num_experts", None)
    if not isinstance(declared, int) or declared == local:
        return 0, 1, local
    total = declared
    if total != dp * local:
        raise UnsupportedLayoutError(
            f"module {name!r}: {local} of its {total} experts on this rank, but "
            f"{dp} data ranks: ttrace reads experts sharded over the data ranks "
            "(expert parallelism over another group is not supported yet)", "Layout")
    return dp_coord, dp, total

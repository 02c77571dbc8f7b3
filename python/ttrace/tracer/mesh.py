"""The traced run's mesh and this process's rank in it, found from what the program set up:
a ``DeviceMesh``, Megatron-LM's parallel state, or the ``torch.distributed`` world."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, cast

import torch

from ..errors import InvalidInputError, UnsupportedLayoutError
from .dtensor import _MeshMap, _root_mesh, _uses_fsdp
from .placements import Mesh


def find_mesh(model: torch.nn.Module, named: Dict[str, torch.nn.Module],
              dtensor: Optional[type], axes: Dict[str, str], megatron: bool, mesh: Any,
              rank: Optional[int], stages: Optional[Tuple[int, Optional[int]]] = None,
              ) -> Tuple[Mesh, int, Optional[str], Tuple[int, int]]:
    """The traced run's mesh and this process's rank in it: from ``mesh`` (a :class:`Mesh` or
    a ``DeviceMesh``), else the model's DTensor parameters' device mesh, else Megatron's
    parallel state (``megatron``: the model has Megatron layers), else data parallel over the
    ``torch.distributed`` world; ``rank`` overrides the rank found. ``axes`` (ttrace axis →
    mesh dimension name) gains ``"_default"`` for a 1-D mesh without names. The third value
    is why the device mesh cannot be placed, if it cannot: every tensor on it is then refused
    (or skipped) with that reason, and the tracer is built over the process group's ranks.
    The fourth is (pipeline stages, this rank's stage): from ``stages`` when given (a stage of
    None: the pipeline dimension outermost, rank // (world / stages)), else from a device
    mesh's pipeline dimension, else (1, 0). Under pipeline parallelism the mesh is
    one stage's and the rank this process's within it (the pipeline dimension outermost, as
    torchtitan's mesh has it, when no device mesh says)."""
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    grank = dist.get_rank() if world > 1 else 0
    given: Optional[Tuple[int, int]] = None
    if stages is not None:
        n, s = stages
        s = s if s is not None else grank // max(world // max(n, 1), 1)
        if n < 1 or not 0 <= s < n or world % n:
            raise InvalidInputError(
                f"stage {s} of {n} pipeline stages over {world} ranks: the stage must be "
                "below the stages, which must divide the ranks", "InvalidParameter")
        given = (n, s)
    device_mesh = None
    if mesh is not None and not isinstance(mesh, Mesh):
        device_mesh = mesh
    if mesh is None and dtensor is not None:
        for p in model.parameters():
            if isinstance(p, dtensor):
                device_mesh = cast(Any, p).device_mesh
                break
    if device_mesh is not None:
        if "_default" not in axes:
            # A 1-D mesh without names: data parallel under fully_shard, else tensor
            # parallel.
            axes["_default"] = "dp" if _uses_fsdp(model) else "tp"
        # A sub-mesh (TP on mesh["tp"] of a 2-D mesh whose other dimension is data
        # parallel): the whole mesh places this rank.
        root = _root_mesh(device_mesh)
        mm = _MeshMap(root, axes)
        pipe = given if given is not None else (mm.stages, mm.stage)
        if mm.error is not None:
            return (Mesh(dp=world // pipe[0]), (rank if rank is not None else grank), mm.error,
                    pipe)
        m = Mesh(tp=mm.sizes["tp"], cp=mm.sizes["cp"], dp=mm.sizes["dp"])
        if m.world() * pipe[0] != world and world > 1:
            # A mesh over part of the world (e.g. TP inside a DP replica group that is not
            # a DTensor dimension) cannot be placed in ttrace's mesh.
            raise UnsupportedLayoutError(
                f"the device mesh has {m.world()} ranks but the process group has {world}; "
                "give the Tracer a mesh that covers every rank",
                "Layout",
            )
        r = m.rank(dp=mm.coords["dp"], cp=mm.coords["cp"], tp=mm.coords["tp"])
        return m, (rank if rank is not None else r), None, pipe
    pipe = given if given is not None else (1, 0)
    found = megatron_mesh(named) if mesh is None and megatron else None
    if isinstance(mesh, Mesh):
        m = mesh
    elif found is not None:
        m, r = found
        return m, (rank if rank is not None else r), None, pipe
    else:
        m = Mesh(dp=world // pipe[0])
    r = rank if rank is not None else (grank % m.world() if pipe[0] > 1 else grank)
    if not 0 <= r < m.world():
        raise InvalidInputError(
            f"rank {r} is outside the mesh ({m.world()} ranks)", "InvalidParameter"
        )
    return m, r, None, pipe


def megatron_mesh(named: Dict[str, torch.nn.Module]) -> Optional[Tuple[Mesh, int]]:
    """The mesh of a model with Megatron-LM layers (``named``: its modules by name), from
    Megatron's parallel state — only when the program imported and initialized it: ttrace never
    imports Megatron."""
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return None
    sp = any(getattr(m, "sequence_parallel", False) for m in named.values())
    m = Mesh(
        tp=ps.get_tensor_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        sp=sp,
    )
    # Under context parallelism each rank holds load-balanced chunks of the sequence
    # (Megatron's get_batch_on_this_cp_rank): the cp placement of every activation is a
    # guess the checker settles from shapes and values (parameter gradients are reduced
    # over dp × cp by Megatron's DDP: replicated along cp).
    r = m.rank(dp=ps.get_data_parallel_rank(), cp=ps.get_context_parallel_rank(),
               tp=ps.get_tensor_model_parallel_rank())
    return m, r

"""DTensor and DeviceMesh: mesh dimensions mapped to ttrace's axes, placements as layouts,
parameters gathered where FSDP2 shards them again."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import UnsupportedLayoutError
from .placements import Layout, Mesh, partial, split

_AXIS_NAMES = {
    "tp": ("tp", "tensor", "model", "tensor_parallel", "mp", "tp_shard"),
    "dp": ("dp", "data", "fsdp", "shard", "replicate", "ddp", "dp_shard", "dp_replicate",
           "data_parallel", "hsdp", "dp_rep", "dp_replicate_shard", "batch", "efsdp"),
    "cp": ("cp", "context", "seq", "context_parallel", "sp_cp"),
}

#: Mesh dimensions that place no tensor on a ttrace axis: pipeline stages (each stage's ranks
#: write their own modules' tensors; see :class:`_MeshMap`), and expert parallelism, which a
#: trace does not hold yet — ignored at size 1 (as transformers and torchtitan build them),
#: refused (per tensor, with the fix) when larger.

_UNSUPPORTED_AXES = {
    "pp": ("pp", "pipeline", "pipeline_parallel"),
    "ep": ("ep", "expert", "expert_parallel", "moe", "etp", "ep_shard"),
}

#: Flattened dimensions (torchtitan's ``dp_shard_cp``, ``dp_cp``): data parallel when their
#: context-parallel factor is 1.

_FLATTENED_DP = ("dp_shard_cp", "dp_cp", "dp_shard_in_ep", "dp_shard_mod_ep", "fsdp_cp")
#: Flattened dimensions that hold the context-parallel ranks inside the data-parallel ones
#: (FSDP2 over torchtitan's ``dp_shard_cp``): coordinate d·cp + c, a split of one tensor
#: dimension by dp and then by cp.

_FLATTENED_DP_CP = ("dp_shard_cp", "dp_cp", "fsdp_cp")

def _local_version(t: torch.Tensor, dtensor: Any) -> int:
    """The version counter of a tensor's local data (in-place changes bump it)."""
    local = getattr(t, "_local_tensor", t) if dtensor is not None and isinstance(t, dtensor) else t
    return int(local._version)

def _expressible(dt: Any) -> bool:
    """Whether every placement of a DTensor has a ttrace layout (exact Shard, Replicate,
    Partial('sum'))."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    return all(
        type(p) is Shard or isinstance(p, Replicate)
        or (type(p) is Partial and getattr(p, "reduce_op", "sum") == "sum")
        for p in dt.placements
    )


def _dtensor_type() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch
        try:
            from torch.distributed._tensor import DTensor  # type: ignore
        except ImportError:
            return None
    return DTensor

def _uses_fsdp(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())

def _root_mesh(device_mesh: Any) -> Any:
    """The mesh a sub-mesh was sliced from (itself when it is not a slice), read from the mesh
    itself (the ``_mesh_resources.get_root_mesh`` registry call is deprecated)."""
    get = getattr(device_mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    root = getattr(device_mesh, "_root_mesh", None)
    return root if root is not None else device_mesh

def _cp_size(device_mesh: Any, axes: Dict[str, str]) -> int:
    """The context-parallel size of the whole mesh a (flattened) mesh was cut from: the product
    of its root's dimensions named after cp."""
    root = _root_mesh(device_mesh)
    n = 1
    for name, size in zip(root.mesh_dim_names or (), root.mesh.shape):
        if _axis_of(name, axes) == "cp":
            n *= int(size)
    return n

def _axis_of(name: Optional[str], axes: Dict[str, str]) -> Optional[str]:
    """The ttrace axis (``tp``, ``cp``, ``dp``) — or ``pp`` / ``ep`` — a mesh dimension of
    this name stands for: ``axes`` first, then the names of torchtitan, transformers,
    Megatron, FSDP2 and HSDP."""
    if name is None:
        return None
    for axis, dim in axes.items():
        if dim == name and axis in _AXIS_NAMES:
            return axis
    low = name.lower()
    for axis, names in list(_AXIS_NAMES.items()) + list(_UNSUPPORTED_AXES.items()):
        if low in names:
            return axis
    if low in _FLATTENED_DP:
        return "dp"
    if low == "world" and axes.get("_default") == "dp":
        # torchtitan's mesh over every rank, which FSDP2 shards over when the data ranks are
        # all the ranks: data parallel under fully_shard, as an unnamed 1-D mesh is.
        return "dp"
    return None

def _group_ranks(device_mesh: Any, dim: int) -> Optional[List[int]]:
    """The global ranks of this rank's group along mesh dimension ``dim``, in order (``None``
    when torch.distributed cannot say)."""
    try:
        import torch.distributed as dist

        return sorted(dist.get_process_group_ranks(device_mesh.get_group(dim)))
    except Exception:  # noqa: BLE001 - a mesh without process groups: no mapping
        return None

class _MeshMap:
    """How a DeviceMesh's dimensions map onto ttrace's tp / cp / dp axes.

    Dimensions of size 1 are ignored (transformers' root mesh is ``(pp, dp_replicate, fsdp,
    tp)`` with sizes 1 but ``tp``). Several dimensions of one axis (HSDP's ``dp_replicate`` ×
    ``dp_shard``) form one ttrace axis, in row-major order. A dimension that cannot be placed
    (an unknown name, pipeline or expert parallelism of size > 1) leaves the map unusable:
    ``error`` says why and how to fix it, and every tensor on the mesh is refused (or skipped)
    with that message — the Tracer itself is still built. A pipeline dimension places modules,
    not tensors: its size and this rank's coordinate are ``stages`` and ``stage``. An expert
    dimension whose ranks are exactly this rank's data-parallel group (``dp_group``: experts
    sharded over the data ranks, as transformers' ``ep_size`` over ``fsdp_size`` does) is the
    dp axis: the stacked experts' weights are split along it."""

    def __init__(self, device_mesh: Any, axes: Dict[str, str],
                 dp_group: Optional[List[int]] = None) -> None:
        names = tuple(device_mesh.mesh_dim_names or ())
        shape = tuple(int(x) for x in device_mesh.mesh.shape)
        self.names = names
        self.shape = shape
        #: Per mesh dimension: its ttrace axis, or None (size 1, or unusable).
        self.axis: List[Optional[str]] = []
        self.error: Optional[str] = None
        self.stages, self.stage = 1, 0
        coord0 = device_mesh.get_coordinate()
        for i, size in enumerate(shape):
            name = names[i] if i < len(names) else None
            axis = _axis_of(name, axes)
            if axis is None and len(shape) == 1 and not names:
                axis = axes.get("_default", "tp")
            if size == 1:
                self.axis.append(None)
                continue
            if axis is None:
                fix = "{'dp': " + repr(name) + "}"
                self.error = (
                    f"device mesh dimension {i} ({name!r}, size {size}) of mesh {names} is not "
                    f"named after a ttrace axis: pass axes={fix} (or 'tp' / 'cp') to the "
                    "Tracer to say which parallelism it is"
                )
            elif axis == "pp":
                self.stages = size
                self.stage = int(coord0[i]) if coord0 is not None else 0
            elif axis == "ep" and dp_group is not None and _group_ranks(device_mesh, i) == dp_group:
                axis = "dp"
            elif axis in _UNSUPPORTED_AXES:
                self.error = (
                    f"device mesh dimension {i} ({name!r}, size {size}) is "
                    "expert parallelism, which ttrace traces cannot hold yet: trace one "
                    "expert group with mesh=ttrace.Mesh(...) over its ranks"
                )
            self.axis.append(axis if axis in ("tp", "cp", "dp") and self.error is None else None)
        # A flattened data × context dimension: its cp factor is the root mesh's cp size.
        flat = [i for i, a in enumerate(self.axis)
                if a == "dp" and i < len(names) and names[i].lower() in _FLATTENED_DP_CP]
        cp_in = _cp_size(device_mesh, axes) if flat else 1
        for i in flat:
            if cp_in > 1 and shape[i] % cp_in == 0:
                self.axis[i] = "dp_cp"
        self.cp_in = cp_in
        self.sizes = {a: 1 for a in ("tp", "cp", "dp")}
        self.coords = {a: 0 for a in ("tp", "cp", "dp")}
        coord = device_mesh.get_coordinate()
        for i, (a, size) in enumerate(zip(self.axis, shape)):
            if a is None:
                continue
            at = int(coord[i]) if coord is not None else 0
            parts = ([("dp", size // cp_in, at // cp_in), ("cp", cp_in, at % cp_in)]
                     if a == "dp_cp" else [(a, size, at)])
            for axis, n, x in parts:
                # Row-major over the dimensions of one axis.
                self.coords[axis] = self.coords[axis] * n + x
                self.sizes[axis] *= n

    def placed(self) -> List[Tuple[int, str, int]]:
        """(mesh dimension, ttrace axis, ranks along it) for every dimension that places
        something; a flattened data × context dimension gives one entry per axis, dp first."""
        out: List[Tuple[int, str, int]] = []
        for i, (a, size) in enumerate(zip(self.axis, self.shape)):
            if a == "dp_cp":
                out += [(i, "dp", size // self.cp_in), (i, "cp", self.cp_in)]
            elif a is not None:
                out.append((i, a, size))
        return out

    def check(self, what: str) -> None:
        """Raise the reason this mesh cannot be placed, naming ``what`` it was needed for."""
        if self.error is not None:
            raise UnsupportedLayoutError(f"{what}: {self.error}", "Layout")

def _gather_param(dt: Any, mm: Optional["_MeshMap"]) -> Any:
    """A parameter gradient gathered, in one collective every rank makes in the same order
    when the step's gradients are read (exact), along the mesh dimensions whose placement
    ttrace cannot express: FSDP2 over a tensor-parallel parameter shards the TP shard again
    along the same dimension (``_StridedShard``); HSDP places it two ways on one ttrace axis
    (replicated over ``dp_replicate``, sharded over ``dp_shard`` or ``dp_shard_cp``) — those
    axes' sharding dimensions are gathered (``mm``: the mesh map, None when unusable); and so
    is a dimension FSDP2 shards unevenly (its length not a multiple of the ranks sharding it: a
    vocabulary of 50257 rows, a gate of one row over two ranks), which ttrace's equal split
    cannot hold."""
    from torch.distributed.tensor import Replicate, Shard

    placements = list(dt.placements)
    if not _expressible(dt):
        placements = [p if type(p) is Shard or isinstance(p, Replicate) else Replicate()
                      for p in placements]
    shape, sizes = tuple(dt.shape), tuple(int(x) for x in dt.device_mesh.mesh.shape)
    parts: Dict[int, int] = {}
    for i, p in enumerate(placements):
        if type(p) is Shard and shape:
            d = p.dim % len(shape)
            parts[d] = parts.get(d, 1) * sizes[i]
    uneven = {d for d, n in parts.items() if shape[d] % n}
    if uneven:
        placements = [Replicate() if type(p) is Shard and p.dim % len(shape) in uneven else p
                      for p in placements]
    if mm is not None:
        kinds: Dict[str, set] = {}
        for i, axis, _ in mm.placed():
            p = placements[i]
            kinds.setdefault(axis, set()).add((type(p).__name__, getattr(p, "dim", None)))
        mixed = {a for a, k in kinds.items() if len(k) > 1}
        dims = {i for i, axis, _ in mm.placed() if axis in mixed}
        placements = [Replicate() if i in dims and type(p) is Shard else p
                      for i, p in enumerate(placements)]
    if all(p is q for p, q in zip(placements, dt.placements)):
        return dt
    return dt.redistribute(dt.device_mesh, placements)

def _is_dtensor(t: Any, dtensor: Optional[type]) -> bool:
    return dtensor is not None and isinstance(t, dtensor)

def _placement_layout(tid: str, placements: Sequence[Any], device_mesh: Any,
                      shape: Sequence[int], mm: _MeshMap) -> Layout:
    """The ttrace layout of a tensor of (global) ``shape`` placed by ``placements``."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    mm.check(f"tensor {tid!r}")
    layout = Layout()
    ndim = len(shape)
    per_axis: Dict[str, List[Tuple[Any, int]]] = {}
    for i, axis, size in mm.placed():  # a dimension of size 1 places nothing
        per_axis.setdefault(axis, []).append((placements[i], size))
    for axis, dims in per_axis.items():
        kinds: List[Tuple[str, Optional[int]]] = []
        for p, size in dims:
            if type(p) is Shard:
                d = p.dim % max(ndim, 1)
                kinds.append(("split", d))
            elif isinstance(p, Replicate):
                kinds.append(("replicate", None))
            elif type(p) is Partial and getattr(p, "reduce_op", "sum") == "sum":
                # Exactly Partial: its subclasses (the masked partial of a vocabulary-parallel
                # embedding) hold local values that are not addends of the logical tensor.
                kinds.append(("partial", None))
            else:
                raise UnsupportedLayoutError(
                    f"tensor {tid!r}: placement {p!r} on the {axis} axis cannot be expressed "
                    "in a ttrace trace (supported: Shard(d) with equal parts, Replicate(), "
                    "Partial('sum')); trace with unsupported='skip' to leave it out",
                    "Layout",
                )
        if len(set(kinds)) > 1:
            raise UnsupportedLayoutError(
                f"tensor {tid!r}: the mesh dimensions of the {axis} axis place it differently "
                f"({', '.join(str(p) for p, _ in dims)}); ttrace's {axis} axis holds one "
                "placement — trace with unsupported='skip' to leave it out",
                "Layout",
            )
        kind, sd = kinds[0]
        total = 1
        for _, size in dims:
            total *= size
        if kind == "split" and sd is not None:
            if ndim == 0 or shape[sd] % total:
                raise UnsupportedLayoutError(
                    f"tensor {tid!r}: placement {dims[0][0]} on the {axis} axis splits a "
                    f"dimension of length {shape[sd] if ndim else 0} into {total} uneven "
                    "parts; ttrace's split needs equal parts",
                    "Layout",
                )
            layout = layout.with_(axis, split(sd))
        elif kind == "partial":
            layout = layout.with_(axis, partial())
    return layout

"""Placements of a tensor's shards along ttrace's mesh axes — replicated, split along a
dimension (in groups), partial sums — the mesh of a traced run, and per-module declarations of
the tensor-parallel placements of plain tensors."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple, Union

#: The mesh axes, in manifest order.
AXES = ("dp", "cp", "tp")


@dataclass(frozen=True)
class Placement:
    """How a tensor lies along one mesh axis: ``replicate`` (every rank holds the whole
    tensor), ``split`` along ``dim`` in ``groups`` interleaved groups, or ``partial`` (the
    logical tensor is the sum of the ranks' tensors). Build with :func:`replicate`,
    :func:`split`, :func:`partial`."""

    kind: str
    dim: int = 0
    groups: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("replicate", "split", "partial"):
            raise ValueError(f"unknown placement kind {self.kind!r} (replicate, split, partial)")

    @property
    def is_split(self) -> bool:
        return self.kind == "split"

    @property
    def is_partial(self) -> bool:
        return self.kind == "partial"

    def to_json(self) -> Dict[str, Any]:
        """As a trace manifest writes it."""
        if self.kind == "split":
            return {"kind": "split", "dim": self.dim, "groups": self.groups}
        return {"kind": self.kind}

    @staticmethod
    def of(p: "PlacementLike") -> "Placement":
        """A placement, or its manifest form (``{"kind": "split", "dim": 1}``)."""
        if isinstance(p, Placement):
            return p
        if isinstance(p, dict) and "kind" in p:
            return Placement(str(p["kind"]), int(p.get("dim", 0)), int(p.get("groups", 1)))
        raise TypeError(f"not a placement: {p!r} (use replicate(), split(dim) or partial())")


#: A placement, or its manifest form as a dict (accepted where users declare layouts).
PlacementLike = Union[Placement, Dict[str, Any]]


def replicate() -> Placement:
    """Every rank of the axis holds the whole tensor."""
    return Placement("replicate")


def split(dim: int, groups: int = 1) -> Placement:
    """Split along ``dim`` (negative counts from the end); ``groups`` interleaved groups."""
    return Placement("split", dim, groups)


def partial() -> Placement:
    """The logical tensor is the sum of the ranks' tensors (before an all-reduce)."""
    return Placement("partial")


@dataclass(frozen=True)
class Layout:
    """A tensor's placement along each mesh axis, and the axes along which it is only a guess
    (plain tensors of code the tracer cannot see into), for the checker to settle from the
    shapes."""

    dp: Placement = field(default_factory=replicate)
    cp: Placement = field(default_factory=replicate)
    tp: Placement = field(default_factory=replicate)
    guessed: Tuple[str, ...] = ()

    def along(self, axis: str) -> Placement:
        return getattr(self, axis)  # type: ignore[no-any-return]

    def with_(self, axis: str, p: Placement) -> "Layout":
        """This layout with the placement along ``axis`` replaced."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r} ({', '.join(AXES)})")
        return replace(self, **{axis: p})  # type: ignore[arg-type]

    def with_guess(self, *axes: str) -> "Layout":
        """This layout with its placements along ``axes`` marked guesses."""
        return replace(self, guessed=tuple(sorted(set(self.guessed) | set(axes))))

    def known(self) -> "Layout":
        """The same placements, nothing marked a guess."""
        return replace(self, guessed=())

    def partial_axes(self) -> List[str]:
        """The axes along which the tensor is a partial sum."""
        return [a for a in AXES if self.along(a).is_partial]

    def grad(self) -> "Layout":
        """The layout of a gradient of a tensor of this layout: the gradient of a partial sum
        is replicated (DTensor's rule for ``to_local``/``from_local`` gradients); shards
        stay."""
        dp, cp, tp = (replicate() if self.along(a).is_partial else self.along(a) for a in AXES)
        return Layout(dp, cp, tp, self.guessed)

    def to_json(self) -> Dict[str, Any]:
        """As a trace manifest writes it (the guesses go in the entry's ``guessed``)."""
        return {a: self.along(a).to_json() for a in AXES}


@dataclass
class Mesh:
    """ttrace's parallel mesh: global rank r = (d·cp + c)·tp + t."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    sp: bool = False

    def world(self) -> int:
        return self.tp * self.cp * self.dp

    def rank(self, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank of the given coordinates."""
        return (dp * self.cp + cp) * self.tp + tp

    def to_json(self) -> dict:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "sp": self.sp}

@dataclass
class ModuleLayout:
    """Tensor-parallel placements of one module's plain (non-DTensor) tensors.

    ``inputs``/``outputs`` are per-position placements (the last entry repeats); gradients take
    the placement of what they are the gradient of unless ``grad_inputs``/``grad_outputs`` say
    otherwise; ``params`` maps a parameter's local name to its placement."""

    inputs: List[Placement] = field(default_factory=lambda: [replicate()])
    outputs: List[Placement] = field(default_factory=lambda: [replicate()])
    grad_inputs: Optional[List[Placement]] = None
    grad_outputs: Optional[List[Placement]] = None
    params: Dict[str, Placement] = field(default_factory=dict)
    #: Two dimensions the module's outputs (and their gradients) have swapped relative to
    #: the reference's (Megatron's embedding hands out [s, b, h] under sequence parallelism,
    #: [b, s, h] otherwise): recorded swapped back.
    swap_outputs: Optional[Tuple[int, int]] = None

    def __post_init__(self) -> None:
        # Placements given in their manifest form (dicts) are accepted and made typed.
        self.inputs = [Placement.of(p) for p in self.inputs]
        self.outputs = [Placement.of(p) for p in self.outputs]
        if self.grad_inputs is not None:
            self.grad_inputs = [Placement.of(p) for p in self.grad_inputs]
        if self.grad_outputs is not None:
            self.grad_outputs = [Placement.of(p) for p in self.grad_outputs]
        self.params = {k: Placement.of(p) for k, p in self.params.items()}

    def pick(self, role: str, i: int) -> Placement:
        lists = {
            "fwd.input": self.inputs,
            "fwd.output": self.outputs,
            "grad.input": self.grad_inputs if self.grad_inputs is not None else self.inputs,
            "grad.output": self.grad_outputs if self.grad_outputs is not None else self.outputs,
        }[role]
        return lists[min(i, len(lists) - 1)] if lists else replicate()

def column_parallel(gather_output: bool = False) -> ModuleLayout:
    """Megatron's ColumnParallelLinear as seen by hooks on the local linear: input replicated,
    output split along its last dimension, weight split along dim 0 (and bias), and the input
    gradient a partial sum (its all-reduce happens outside the local linear)."""
    return ModuleLayout(
        inputs=[replicate()],
        outputs=[replicate() if gather_output else split(-1)],
        grad_inputs=[partial()],
        params={"weight": split(0), "bias": split(0)},
    )

def row_parallel() -> ModuleLayout:
    """Megatron's RowParallelLinear as seen by hooks on the local linear (without bias: the
    bias is added after the all-reduce): input split along its last dimension, output a
    partial sum, weight split along dim 1, the output gradient replicated."""
    return ModuleLayout(
        inputs=[split(-1)],
        outputs=[partial()],
        grad_outputs=[replicate()],
        params={"weight": split(1), "bias": replicate()},
    )

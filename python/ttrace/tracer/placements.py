"""Placements of a tensor's shards along ttrace's mesh axes — replicated, split along a
dimension (in groups), partial sums — the mesh of a traced run, and per-module declarations of
the tensor-parallel placements of plain tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

def replicate() -> dict:
    """Every rank of the axis holds the whole tensor."""
    return {"kind": "replicate"}

def split(dim: int, groups: int = 1) -> dict:
    """Split along ``dim`` (negative counts from the end); ``groups`` interleaved groups."""
    return {"kind": "split", "dim": dim, "groups": groups}

def partial() -> dict:
    """The logical tensor is the sum of the ranks' tensors (before an all-reduce)."""
    return {"kind": "partial"}

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

    inputs: List[dict] = field(default_factory=lambda: [replicate()])
    outputs: List[dict] = field(default_factory=lambda: [replicate()])
    grad_inputs: Optional[List[dict]] = None
    grad_outputs: Optional[List[dict]] = None
    params: Dict[str, dict] = field(default_factory=dict)
    #: Two dimensions the module's outputs (and their gradients) have swapped relative to
    #: the reference's (Megatron's embedding hands out [s, b, h] under sequence parallelism,
    #: [b, s, h] otherwise): recorded swapped back.
    swap_outputs: Optional[Tuple[int, int]] = None

    def pick(self, role: str, i: int) -> dict:
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

def _partial_axes(layout: dict) -> List[str]:
    """The axes along which ``layout`` holds partial sums."""
    return [a for a in ("dp", "cp", "tp") if layout.get(a, {}).get("kind") == "partial"]

def _with_guess(layout: dict, axis: str) -> dict:
    """``layout`` with its placement along ``axis`` marked a guess (``"_guessed"``, for the
    checker to settle)."""
    return {**layout, "_guessed": sorted(set(layout.get("_guessed", [])) | {axis})}

def _grad_layout(layout: dict) -> dict:
    """The layout of a gradient of a tensor of ``layout``: the gradient of a partial sum is
    replicated (DTensor's rule for ``to_local``/``from_local`` gradients); shards stay."""
    return {a: (replicate() if isinstance(p, dict) and p["kind"] == "partial" else p)
            for a, p in layout.items()}

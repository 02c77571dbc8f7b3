"""Record PyTorch training steps as ttrace trace directories.

Attach a :class:`Tracer` to the model on every rank, run the step inside ``tracer.step()``,
then ``tracer.close()``; compare with :func:`ttrace.check` (or ``python -m ttrace check``)::

    tracer = ttrace.Tracer(model, "traces/candidate")
    with tracer.step():
        model(batch).sum().backward()
    tracer.close()                      # waits for the background writer
    ttrace.check("traces/reference/step0", "traces/candidate/step0")

Step ``n`` (counting every ``step()``) is written to ``DIRECTORY/step{n}``: on each rank
``rank{r}.safetensors`` and ``manifest.rank{r}.json`` (``ttrace check`` merges the fragments).

What is recorded, under canonical ids (``papers/trace-format.md``):

* ``{module}|fwd.input.{i}``, ``{module}|fwd.output.{i}``: floating-point arguments and outputs
  of each traced module (forward hooks); a module called again in the same step records its
  k-th further call as ``{module}#k`` (a recomputation by activation checkpointing, inside the
  backward pass, is not a further call: it records onto the ids of the calls it repeats);
* ``{module}|grad.output.{i}``, ``{module}|grad.input.{i}``: gradients arriving at and leaving
  each module. They are tapped, not caught with PyTorch's full backward hooks (which hand the
  module views of its inputs and forbid the in-place ops real modules do — Megatron's masked
  softmax, ``ReLU(inplace=True)``): each input that requires a gradient reaches the module as
  a copy made by an autograd function that records the gradient flowing back through it, and
  each output carries a tensor hook. The copies cost one extra input per traced module during
  traced steps;
* ``{module}.{param}|param_grad``: parameter gradients, read when the step ends.

Layouts — how the ranks' shards form the logical tensor — are found without declarations:

* **DTensor** (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` /
  ``SequenceParallel``, ``fully_shard``): a DTensor is recorded as its local shard with the
  layout of its ``placements`` on its ``device_mesh``: ``Shard(d)`` → split along d,
  ``Replicate()`` → replicated, ``Partial()`` → partial sum. Mesh dimensions are mapped to
  ttrace's axes by name (``tp``/``tensor``/``model`` → tp; ``dp``/``data``/``fsdp``/``shard``/
  ``replicate``/``ddp`` → dp; ``cp``/``context``/``seq`` → cp) or by ``axes={"tp": "my_dim"}``.
  A parameter gradient FSDP2 shards again over a TP shard (``_StridedShard``), or HSDP places
  two ways on one axis, is gathered when read. Another placement the format cannot express
  (an uneven ``Shard``, ``Partial("avg")``, a strided shard, two mesh dimensions placing one
  axis differently) raises :class:`ttrace.UnsupportedLayoutError` naming
  the tensor and the placement — or, with ``unsupported="skip"``, the tensor is left out and
  listed in ``tracer.skipped`` (as is a tensor whose storage torch released before the hook
  could read it, otherwise a :class:`ttrace.TtraceError`).
* **Megatron-LM** ``ColumnParallelLinear``, ``RowParallelLinear`` and
  ``VocabParallelEmbedding`` (recognized by class, without importing Megatron).
* **Plain tensors** under data parallelism (DDP, or FSDP's unsharded activations): split along
  ``dp_dim`` (the batch) across the dp ranks; parameters and their gradients replicated. A
  ``DistributedDataParallel`` wrapper is looked through: module names are the wrapped model's.
* Anything else can be declared per module with ``layouts={name: ModuleLayout(...)}`` (the
  tensor-parallel placements of an emulation in one process, for instance) — or left to the
  checker: a layout the tracer could not know (plain tensors of a hand-written engine or of
  functional code, the batch dimension under data parallelism) is written as a guess, with the
  guessed axes, and the checker settles it from the shards' and the reference's shapes
  (``papers/trace-format.md``).

Without ``torch.distributed`` (or with one process) the trace is a reference: one rank.

Cheap and selective: ``modules=`` chooses what to trace (names, ``fnmatch`` patterns or a
predicate; default: the leaf modules and the attention cores, parameter-free modules named
attention), ``every=N`` traces one step in N (hooks are attached
only during traced steps), and a background thread writes the files so the step does not wait
on the disk; ``tracer.bytes_written`` counts what it wrote.
"""

from __future__ import annotations

import atexit
import fnmatch
import functools
import json
import os
import queue
import random
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union, cast

import numpy as np
import torch

from . import _ttrace
from . import arith as _arith
from ._copies import DEFAULT_POOL_BYTES, Copier, HostCopy
from .errors import InvalidInputError, TtraceError, UnsupportedLayoutError

__all__ = [
    "Mesh",
    "ModuleLayout",
    "Tracer",
    "column_parallel",
    "copy_sharded",
    "finish",
    "partial",
    "replicate",
    "row_parallel",
    "seed_everything",
    "split",
]

_DTYPES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
}
for _name, _code in (("float8_e4m3fn", "e4m3"), ("float8_e5m2", "e5m2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code

_AXIS_NAMES = {
    "tp": ("tp", "tensor", "model", "tensor_parallel", "mp", "tp_shard"),
    "dp": ("dp", "data", "fsdp", "shard", "replicate", "ddp", "dp_shard", "dp_replicate",
           "data_parallel", "hsdp", "dp_rep", "dp_replicate_shard", "batch"),
    "cp": ("cp", "context", "seq", "context_parallel", "sp_cp"),
}

#: Mesh dimensions of parallelisms a ttrace trace does not hold yet: ignored at size 1 (as
#: transformers and torchtitan build them), refused (per tensor, with the fix) when larger.
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


# --- placements ------------------------------------------------------------------------------

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


def _megatron_layout(module: torch.nn.Module, path: str = "") -> Optional[ModuleLayout]:
    """Layouts of Megatron-LM's tensor-parallel layers, recognized by class (Megatron itself is
    never imported). Their forward returns ``(output, bias)``; with ``skip_bias_add`` the bias
    is returned, not added."""
    cls = type(module)
    if not cls.__module__.startswith("megatron"):
        return None
    name = cls.__name__
    if name == "ColumnParallelLinear":
        # Input replicated (with sequence parallelism: split along the sequence, dim 0 of
        # Megatron's [s, b, h], and all-gathered inside); its gradient is all-reduced (or
        # reduce-scattered) inside, so it leaves replicated (split) — unless the layer was built
        # with disable_grad_reduce, which leaves each rank's partial sum to the caller.
        sp = bool(getattr(module, "sequence_parallel", False))
        gather = bool(getattr(module, "gather_output", False))
        layout = column_parallel(gather_output=gather)
        layout.inputs = [split(0) if sp else replicate()]
        if getattr(module, "disable_grad_reduce", False):
            layout.grad_inputs = [partial()]
        else:
            layout.grad_inputs = [split(0) if sp else replicate()]
        layout.outputs = layout.outputs + [split(0)]  # (output, bias shard when skipped)
        config = getattr(module, "config", None)
        ffn = getattr(config, "ffn_hidden_size", None)
        # The MLP's first projection (``linear_fc1``, also inside experts) by its place in the
        # model, not by its width: an output layer whose vocabulary happens to be twice the
        # FFN width is no fused projection.
        fc1 = path.rsplit(".", 1)[-1] == "linear_fc1" if path else True
        if (fc1 and getattr(config, "gated_linear_unit", False) and ffn
                and getattr(module, "output_size", None) == 2 * ffn and not gather):
            # The fused gate/up projection of a gated MLP (SwiGLU): each rank holds its slice
            # of the gate and its slice of the up projection, [gate_r; up_r] — two interleaved
            # groups of the reference's [gate; up].
            layout.outputs = [split(-1, groups=2), split(0, groups=2)]
            layout.params = {"weight": split(0, groups=2), "bias": split(0, groups=2)}
        return layout
    if name == "RowParallelLinear":
        sp = bool(getattr(module, "sequence_parallel", False))
        layout = row_parallel()
        # The output is all-reduced (or reduce-scattered along the sequence with SP) inside.
        # The bias it returns (``skip_bias_add``) is added by the caller to this rank's
        # sequence shard under SP, so its gradient is a partial sum over the shard's tokens
        # (summed over TP with the parameter's, in ``finalize_model_grads``).
        layout.outputs = [split(0) if sp else replicate(), replicate()]
        layout.grad_outputs = [split(0) if sp else replicate(), partial() if sp else replicate()]
        return layout
    if name == "VocabParallelEmbedding":
        # With sequence parallelism the output is reduce-scattered along the sequence (and
        # turned to [s, b, h]) inside; otherwise all-reduced.
        rs = bool(getattr(module, "reduce_scatter_embeddings", False))
        return ModuleLayout(
            inputs=[replicate()], outputs=[split(1) if rs else replicate()],
            params={"weight": split(0)}, swap_outputs=(0, 1) if rs else None,
        )
    return None


# --- module kinds ------------------------------------------------------------------------------

_ACTIVATION_NAMES = ("gelu", "silu", "swish", "relu", "mish", "tanh", "sigmoid", "softplus",
                     "elu", "quickgelu", "hardswish")


def _kind_of(module: torch.nn.Module) -> Optional[str]:
    nn = torch.nn
    norms: Tuple[type, ...] = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d)
    if hasattr(nn, "RMSNorm"):
        norms = norms + (nn.RMSNorm,)
    table = [
        ((nn.Linear, nn.Bilinear), "linear"),
        (norms, "norm"),
        ((nn.Embedding, nn.EmbeddingBag), "embedding"),
        ((nn.MultiheadAttention,), "attention"),
        ((nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Softmax, nn.Dropout), "activation"),
        ((nn.CrossEntropyLoss, nn.MSELoss, nn.NLLLoss), "loss"),
    ]
    for types, kind in table:
        if isinstance(module, types):
            return kind
    name = type(module).__name__
    if type(module).__module__.startswith("megatron"):
        if name in ("ColumnParallelLinear", "RowParallelLinear"):
            return "linear"
        if name == "VocabParallelEmbedding":
            return "embedding"
    if "RMSNorm" in name or "LayerNorm" in name or name.endswith(("Norm", "Norm2d")):
        return "norm"
    if _is_attention_core(module):
        return "attention"
    # By behaviour, across libraries (transformers' SiLUActivation, GELUActivation,
    # NewGELUActivation; timm's GELUTanh, Swish, Mish; torchtitan's and Megatron's wrappers):
    # a module without parameters named after an activation is elementwise.
    low = name.lower()
    if not any(True for _ in module.parameters(recurse=False)):
        if low.endswith("activation") or any(a in low for a in _ACTIVATION_NAMES):
            return "activation"
    # Rotary position embeddings (LlamaRotaryEmbedding, RotaryEmbedding, RoPE): a table of
    # cos / sin computed from positions alone, like an embedding lookup.
    if "rotary" in low or "rope" in low:
        return "embedding"
    # Hand-written engines' layers, by the name of their class and what they hold: a
    # ``ColumnParallelLinear``-like module with a 2-D weight, an embedding table.
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        if "Linear" in name:
            return "linear"
        if "Embedding" in name:
            return "embedding"
    return None


def _param_grad(module: torch.nn.Module, name: str,
                p: torch.Tensor) -> Tuple[Optional[torch.Tensor], dict]:
    """A parameter's gradient as the optimizer will see it, and what its pricing needs.

    Megatron-style mixed precision keeps an FP32 ``main_grad`` beside a low-precision
    parameter and reduces it over the data-parallel ranks in FP32: that is the gradient to
    check, at FP32 precision. Each rank's share of it was rounded to the parameter's dtype
    first (the backward's own output, added into ``main_grad``) — unless the module fuses the
    accumulation into its weight-gradient product (``gradient_accumulation_fusion``, which
    concerns its ``weight`` only): the ranks' partials then combine at the parameter's
    precision, else at FP32."""
    main = getattr(p, "main_grad", None)
    if not isinstance(main, torch.Tensor):
        return p.grad, {}
    info: dict = {}
    code, low = _DTYPES.get(main.dtype), _DTYPES.get(p.dtype)
    if (code is not None and low is not None and main.dtype.itemsize > p.dtype.itemsize
            and not (name == "weight"
                     and getattr(module, "gradient_accumulation_fusion", False))):
        info["combine"] = low
    return main, info


def _local_version(t: torch.Tensor, dtensor: Any) -> int:
    """The version counter of a tensor's local data (in-place changes bump it)."""
    local = getattr(t, "_local_tensor", t) if dtensor is not None and isinstance(t, dtensor) else t
    return int(local._version)


def _is_attention_core(module: torch.nn.Module) -> bool:
    """A module that computes attention from given queries, keys and values: its class
    name says attention and it holds no parameters (Megatron's and Transformer Engine's
    ``DotProductAttention``, a ``CoreAttention``) — unlike an attention block with its
    projections. Traced by default although it is not a leaf: a difference born in the scaled
    product is then judged where it is born, against the attention's own rounding."""
    return "Attention" in type(module).__name__ and next(module.parameters(), None) is None


# --- DTensor -------------------------------------------------------------------------------------

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
    return None


class _MeshMap:
    """How a DeviceMesh's dimensions map onto ttrace's tp / cp / dp axes.

    Dimensions of size 1 are ignored (transformers' root mesh is ``(pp, dp_replicate, fsdp,
    tp)`` with sizes 1 but ``tp``). Several dimensions of one axis (HSDP's ``dp_replicate`` ×
    ``dp_shard``) form one ttrace axis, in row-major order. A dimension that cannot be placed
    (an unknown name, pipeline or expert parallelism of size > 1) leaves the map unusable:
    ``error`` says why and how to fix it, and every tensor on the mesh is refused (or skipped)
    with that message — the Tracer itself is still built."""

    def __init__(self, device_mesh: Any, axes: Dict[str, str]) -> None:
        names = tuple(device_mesh.mesh_dim_names or ())
        shape = tuple(int(x) for x in device_mesh.mesh.shape)
        self.names = names
        self.shape = shape
        #: Per mesh dimension: its ttrace axis, or None (size 1, or unusable).
        self.axis: List[Optional[str]] = []
        self.error: Optional[str] = None
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
            elif axis in _UNSUPPORTED_AXES:
                self.error = (
                    f"device mesh dimension {i} ({name!r}, size {size}) is "
                    f"{'pipeline' if axis == 'pp' else 'expert'} parallelism, which ttrace "
                    "traces cannot hold yet: trace one stage / one expert group with "
                    "mesh=ttrace.Mesh(...) over its ranks"
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


def _alias_key(t: torch.Tensor) -> Optional[Tuple[Any, ...]]:
    """The memory a tensor views (address, shape, strides, dtype); None for a tensor whose
    storage torch has already released."""
    try:
        return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
    except RuntimeError:
        return None


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers (bitwise comparison: -0.0 differs from 0.0, a NaN
    equals itself)."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def _expressible(dt: Any) -> bool:
    """Whether every placement of a DTensor has a ttrace layout (exact Shard, Replicate,
    Partial('sum'))."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    return all(
        type(p) is Shard or isinstance(p, Replicate)
        or (type(p) is Partial and getattr(p, "reduce_op", "sum") == "sum")
        for p in dt.placements
    )


def _device_type(module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
    """The device type a module call runs on: its first tensor argument's, else its first
    parameter's, else ``cpu``."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device.type
    for p in module.parameters(recurse=False):
        return p.device.type
    return "cpu"


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (a module's forward then is
    a recomputation: activation checkpointing)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _base(name: str) -> str:
    """The module name of a recorded name (``act#1``: the second call of ``act``)."""
    return name.split("#", 1)[0]


def _gather_param(dt: Any, mm: Optional["_MeshMap"]) -> Any:
    """A parameter gradient gathered, in one collective every rank makes in the same order
    when the step's gradients are read (exact), along the mesh dimensions whose placement
    ttrace cannot express: FSDP2 over a tensor-parallel parameter shards the TP shard again
    along the same dimension (``_StridedShard``); HSDP places it two ways on one ttrace axis
    (replicated over ``dp_replicate``, sharded over ``dp_shard`` or ``dp_shard_cp``) — those
    axes' sharding dimensions are gathered (``mm``: the mesh map, None when unusable)."""
    from torch.distributed.tensor import Replicate, Shard

    placements = list(dt.placements)
    if not _expressible(dt):
        placements = [p if type(p) is Shard or isinstance(p, Replicate) else Replicate()
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


def _owns(owner: Optional[torch.Tensor], t: torch.Tensor) -> bool:
    """Whether ``owner`` is alive and still holds the memory ``t`` points into."""
    if owner is None:
        return False
    try:
        storage = owner.untyped_storage()
        start = storage.data_ptr()
        return storage.nbytes() > 0 and start <= t.data_ptr() < start + storage.nbytes()
    except RuntimeError:  # "Attempted to access the data pointer on an invalid python storage"
        return False


def _is_dtensor(t: Any, dtensor: Optional[type]) -> bool:
    return dtensor is not None and isinstance(t, dtensor)


def _placement_layout(tid: str, placements: Sequence[Any], device_mesh: Any,
                      shape: Sequence[int], mm: _MeshMap) -> Dict[str, dict]:
    """The ttrace layout of a tensor of (global) ``shape`` placed by ``placements``."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    mm.check(f"tensor {tid!r}")
    layout = {"dp": replicate(), "cp": replicate(), "tp": replicate()}
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
            layout[axis] = split(sd)
        elif kind == "partial":
            layout[axis] = partial()
    return layout


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


@dataclass
class _StepRecord:
    """What one traced step has recorded, and what it has learned about layouts."""

    #: Host copies of the recorded tensors, by id.
    records: Dict[str, HostCopy] = field(default_factory=dict)
    #: Every host copy made in the step (stored or replaced), released after writing.
    made: List[HostCopy] = field(default_factory=list)
    #: Layout and module information, by id.
    meta: Dict[str, dict] = field(default_factory=dict)
    #: Ids in execution order, and ("params", module) where parameter gradients belong.
    order: List[Any] = field(default_factory=list)
    #: Layouts learned by memory (a weak reference to the first holder, the layout).
    alias: Dict[Any, Tuple[Any, dict]] = field(default_factory=dict)
    #: (module, role, index) → (local shape, layout), for the gradients of forward tensors.
    forward: Dict[Tuple[str, str, int], Tuple[Tuple[int, ...], dict]] = field(default_factory=dict)
    #: (module, output index) → (local shape, layout) of the output the caller receives.
    final: Dict[Tuple[str, int], Tuple[Tuple[int, ...], dict]] = field(default_factory=dict)
    #: Stored copies shared between ids (a weak reference to the first holder, the copy).
    copies: Dict[Any, Tuple[Any, HostCopy]] = field(default_factory=dict)
    #: Outputs whose placement cannot be expressed before the module's output hooks run.
    deferred: "set[Tuple[str, int]]" = field(default_factory=set)
    #: (module, output index) → the output as the module returned it, until its output hooks
    #: have run (to see whether one of them changed it).
    returned: Dict[Tuple[str, int], Tuple[torch.Tensor, int]] = field(default_factory=dict)
    #: Per module: the layout its outputs inherit from a plain input (found as the inputs are
    #: recorded, before the module runs), and whether any input was tapped for its gradient.
    inherit: Dict[str, Optional[dict]] = field(default_factory=dict)
    tapped: Dict[str, bool] = field(default_factory=dict)
    #: Per module: how often it was called in this step, and the name its current call's
    #: tensors are recorded under (``name``, then ``name#1``, ``name#2``, …).
    calls: Dict[str, int] = field(default_factory=dict)
    current: Dict[str, str] = field(default_factory=dict)
    #: Per module: calls recomputed inside the backward pass (activation checkpointing).
    recomputed: Dict[str, int] = field(default_factory=dict)
    #: (module, role, index) → the axes along which the tensor's layout is a guess.
    guesses: Dict[Tuple[str, str, int], List[str]] = field(default_factory=dict)
    #: Per module call: the arithmetic in force when it ran (autocast, TF32; see
    #: :mod:`ttrace.arith`), applied to all its tensors, gradients included.
    arith: Dict[str, Dict[str, str]] = field(default_factory=dict)


class _Tap(torch.autograd.Function):
    """Identity on the way forward — as a copy, so the module may modify its input in place —
    that hands the gradient flowing back through it to a callback."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, callback: Callable[[torch.Tensor], None]) -> Any:
        ctx.callback = callback
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.callback(grad)
        return grad, None


# --- the tracer ----------------------------------------------------------------------------------

ModuleSelector = Union[Sequence[str], Callable[[str, torch.nn.Module], bool], None]


@functools.lru_cache(maxsize=None)
def _site_mode_type() -> type:
    from torch.overrides import TorchFunctionMode

    class SiteMode(TorchFunctionMode):
        """Sees the functional calls of traced steps: ``scaled_dot_product_attention`` (which
        transformers' attention interfaces and torchtitan's attention call) becomes an
        attention site of the module it runs in, for every tracer attached on this thread."""

        def __init__(self, state: "_SiteState") -> None:
            super().__init__()
            self.state = state

        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention and self.state.tracers:
                return _attention_call(func, self.state.recipients(), *args, **kwargs)
            return func(*args, **kwargs)

    return SiteMode


def _attention_call(func: Callable[..., Any], tracers: List["Tracer"], /, *args: Any,
                    **kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` called through each tracer's attention site in turn (the
    first records the call's tensors and hands its tapped inputs to the next)."""
    if not tracers:
        return func(*args, **kwargs)
    inner = functools.partial(_attention_call, func, tracers[1:])
    return tracers[0]._attention_site(inner, args, kwargs)


class _SiteState:
    """A thread's one attention-site mode and the tracers attached to it.

    One mode serves every tracer of the thread (several ranks emulated in one process attach
    several): it is entered when the first tracer attaches and left when the last detaches, so
    no tracer ever pops a mode it did not push (``TorchFunctionMode.__exit__`` pops whatever
    is on top). A mode another owner entered above ours keeps ours on the stack: it stays
    there inert (no tracers) and is reused by the next attach, so the stack never grows. A
    tracer detached from another thread leaves the mode inert too (the stack is per thread)."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.mode: Optional[Any] = None
        self.tracers: List["Tracer"] = []

    def recipients(self) -> List["Tracer"]:
        """The tracers an attention call belongs to: those inside one of their modules, or
        every attached tracer for a call outside all of them."""
        inside = [t for t in self.tracers if t._stack]
        return inside or list(self.tracers)

    def attach(self, tracer: "Tracer") -> None:
        if not any(t is tracer for t in self.tracers):
            self.tracers.append(tracer)
        if self.mode is None:
            self.mode = _site_mode_type()(self)
            self.mode.__enter__()

    def detach(self, tracer: "Tracer") -> None:
        self.tracers = [t for t in self.tracers if t is not tracer]
        if self.tracers or self.mode is None or threading.get_ident() != self.owner:
            return
        from torch.overrides import _get_current_function_mode
        if _get_current_function_mode() is self.mode:
            self.mode.__exit__(None, None, None)
            self.mode = None


_SITE_LOCAL = threading.local()


def _site_state() -> _SiteState:
    """This thread's :class:`_SiteState`."""
    state = getattr(_SITE_LOCAL, "state", None)
    if state is None:
        state = _SITE_LOCAL.state = _SiteState()
    return state


class Tracer:
    """Records training steps of ``model`` on this rank (see the module docs).

    ``directory``: where traced steps are written (``directory/step{n}``). ``mesh``: a
    :class:`Mesh`, or a ``DeviceMesh`` (default: found from the model's DTensor parameters,
    else data parallel over the ``torch.distributed`` world, else one rank). ``rank``: this
    rank's ttrace global rank (default: from the mesh coordinates or ``torch.distributed``).
    ``axes``: ttrace axis → DeviceMesh dimension name, for meshes whose names are not
    recognized. ``layouts``: per-module tensor-parallel placements of plain tensors.
    ``kinds``: module kinds (``linear``, ``norm``, ``attention``, ``activation``,
    ``residual``, ``embedding``, ``loss``) for modules whose type does not say.
    ``modules``: what to trace. ``every``: trace one step in N. ``dp_dim``: the batch
    dimension of activations (default 0; 1 for models with Megatron layers, whose activations
    are [sequence, batch, hidden], and whose mesh is read from Megatron's parallel state). ``recipe``: a ttrace recipe name for the manifest.
    ``formats``: per-module ``{"quantize", "accumulate", "combine"}`` format names. Declare
    ``"accumulate"`` for a module whose kernel accumulates below FP32 (``"bf16"``, ``"f16"``):
    such sums round one way, so the check then runs no scale or bias test on the trace.
    ``sites``: trace functional attention — each call of
    ``torch.nn.functional.scaled_dot_product_attention`` (transformers' and torchtitan's
    attention cores) as an attention site ``{module}.sdpa`` of the module that calls it
    (default: when ``modules`` is not given).
    ``unsupported``: ``"raise"`` (default) or ``"skip"`` a tensor whose layout the trace
    format cannot express. ``background``: write on a background thread (default: with a
    ``directory``; without one the tracer records from construction until :meth:`write`,
    which then writes before returning).
    ``local_mean_loss``: how each data-parallel rank normalizes its loss. ``True``: it averages
    over its own share of the batch (the usual DDP / FSDP loop), so the gradients flowing
    through activations are dp times those of a reference averaging over the whole batch; they
    are recorded divided by dp (exactly, for dp a power of two). ``False``: normalized by the
    global batch (Megatron's token count), recorded as computed. ``None`` (default): not
    stated — recorded as computed and marked ``"dp_loss": "auto"`` in the manifest, and the
    checker settles which from the reference (the first activation gradients compared both
    ways; its report says which it took).
    A scalar a module returns under data parallelism (a loss module's output) is each rank's
    value over its share of the batch: recorded as a partial sum over dp (divided by dp with
    ``local_mean_loss=True``, so the ranks' mean is judged against the reference's).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        directory: Optional[Union[str, "os.PathLike[str]"]] = None,
        *,
        mesh: Any = None,
        rank: Optional[int] = None,
        axes: Optional[Dict[str, str]] = None,
        layouts: Optional[Dict[str, ModuleLayout]] = None,
        kinds: Optional[Dict[str, str]] = None,
        modules: ModuleSelector = None,
        every: int = 1,
        dp_dim: Optional[int] = None,
        recipe: Optional[str] = None,
        formats: Optional[Dict[str, dict]] = None,
        unsupported: str = "raise",
        background: Optional[bool] = None,
        local_mean_loss: Optional[bool] = None,
        fsync: bool = False,
        sites: Optional[bool] = None,
        pool_bytes: int = DEFAULT_POOL_BYTES,
    ) -> None:
        if every < 1:
            raise InvalidInputError(f"every must be at least 1 (got {every})", "InvalidParameter")
        if pool_bytes < 0:
            raise InvalidInputError(f"pool_bytes must be non-negative (got {pool_bytes})",
                                    "InvalidParameter")
        if unsupported not in ("raise", "skip"):
            raise InvalidInputError(
                f"unsupported must be 'raise' or 'skip' (got {unsupported!r})", "InvalidParameter"
            )
        # DistributedDataParallel wraps the model as `.module`: trace the model itself, so its
        # module names are the reference's.
        while type(model).__name__ == "DistributedDataParallel" and hasattr(model, "module"):
            model = cast(torch.nn.Module, model.module)
        self.model = model
        self.directory = os.fspath(directory) if directory is not None else None
        self.axes = dict(axes or {})
        self.kinds = dict(kinds or {})
        self.formats = dict(formats or {})
        self.recipe = recipe
        self.dp_dim = 0 if dp_dim is None else dp_dim
        self.every = every
        self.unsupported = unsupported
        self.local_mean_loss = local_mean_loss
        self.fsync = fsync
        self._dtensor = _dtensor_type()
        named = dict(model.named_modules())
        self._named = named
        self.layouts: Dict[str, ModuleLayout] = {}
        for n, m in named.items():
            ml = _megatron_layout(m, n)
            if ml is not None:
                self.layouts[n] = ml
        self._megatron = bool(self.layouts)
        if dp_dim is None and self._megatron:
            # Megatron's activations are [sequence, batch, hidden]; elsewhere the batch leads.
            self.dp_dim = 1
        self.layouts.update(layouts or {})
        self.names = self._select(modules)
        unknown = [n for n in list(layouts or {}) + list(self.kinds) if n not in named]
        if unknown:
            raise InvalidInputError(f"no module named {unknown[0]!r} in the model", "UnknownName")
        #: Whether functional attention (``scaled_dot_product_attention`` calls) is traced
        #: as attention sites inside the modules that call it.
        self.sites = modules is None if sites is None else sites
        self._sites: "set[str]" = set()
        self._stack: List[str] = []
        self._site_state: Optional[_SiteState] = None
        self._mesh_maps: Dict[int, _MeshMap] = {}
        #: Why the device mesh cannot be placed, if it cannot (reported per tensor).
        self._mesh_error: Optional[str] = None
        self.mesh, self.rank = self._find_mesh(mesh, rank)
        #: Tensors left out because their layout cannot be expressed: (id, reason).
        self.skipped: List[Tuple[str, str]] = []
        #: Bytes of tensor data written so far (all steps).
        self.bytes_written = 0
        self.steps = 0
        self.last_directory: Optional[str] = None
        self._s = _StepRecord()
        #: Host copies: pooled buffers, asynchronous on CUDA (see :mod:`ttrace._copies`).
        self._copier = Copier(pool_bytes)
        self._handles: List[Any] = []
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._errors: List[BaseException] = []
        self._writer: Optional[threading.Thread] = None
        self._background = background if background is not None else directory is not None
        self._closed = False
        self._atexit = False
        if directory is None:
            # No steps to delimit: record from now until write().
            self.attach()

    # -- configuration ----------------------------------------------------------------------

    def _select(self, modules: ModuleSelector) -> List[str]:
        named = self._named
        if modules is None:
            return [n for n, m in named.items()
                    if n and (not any(True for _ in m.children()) or _is_attention_core(m))]
        if callable(modules):
            return [n for n, m in named.items() if n and modules(n, m)]
        names: List[str] = []
        for pattern in modules:
            hits = [n for n in named if n and fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise InvalidInputError(
                    f"no module named {pattern!r} in the model", "UnknownName"
                )
            names.extend(h for h in hits if h not in names)
        return names

    def _find_mesh(self, mesh: Any, rank: Optional[int]) -> Tuple[Mesh, int]:
        dist = torch.distributed
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        grank = dist.get_rank() if world > 1 else 0
        device_mesh = None
        if mesh is not None and not isinstance(mesh, Mesh):
            device_mesh = mesh
        if mesh is None and self._dtensor is not None:
            for p in self.model.parameters():
                if isinstance(p, self._dtensor):
                    device_mesh = cast(Any, p).device_mesh
                    break
        if device_mesh is not None:
            if "_default" not in self.axes:
                # A 1-D mesh without names: data parallel under fully_shard, else tensor
                # parallel.
                self.axes["_default"] = "dp" if _uses_fsdp(self.model) else "tp"
            # A sub-mesh (TP on mesh["tp"] of a 2-D mesh whose other dimension is data
            # parallel): the whole mesh places this rank.
            root = _root_mesh(device_mesh)
            mm = _MeshMap(root, self.axes)
            if mm.error is not None:
                # Not placeable: every tensor on it is refused (or skipped) with the reason;
                # the tracer itself is built, over the process group's ranks.
                self._mesh_error = mm.error
                m = Mesh(dp=world)
                return m, (rank if rank is not None else grank)
            m = Mesh(tp=mm.sizes["tp"], cp=mm.sizes["cp"], dp=mm.sizes["dp"])
            if m.world() != world and world > 1:
                # A mesh over part of the world (e.g. TP inside a DP replica group that is not
                # a DTensor dimension) cannot be placed in ttrace's mesh.
                raise UnsupportedLayoutError(
                    f"the device mesh has {m.world()} ranks but the process group has {world}; "
                    "give the Tracer a mesh that covers every rank",
                    "Layout",
                )
            r = m.rank(dp=mm.coords["dp"], cp=mm.coords["cp"], tp=mm.coords["tp"])
            return m, (rank if rank is not None else r)
        megatron = self._megatron_mesh() if mesh is None and self._megatron else None
        if isinstance(mesh, Mesh):
            m = mesh
        elif megatron is not None:
            m, r = megatron
            return m, (rank if rank is not None else r)
        else:
            m = Mesh(dp=world)
        r = rank if rank is not None else grank
        if not 0 <= r < m.world():
            raise InvalidInputError(
                f"rank {r} is outside the mesh ({m.world()} ranks)", "InvalidParameter"
            )
        return m, r

    def _megatron_mesh(self) -> Optional[Tuple[Mesh, int]]:
        """The mesh of a model with Megatron-LM layers, from Megatron's parallel state (only
        when the program imported and initialized it: ttrace never imports Megatron)."""
        import sys

        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is None or not ps.model_parallel_is_initialized():
            return None
        sp = any(getattr(m, "sequence_parallel", False) for m in self._named.values())
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

    # -- recording ----------------------------------------------------------------------------

    @contextmanager
    def step(self) -> Iterator["Tracer"]:
        """Trace the training step run inside the block (when this step is one in ``every``);
        parameter gradients are read as the block ends, and the step is handed to the writer."""
        if self._closed:
            raise InvalidInputError("the tracer is closed", "InvalidParameter")
        if self.directory is None:
            raise InvalidInputError(
                "Tracer(model, directory) is needed for step(); or call write(dir)",
                "InvalidParameter",
            )
        n = self.steps
        self.steps += 1
        traced = n % self.every == 0
        if traced:
            self.attach()
        try:
            yield self
        finally:
            if traced:
                self.detach()
        if traced:
            self.write(os.path.join(self.directory, f"step{n}"))

    def attach(self) -> None:
        """Register the hooks (``step()`` does this for traced steps)."""
        if self._handles:
            return
        self._drop_step()
        if self.sites:
            # Which module is running (for naming the functional attention sites inside it),
            # and the mode that sees the functional calls (thread-local, only while attached).
            # The root counts ("" names no parent), so that a call it makes is known as this
            # tracer's among several attached on the thread.
            for n, m in self._named.items():
                self._handles.append(m.register_forward_pre_hook(self._push(n)))
                self._handles.append(m.register_forward_hook(self._pop(n), always_call=True))
            self._site_state = _site_state()
            self._site_state.attach(self)
        for n in self.names:
            m = self._named[n]
            # Appended: after the pre-hooks of the module's parallel style, so the inputs are
            # recorded (and tapped) as the module receives them.
            self._handles.append(
                m.register_forward_pre_hook(self._input_hook(n), with_kwargs=True)
            )
            # prepend=True: run before a DTensor output hook converts the output to a local
            # tensor, so the placement is still known.
            self._handles.append(
                m.register_forward_hook(self._forward_hook(n), prepend=True, with_kwargs=True)
            )
            # Appended: the outputs as the caller receives them, after any DTensor conversion;
            # their gradients are tapped there.
            self._handles.append(m.register_forward_hook(self._final_hook(n)))

    def detach(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._site_state is not None:
            # From the thread that attached (the mode stack is per thread).
            state, self._site_state = self._site_state, None
            state.detach(self)
        self._stack = []

    def _call_name(self, base: str) -> str:
        """The name this call of ``base`` records under: ``base``, then ``base#1``, … for
        further calls in the step; a recomputation inside the backward pass (activation
        checkpointing) counts apart and reuses the names of the calls it repeats."""
        counter = self._s.recomputed if _in_backward() else self._s.calls
        calls = counter.get(base, 0)
        counter[base] = calls + 1
        name = base if calls == 0 else f"{base}#{calls}"
        self._s.current[base] = name
        return name

    def _push(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._stack.append(name)
        return hook

    def _pop(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
        return hook

    def _attention_site(self, func: Callable[..., Any], args: Tuple[Any, ...],
                        kwargs: Dict[str, Any]) -> Any:
        """Record one call of ``scaled_dot_product_attention`` as the attention site
        ``{module}.sdpa`` of the module it runs in: query, key, value (and a floating-point
        mask) as its inputs, their gradients tapped, the output and its gradient."""
        parent = self._stack[-1] if self._stack else ""
        base = f"{parent}.sdpa" if parent else "sdpa"
        name = self._call_name(base)
        self._sites.add(name)
        self._sites.add(base)
        keys = ["query", "key", "value", "attn_mask"]
        values = list(args[:4]) + [kwargs.get(k) for k in keys[len(args[:4]):]]
        device = next((v.device.type for v in values if isinstance(v, torch.Tensor)), "cpu")
        if name not in self._s.arith:
            self._s.arith[name] = _arith.module_settings(device)
        recorded = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
        for i, v in enumerate(recorded):
            self._record(name, "fwd.input", i, v)
        self._s.tapped[name] = False
        if torch.is_grad_enabled():
            tapped = {id(v): self._tap(name, i, v) for i, v in enumerate(recorded)}
            values = [tapped.get(id(v), v) if isinstance(v, torch.Tensor) else v
                      for v in values]
        new_args = tuple(values[:len(args[:4])]) + tuple(args[4:])
        new_kwargs = dict(kwargs)
        for k, v in zip(keys[len(args[:4]):], values[len(args[:4]):]):
            if k in kwargs:
                new_kwargs[k] = v
        out = func(*new_args, **new_kwargs)
        self._record(name, "fwd.output", 0, out)
        if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
            out.register_hook(self._output_grad(name, 0))
        return out

    def _layout(self, name: str, role: str, i: int, t: torch.Tensor,
                param: Optional[str] = None) -> dict:
        ml = self.layouts.get(_base(name))
        if param is not None:
            tp = ml.params.get(param, replicate()) if ml else replicate()
        else:
            tp = ml.pick(role, i) if ml else replicate()
        tp = dict(tp)
        if tp.get("kind") == "split" and tp["dim"] < 0:
            tp["dim"] += t.dim()
        if tp.get("kind") == "split" and not 0 <= tp["dim"] < max(t.dim(), 1):
            raise InvalidInputError(
                f"module {name!r}: split dim out of range for a {t.dim()}-d tensor",
                "InvalidParameter",
            )
        if self.mesh.tp == 1:
            tp = replicate()
        dp = replicate()
        if self.mesh.dp > 1 and param is None and t.dim() > self.dp_dim:
            dp = split(self.dp_dim)
        return {"dp": dp, "cp": replicate(), "tp": tp}

    def _mesh_of(self, device_mesh: Any) -> _MeshMap:
        """How the dimensions of a tensor's own device mesh map onto ttrace's axes (unusable
        when the whole mesh the tracer places its ranks on is)."""
        key = id(device_mesh)
        mm = self._mesh_maps.get(key)
        if mm is None:
            mm = self._mesh_maps[key] = _MeshMap(device_mesh, self.axes)
            if mm.error is None and self._mesh_error is not None:
                mm.error = self._mesh_error
        return mm

    def _local_layout(self, tid: str, t: torch.Tensor) -> Optional[dict]:
        """The layout of a plain tensor made by ``DTensor.to_local()`` (its autograd node keeps
        the DTensor's placements), or of the local shard of a DTensor seen before."""
        spec = getattr(t.grad_fn, "dtensor_spec", None)
        if spec is not None:
            mm = self._mesh_of(spec.mesh)
            layout = _placement_layout(tid, spec.placements, spec.mesh, tuple(spec.shape), mm)
            return self._uncovered(layout, mm, t.dim())
        key = _alias_key(t)
        hit = self._s.alias.get(key) if key is not None else None
        # Only while the tensor first seen there lives and still owns that memory (torch can
        # free a live tensor's storage: then the address may hold another tensor).
        return hit[1] if hit is not None and _owns(hit[0](), t) else None

    def _uncovered(self, layout: dict, mm: _MeshMap, ndim: int) -> dict:
        """A non-parameter DTensor's layout completed along the axes its device mesh does not
        cover (TP on ``mesh["tp"]`` of a 2-D mesh whose dp dimension splits the batch as plain
        data): a split of the batch dimension (``dp_dim``) for dp, replication otherwise —
        guesses, listed under ``"_guessed"`` for the checker to settle."""
        missing = [a for a in ("dp", "cp", "tp")
                   if a not in {x for _, x, _ in mm.placed()} and getattr(self.mesh, a) > 1]
        if not missing:
            return layout
        layout = dict(layout)
        if "dp" in missing and ndim > self.dp_dim:
            layout["dp"] = split(self.dp_dim)
        layout["_guessed"] = missing
        return layout

    def _remember(self, owner: torch.Tensor, t: torch.Tensor, layout: dict) -> None:
        key = _alias_key(t)
        if key is not None:
            self._s.alias[key] = (weakref.ref(owner), layout)

    def _derived(self, tid: str, name: str, role: str, i: int, t: torch.Tensor,
                 inherit: Optional[dict]) -> Tuple[Optional[dict], List[str]]:
        """The layout of a plain tensor of a module without declared layouts, derived from
        DTensors of this step (see the module docs), and the axes along which it is only a
        guess (the gradient of a forward tensor whose layout was guessed)."""
        if _base(name) in self.layouts:
            return None, []
        hit = self._local_layout(tid, t)
        if hit is not None:
            return hit, []
        if role == "grad.output":
            key = (name, "fwd.output", i)
            fwd = self._s.final.get((name, i))
        elif role == "grad.input":
            key = (name, "fwd.input", i)
            fwd = self._s.forward.get(key)
        else:
            fwd = None
        if fwd is not None and fwd[0] == tuple(t.shape):
            return _grad_layout(fwd[1]), self._s.guesses.get(key, [])
        if role == "fwd.output" and inherit is not None and inherit["shape"] == tuple(t.shape):
            return inherit["layout"], []
        return None, []

    def _record(self, name: str, role: str, i: int, t: Any, param: Optional[str] = None,
                inherit: Optional[dict] = None, info: Optional[dict] = None) -> Optional[dict]:
        """Record one tensor; returns its layout when it was derived from a DTensor."""
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return None
        tid = f"{name}.{param}|param_grad" if param is not None else f"{name}|{role}.{i}"
        declared = self.layouts.get(_base(name))
        if declared is not None and declared.swap_outputs and role in ("fwd.output",
                                                                      "grad.output"):
            t = t.transpose(*declared.swap_outputs)
        derived = None
        guessed: List[str] = []
        scalar_mean = False
        #: Axes along which a module hands its caller a partial sum as a plain tensor.
        unreduced: List[str] = []
        try:
            if self._dtensor is not None and isinstance(t, self._dtensor):
                dt = cast(Any, t)
                mm = self._mesh_of(dt.device_mesh)
                if param is not None:
                    dt = _gather_param(dt, mm if mm.error is None else None)
                layout = _placement_layout(tid, dt.placements, dt.device_mesh, tuple(dt.shape),
                                           mm)
                if param is None:
                    layout = self._uncovered(layout, mm, dt.dim())
                    if self.mesh.cp > 1 and layout["cp"]["kind"] == "split":
                        # Context parallelism places the sequence as Shard(seq) on the cp mesh
                        # in whatever order its load balancer put the tokens (torch's CP:
                        # head-tail chunks for causal attention): the order is settled from
                        # the values.
                        layout = _with_guess(layout, "cp")
                local = dt.to_local()
                derived = layout
                self._remember(getattr(dt, "_local_tensor", local), local, layout)
            else:
                local = t
                derived, guessed = (self._derived(tid, name, role, i, t, inherit)
                                    if param is None else (None, []))
                layout = derived if derived is not None else self._layout(name, role, i, t, param)
                if (role == "fwd.output" and derived is not None
                        and getattr(t.grad_fn, "dtensor_spec", None) is not None):
                    # A DTensor's Partial() made local and handed on with no reduction: merged
                    # as the sum it is, but the caller's plain code uses one rank's addend.
                    unreduced = _partial_axes(derived)
                if derived is None and self.mesh.world() > 1:
                    # Neither a DTensor, nor declared, nor derived from one: a guess the
                    # checker settles from the shapes. Under data parallelism the batch
                    # dimension of a plain tensor is a guess too (dp_dim), even where its
                    # tensor-parallel placement is declared.
                    guessed = [a for a, unknown in (("dp", self.mesh.dp > 1 and param is None),
                                                    ("cp", self.mesh.cp > 1 and param is None),
                                                    ("tp", self.mesh.tp > 1
                                                     and _base(name) not in self.layouts))
                               if unknown]
                if derived is not None and "_guessed" in derived:
                    guessed = sorted(set(guessed) | set(derived["_guessed"]))
                if guessed:
                    # Not handed on as known (the gradient of this tensor is a guess too).
                    derived = None
                if param is None and derived is None and _base(name) in self.layouts:
                    # A declared layout (Megatron's layers): the modules this tensor is handed
                    # to next find it by its memory — with its cp placement still a guess
                    # under context parallelism (the sequence's chunks are no layer's).
                    derived = _with_guess(layout, "cp") if "cp" in guessed else layout
                    self._remember(t, t, derived)
                if t.dim() == 0 and self.mesh.dp * self.mesh.cp > 1 and param is None:
                    # A scalar under data (or context) parallelism is each rank's own value,
                    # a loss over its share of the batch: the reference's is their sum when
                    # each is normalized by the global count, their mean when each averages
                    # its own share (divided by dp·cp here with local_mean_loss=True, by the
                    # checker when it settles an unstated normalization). Its gradient is the
                    # backward's seed, the same on every rank.
                    fwd = role.startswith("fwd.")
                    for a in ("dp", "cp"):
                        if getattr(self.mesh, a) > 1:
                            layout = {**layout, a: partial() if fwd else replicate()}
                    guessed = [a for a in guessed if a not in ("dp", "cp")]
                    derived = None
                    scalar_mean = fwd and self.local_mean_loss is True
        except UnsupportedLayoutError as e:
            if self.unsupported == "skip":
                self.skipped.append((tid, str(e)))
                return None
            raise
        if local.dtype not in _DTYPES:
            raise InvalidInputError(
                f"tensor {tid!r}: dtype {local.dtype} cannot be stored", "UnknownFormat"
            )
        # With local_mean_loss=True, an activation gradient in parts along the data ranks
        # (dp split; under context parallelism every one, its cp placement mostly a guess) is
        # dp·cp times the reference's: recorded divided.
        data = self.mesh.dp * self.mesh.cp
        scaled = scalar_mean or (self.local_mean_loss is True and data > 1
                                 and role.startswith("grad.") and param is None
                                 and (layout["dp"]["kind"] == "split"
                                      or (self.mesh.cp > 1 and t.dim() > 0)))
        # The same tensor handed from one module to the next (an output that is the next
        # module's input: same memory, shape, strides and version while the first holder
        # lives) is copied and stored once, both ids naming it — and only when the contents
        # are bitwise equal, checked: torch can free a live tensor's storage and reuse the
        # memory (DTensor's collectives do), which no address or version test sees.
        owner = t._local_tensor if local is not t and hasattr(t, "_local_tensor") else local
        key = _alias_key(local)
        same = (key, local._version, scaled)
        hit = self._s.copies.get(same) if key is not None else None
        copy = None
        if hit is not None and hit[0]() is not None and not scaled and local.device.type == "cpu":
            # (On a CUDA device the comparison would wait for the device: the tensor is
            # copied again, asynchronously, and the writer stores equal contents once.)
            candidate = hit[1]
            if torch.equal(_bits(candidate.tensor), _bits(local.detach())):
                copy = candidate
        if copy is None:
            try:
                copy = self._copier.copy(local, 1.0 / data if scaled else None)
            except RuntimeError as e:
                # A tensor whose storage torch already released cannot be read.
                why = f"tensor {tid!r} cannot be read ({e})"
                if self.unsupported == "skip":
                    self.skipped.append((tid, why))
                    return None
                raise TtraceError(why, "Storage") from None
            self._s.made.append(copy)
            if key is not None:
                self._s.copies[same] = (weakref.ref(owner), copy)
        if tid not in self._s.records:
            self._s.order.append(tid)
        self._s.records[tid] = copy
        if "_guessed" in layout:
            guessed = sorted(set(guessed) | set(layout["_guessed"]))
            layout = {k: v for k, v in layout.items() if k != "_guessed"}
        module_info = self._module_info(name)
        if info:
            module_info = {**info, **(module_info or {})}  # declared formats win
        if unreduced:
            module_info = {**(module_info or {}), "unreduced": unreduced}
        settings = self._s.arith.get(name)
        if settings:
            module_info = {**settings, **(module_info or {})}
        self._s.meta[tid] = {"layout": layout, "module": module_info,
                             "guessed": guessed}
        if param is None:
            self._s.forward[(name, role, i)] = (tuple(local.shape), layout)
            if guessed:
                self._s.guesses[(name, role, i)] = guessed
        return derived

    def _kind(self, name: str) -> Optional[str]:
        if name in self.kinds:
            return self.kinds[name]
        if name in self._sites:
            return "attention"
        return _kind_of(self._named[name])

    def _module_info(self, name: str) -> Optional[dict]:
        name = _base(name)
        kind = self._kind(name)
        info = {"kind": kind} if kind is not None else {}
        info.update(self.formats.get(name, {}))
        return info or None

    def _input_hook(self, base: str) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
            # A module called again in the same step (one activation instance used twice, a
            # rotary module applied to queries and keys) is recorded under `name#k` for its
            # k-th further call, so no call's tensors overwrite another's.
            # A forward run again inside the backward pass is activation checkpointing's
            # recomputation of calls already seen: it reuses their names (counted apart), so
            # its tensors and the gradients it produces land on the forward's ids.
            name = self._call_name(base)
            if name not in self._s.arith:
                self._s.arith[name] = _arith.module_settings(_device_type(module, args, kwargs))
            # Recorded (copied) before the module runs: it may modify them in place.
            inherit = None
            # Keyword tensors (hidden_states=x, as Hugging Face models pass them) follow the
            # positional ones, in the order given.
            keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
            inputs = list(args) + [kwargs[k] for k in keys]
            for i, a in enumerate(inputs):
                derived = self._record(name, "fwd.input", i, a)
                if derived is not None and inherit is None and not _is_dtensor(a, self._dtensor):
                    inherit = {"shape": tuple(a.shape), "layout": derived}
            self._s.inherit[name] = inherit
            self._s.tapped[name] = False
            if not torch.is_grad_enabled():
                return args, kwargs
            tapped = [self._tap(name, i, a) for i, a in enumerate(inputs)]
            kwargs = dict(kwargs)
            for k, t in zip(keys, tapped[len(args):]):
                kwargs[k] = t
            return tuple(tapped[:len(args)]), kwargs
        return hook

    def _tap(self, name: str, i: int, a: Any) -> Any:
        """``a`` as the module should receive it: through a :class:`_Tap` recording the
        gradient that flows back to it through the module (when it needs one)."""
        if not isinstance(a, torch.Tensor) or not a.is_floating_point() or not a.requires_grad:
            return a
        record = self._s
        self._s.tapped[name] = True

        def got(g: torch.Tensor) -> None:
            if self._s is record:  # the step is still being recorded
                self._record(name, "grad.input", i, g)
                # Parameter gradients are read when the step ends; remember where they belong.
                record.order.append(("params", _base(name)))

        return _Tap.apply(a, got)

    def _forward_hook(self, base: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 output: Any) -> None:
            name = self._s.current.get(base, base)
            inherit = self._s.inherit.get(name)
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for i, o in enumerate(outs):
                if _is_dtensor(o, self._dtensor) and not _expressible(o):
                    # Recorded as the caller receives it (after the module's parallel style
                    # redistributes it), by the appended hook.
                    self._s.deferred.add((name, i))
                    continue
                derived = self._record(name, "fwd.output", i, o, inherit=inherit)
                if derived is not None and isinstance(o, torch.Tensor):
                    self._remember(o, o, derived)
                if f"{name}|fwd.output.{i}" in self._s.records:
                    self._s.returned[(name, i)] = (o, _local_version(o, self._dtensor))
        return hook

    def _final_hook(self, base: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Tuple[Any, ...], output: Any) -> None:
            name = self._s.current.get(base, base)
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for i, o in enumerate(outs):
                if not isinstance(o, torch.Tensor) or not o.is_floating_point():
                    continue
                tid = f"{name}|fwd.output.{i}"
                if (name, i) in self._s.deferred:
                    self._s.deferred.discard((name, i))
                    self._record(name, "fwd.output", i, o)
                layout: Optional[dict]
                try:
                    if _is_dtensor(o, self._dtensor):
                        dt = cast(Any, o)
                        layout = _placement_layout(tid, dt.placements, dt.device_mesh,
                                                   tuple(dt.shape), self._mesh_of(dt.device_mesh))
                        shape = tuple(dt.to_local().shape)
                    else:
                        layout = self._local_layout(tid, o)
                        shape = tuple(o.shape)
                        if layout is None:
                            recorded = self._s.forward.get((name, "fwd.output", i))
                            layout = recorded[1] if recorded is not None else None
                except UnsupportedLayoutError:
                    layout = None
                if layout is not None:
                    self._s.final[(name, i)] = (shape, layout)
                    self._rerecord_if_hooked(name, i, o, layout)
                    if not _is_dtensor(o, self._dtensor):
                        self._mark_unreduced(tid, o, layout)
                if o.requires_grad and torch.is_grad_enabled():
                    o.register_hook(self._output_grad(name, i))
        return hook

    def _mark_unreduced(self, tid: str, o: torch.Tensor, layout: dict) -> None:
        """A module output its caller receives as a plain tensor made local from a DTensor's
        Partial() (a parallel style whose output layout is Partial, handed on with
        ``use_local_output``): marked in its module info, for the check to name the module
        when the sum's use fails (see :meth:`_record`)."""
        if getattr(o.grad_fn, "dtensor_spec", None) is None or tid not in self._s.meta:
            return
        axes = _partial_axes(layout)
        if axes:
            meta = self._s.meta[tid]
            meta["module"] = {**(meta.get("module") or {}), "unreduced": axes}

    def _rerecord_if_hooked(self, name: str, i: int, o: torch.Tensor, layout: dict) -> None:
        """An output hook that changed a module's output without changing its placement (a
        scale, a clamp, a bug planted as a hook): the caller receives the changed values, so
        they are the module's output — a difference they carry is born in this module, not in
        the gap after it. (The first record runs before the output hooks, where a DTensor's
        placement is still known; a parallel style's redistribution changes the layout and is
        left as recorded.)"""
        hit = self._s.returned.pop((name, i), None)
        if hit is None:
            return
        first, version = hit
        if o is first and _local_version(o, self._dtensor) == version:
            return  # untouched: no hook changed it (the usual case, free)
        tid = f"{name}|fwd.output.{i}"
        recorded = self._s.forward.get((name, "fwd.output", i))
        stored = self._s.records.get(tid)
        after = cast(Any, o).to_local() if _is_dtensor(o, self._dtensor) else o
        if (recorded is None or recorded[1] != layout or stored is None
                or tuple(after.shape) != tuple(stored.shape) or after.dtype != stored.dtype):
            return
        if o is first:
            # Changed in place: only the stored copy still holds what the module returned.
            same = torch.equal(after.detach().to("cpu"), stored.wait())
        else:
            # A new tensor (a parallel style's to_local, or a hook's result): compared where
            # it lives, copied only if it differs.
            local = cast(Any, first).to_local() if _is_dtensor(first, self._dtensor) else first
            same = tuple(local.shape) == tuple(after.shape) and torch.equal(after, local)
        if not same:
            copy = self._copier.copy(after)
            self._s.made.append(copy)
            self._s.records[tid] = copy

    def _output_grad(self, name: str, i: int) -> Callable[[torch.Tensor], None]:
        record = self._s

        def got(g: torch.Tensor) -> None:
            if self._s is record:
                self._record(name, "grad.output", i, g)
                if not record.tapped.get(name, False):
                    # No input takes a gradient: the parameters' come with this one.
                    record.order.append(("params", _base(name)))

        return got

    # -- writing ------------------------------------------------------------------------------

    def write(self, directory: Union[str, "os.PathLike[str]"], combine: bool = False) -> str:
        """Hand the recorded step to the writer: ``rank{r}.safetensors`` and
        ``manifest.rank{r}.json`` in ``directory``. Parameter gradients are read now and placed
        right after their module's backward tensors (execution order). With ``combine=True``
        (the last of several ranks emulated in one process) the fragments are then merged into
        ``manifest.json`` (see :func:`finish`). Returns the directory."""
        directory = os.fspath(directory)
        order, seen = [], set()
        for item in self._s.order:
            if isinstance(item, tuple):
                name = item[1]
                if name not in self._named:  # a functional site: no parameters
                    continue
                module = self._named[name]
                for pname, p in module.named_parameters(recurse=False):
                    grad, info = _param_grad(module, pname, p)
                    if grad is not None:
                        self._record(name, "param", 0, grad, param=pname, info=info)
                        tid = f"{name}.{pname}|param_grad"
                        if tid not in seen and tid in self._s.records:
                            seen.add(tid)
                            order.append(tid)
            elif item not in seen:
                seen.add(item)
                order.append(item)
        fname = f"rank{self.rank}.safetensors"
        tensors, entries = [], []
        keys: Dict[int, str] = {}
        for tid in order:
            t = self._s.records[tid]
            key = keys.get(id(t))
            if key is None:
                key = keys[id(t)] = tid
                tensors.append((tid, _DTYPES[t.dtype], list(t.shape), t))
            e = {"id": tid, "rank": self.rank, "file": fname, "key": key,
                 "dtype": _DTYPES[t.dtype], "layout": self._s.meta[tid]["layout"]}
            if self._s.meta[tid]["module"] is not None:
                e["module"] = self._s.meta[tid]["module"]
            if self._s.meta[tid]["guessed"]:
                e["guessed"] = self._s.meta[tid]["guessed"]
            entries.append(e)
        # The step's header and entries: the Rust core adds the format and version, builds
        # the manifest, validates it as every reader does, and writes it (one writer).
        manifest: Dict[str, Any] = {"mesh": self.mesh.to_json(), "run": _arith.run_settings(),
                                    "tensors": entries}
        if self.recipe:
            manifest["recipe"] = self.recipe
        if self.local_mean_loss is None and self.mesh.dp * self.mesh.cp > 1:
            manifest["dp_loss"] = "auto"
        made = self._s.made
        for c in made:
            c.hand()
        job = (directory, fname, tensors, manifest, made)
        self._s = _StepRecord()
        self.last_directory = directory
        if self._background:
            self._start_writer()
            self._queue.put(job)
        else:
            self._write_job(job)
        if combine:
            self.flush()
            finish(directory)
        return directory

    def _write_job(self, job: Tuple[str, str, list, dict, List[HostCopy]]) -> None:
        directory, fname, tensors, manifest, made = job
        stored: list = []
        try:
            os.makedirs(directory, exist_ok=True)
            # The device copies are complete once their events are (the only wait for the
            # device, on this thread).
            stored = [
                (tid, fmt, shape, t.wait().reshape(-1).view(torch.uint8).numpy())
                for tid, fmt, shape, t in tensors
            ]
            # The tensors, then the manifest last (an interrupted write leaves no manifest
            # naming missing files), both by the Rust core.
            self.bytes_written += _ttrace.write_step(
                directory, fname, stored, {"rank": str(self.rank)},
                f"manifest.rank{self.rank}.json", json.dumps(manifest), self.fsync
            )
        finally:
            del stored
            for c in made:
                c.release()

    def _drop_step(self) -> None:
        """Start a new step record, giving the unwritten copies' buffers back."""
        for c in self._s.made:
            c.release()
        self._s = _StepRecord()

    def _start_writer(self) -> None:
        if self._writer is not None:
            return

        def run() -> None:
            while True:
                job = self._queue.get()
                try:
                    if job is None:
                        return
                    self._write_job(job)
                except BaseException as e:  # reported by flush()/close()
                    self._errors.append(e)
                finally:
                    self._queue.task_done()

        self._writer = threading.Thread(target=run, name="ttrace-writer", daemon=True)
        self._writer.start()
        if not self._atexit:
            atexit.register(self.flush)
            self._atexit = True

    def flush(self) -> int:
        """Wait until every handed step is on disk; re-raises a write error. Returns the bytes
        written so far."""
        if self._writer is not None:
            self._queue.join()
        if self._errors:
            e = self._errors.pop(0)
            self._errors.clear()
            if isinstance(e, TtraceError):
                raise e
            raise TtraceError(f"writing the trace failed: {e}", "File") from e
        return self.bytes_written

    def close(self) -> int:
        """Remove the hooks, wait for the writer and stop it. Returns the bytes written."""
        self.detach()
        try:
            return self.flush()
        finally:
            if self._writer is not None:
                self._queue.put(None)
                self._writer.join()
                self._writer = None
            self._drop_step()
            self._copier.clear()
            if self._atexit:
                atexit.unregister(self.flush)
                self._atexit = False
            self._closed = True

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def finish(directory: Union[str, "os.PathLike[str]"]) -> str:
    """Merge every ``manifest.rank*.json`` of ``directory`` into ``manifest.json`` (rank
    order) — for several ranks emulated in one process. ``ttrace check`` reads fragments
    without this. The fragments must agree on the mesh, recipe and loss normalization
    (:class:`~ttrace.errors.InvalidInputError` otherwise); the Rust core merges and writes, as
    it reads."""
    _ttrace.merge_manifests(os.fspath(directory))
    return os.fspath(directory)


# --- consistent generation ---------------------------------------------------------------------

def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators alike in the reference and sharded runs.
    (This sets process-wide generator state, as any seeding does; it is never called on
    import.)"""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _shard(t: torch.Tensor, placement: dict, rank: int, parts: int) -> torch.Tensor:
    if placement.get("kind") != "split":
        return t
    dim = placement["dim"] % t.dim()
    groups = placement.get("groups", 1)
    n = t.shape[dim]
    if n % (groups * parts):
        raise InvalidInputError(
            f"dimension {dim} of length {n} does not split into {groups}x{parts}",
            "InvalidParameter",
        )
    view = t.reshape(*t.shape[:dim], groups, parts, n // (groups * parts), *t.shape[dim + 1:])
    return view.select(dim + 1, rank).reshape(*t.shape[:dim], n // parts, *t.shape[dim + 1:])


@torch.no_grad()
def copy_sharded(reference: torch.nn.Module, sharded: torch.nn.Module,
                 layouts: Dict[str, ModuleLayout], tp_rank: int, tp: int,
                 skip: Sequence[str] = ()) -> None:
    """Copy every parameter of ``reference`` into ``sharded`` (same module names), taking
    rank ``tp_rank``'s slice of the parameters the layouts declare split. Shapes must match;
    parameters named in ``skip`` are left alone."""
    ref = dict(reference.named_parameters())
    for name, p in sharded.named_parameters():
        if name in skip:
            continue
        if name not in ref:
            raise InvalidInputError(
                f"parameter {name!r} of the sharded model is not in the reference", "UnknownName"
            )
        module, _, local = name.rpartition(".")
        ml = layouts.get(module)
        placement = ml.params.get(local, replicate()) if ml else replicate()
        src = _shard(ref[name], placement, tp_rank, tp) if tp > 1 else ref[name]
        if src.shape != p.shape:
            raise InvalidInputError(
                f"parameter {name!r}: shard {tuple(src.shape)} vs {tuple(p.shape)}",
                "ShapeMismatch",
            )
        p.copy_(src.to(p.dtype))

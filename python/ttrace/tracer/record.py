"""What one traced step records: the host copies by id with their layouts and module
information, the bookkeeping the hooks share, and the helpers that identify tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch

from .._copies import HostCopy
from .._summaries import ShardStats
from .placements import Layout

_DTYPES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
}
for _name, _code in (("float8_e4m3fn", "e4m3"), ("float8_e5m2", "e5m2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code

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

def _alias_key(t: torch.Tensor) -> Optional[Tuple[Any, ...]]:
    """The memory a tensor views (address, shape, strides, dtype); None for a tensor whose
    storage torch has already released."""
    try:
        return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
    except RuntimeError:
        return None



def _device_type(module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
    """The device type a module call runs on: its first tensor argument's, else its first
    parameter's, else ``cpu``."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device.type
    for p in module.parameters(recurse=False):
        return p.device.type
    return "cpu"

def _on_meta(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether a call's tensors (arguments, or outputs given as ``(output,)``; lists and tuples
    looked into) are on the ``meta`` device: shape inference, which computes no values."""
    stack = list(args) + list(kwargs.values())
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            if a.device.type == "meta":
                return True
        elif isinstance(a, (tuple, list)):
            stack.extend(a)
    return False

def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (a module's forward then is
    a recomputation: activation checkpointing)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1

def _base(name: str) -> str:
    """The module name of a recorded name (``act#1``: the second call of ``act``)."""
    return name.split("#", 1)[0]

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

@dataclass
class _StepRecord:
    """What one traced step has recorded, and what it has learned about layouts."""

    #: Host copies of the recorded tensors (their statistics, summaries only), by id.
    records: Dict[str, Union[HostCopy, ShardStats]] = field(default_factory=dict)
    #: Every host copy made in the step (stored or replaced), released after writing.
    made: List[HostCopy] = field(default_factory=list)
    #: Layout and module information, by id.
    meta: Dict[str, dict] = field(default_factory=dict)
    #: Ids in execution order, and ("params", module) where parameter gradients belong.
    order: List[Any] = field(default_factory=list)
    #: Layouts learned by memory (a weak reference to the first holder, the layout).
    alias: Dict[Any, Tuple[Any, Layout]] = field(default_factory=dict)
    #: (module, role, index) → (local shape, layout), for the gradients of forward tensors.
    forward: Dict[Tuple[str, str, int], Tuple[Tuple[int, ...], Layout]] = field(
        default_factory=dict)
    #: (module, output index) → (local shape, layout) of the output the caller receives.
    final: Dict[Tuple[str, int], Tuple[Tuple[int, ...], Layout]] = field(default_factory=dict)
    #: Stored copies shared between ids (a weak reference to the first holder, the copy, the
    #: recorded names of the module calls that recorded it).
    copies: Dict[Any, Tuple[Any, Union[HostCopy, ShardStats], Set[str]]] = field(
        default_factory=dict)
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
    #: Per call of a grouped-experts module given its token counts: how its rows split by
    #: expert (see :mod:`ttrace.tracer.routed`); its tensors are recorded expert by expert.
    routed: Dict[str, Any] = field(default_factory=dict)
    #: Copies folded into microbatch concatenations whose sharing by identity the writer must
    #: still verify (see :mod:`ttrace.tracer.microbatches`).
    folded: List[HostCopy] = field(default_factory=list)

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

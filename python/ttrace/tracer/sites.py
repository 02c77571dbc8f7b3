"""Functional attention sites: ``scaled_dot_product_attention`` calls seen by one
``TorchFunctionMode`` per thread, shared by every attached tracer and recorded by the tracers
whose modules run them, with the registry op each call computes; functional cross-entropy as
loss sites."""

from __future__ import annotations

import functools
import math
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

if TYPE_CHECKING:
    from .core import Tracer

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
            if func is torch.nn.functional.cross_entropy and self.state.tracers:
                return _loss_call(func, self.state.recipients(), *args, **kwargs)
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

def _loss_call(func: Callable[..., Any], tracers: List["Tracer"], /, *args: Any,
               **kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` called through each tracer's loss site in turn."""
    if not tracers:
        return func(*args, **kwargs)
    inner = functools.partial(_loss_call, func, tracers[1:])
    return tracers[0]._loss_site(inner, args, kwargs)

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

_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                "enable_gqa")

def _site_op(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
    """The registry op a ``scaled_dot_product_attention`` call computes, where ttrace prices
    it through the op (``attention`` or ``attention:causal``: no mask, no dropout, the default
    scale 1/sqrt(head dimension)); ``None`` otherwise."""
    p: Dict[str, Any] = dict(zip(_SDPA_PARAMS, args))
    p.update(kwargs)
    q = p.get("query")
    if not isinstance(q, torch.Tensor) or q.dim() < 2 or q.shape[-1] == 0:
        return None
    if p.get("attn_mask") is not None or p.get("dropout_p", 0.0):
        return None
    scale = p.get("scale")
    if scale is not None and abs(float(scale) * math.sqrt(q.shape[-1]) - 1.0) > 1e-6:
        return None
    return "attention:causal" if p.get("is_causal", False) else "attention"

_CE_PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
              "label_smoothing")

def _loss_op(args: Tuple[Any, ...], kwargs: Dict[str, Any], classes: int) -> Optional[str]:
    """The registry op a ``cross_entropy`` call computes, where ttrace prices it through the op
    (``cross_entropy``: the mean over the rows, no class weights, no label smoothing, the
    left-out rows' ``ignore_index`` outside the classes); ``None`` otherwise."""
    p: Dict[str, Any] = dict(zip(_CE_PARAMS, args))
    p.update(kwargs)
    if classes > 2 ** 24:
        return None  # class indices beyond 2^24 are not exact as the float32 targets stored
    if p.get("weight") is not None or p.get("label_smoothing", 0.0):
        return None
    if p.get("size_average") is not None or p.get("reduce") is not None:
        return None
    if p.get("reduction", "mean") != "mean":
        return None
    ignore = p.get("ignore_index", -100)
    if 0 <= int(ignore) < classes:
        return None
    return "cross_entropy"


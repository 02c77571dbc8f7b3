"""What a tracer records — the one place that says it.

* **Modules** (``modules=``): by default every leaf module (one without children) and every
  attention core (a parameter-free module named attention, whose inner modules would not show
  the attention as one op) and every grouped-experts module (a module named experts holding
  its experts' weights stacked in 3-D parameters — transformers' ``MixtralExperts``,
  torchtitan's ``GroupedExperts`` — traced whole, its children not: under expert parallelism
  they see the tokens dispatched to this rank's experts) and the module that routes tokens to
  it (its parent: dispatch, experts and combine); or the modules named by a list of
  names and ``fnmatch`` patterns
  (each must match at least one module); or those a predicate ``(name, module) -> bool``
  accepts. The root module is never traced as such.
* **Functional sites** (``sites=``): each ``scaled_dot_product_attention`` call inside a
  traced step, as ``{module}.sdpa`` of the module that makes it (default: on when
  ``modules`` is not given); with ``losses=True`` each ``cross_entropy`` call on 2-D logits,
  as ``{module}.cross_entropy``.
* **Roles** of each traced module's tensors: forward inputs and outputs, the gradients
  arriving at its outputs and leaving at its inputs, and its parameters' gradients (read when
  the step ends); floating-point tensors only.
* **Steps** (``every=N``): one step in N (the hooks are attached only then).
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Dict, List, Sequence, Union

import torch

from ..errors import InvalidInputError
from .kinds import _is_attention_core

#: Which modules a tracer records: names and patterns, a predicate, or ``None`` (the default).
ModuleSelector = Union[Sequence[str], Callable[[str, torch.nn.Module], bool], None]


def select_modules(named: Dict[str, torch.nn.Module], modules: ModuleSelector) -> List[str]:
    """The names of the modules of ``named`` (the model's modules by name) that ``modules``
    selects, in the model's order."""
    if modules is None:
        # Grouped experts are traced whole: their children see the tokens dispatched to this
        # rank's experts, which no other run holds in that order.
        grouped = [n for n, m in named.items() if n and _is_grouped_experts(m)]
        inside = tuple(g + "." for g in grouped)
        # And the module routing tokens to them (dispatch, experts, combine: torchtitan's
        # RoutedExperts, transformers' sparse MoE block), where a routing bug is born.
        routing = {n.rpartition(".")[0] for n in grouped if "." in n}
        return [n for n, m in named.items()
                if n and not n.startswith(inside)
                and (not any(True for _ in m.children()) or _is_attention_core(m)
                     or n in grouped or n in routing)]
    if callable(modules):
        return [n for n, m in named.items() if n and modules(n, m)]
    names: List[str] = []
    for pattern in modules:
        hits = [n for n in named if n and fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise InvalidInputError(f"no module named {pattern!r} in the model", "UnknownName")
        names.extend(h for h in hits if h not in names)
    return names


def _is_grouped_experts(module: torch.nn.Module) -> bool:
    """A module holding every expert of a mixture-of-experts layer stacked in its parameters
    (transformers' ``MixtralExperts``, torchtitan's ``GroupedExperts``): its class name says
    experts and it holds a parameter of three or more dimensions (experts × rows × columns)."""
    return "Experts" in type(module).__name__ and any(
        p.dim() >= 3 for p in module.parameters(recurse=False))


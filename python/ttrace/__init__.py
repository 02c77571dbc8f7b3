"""ttrace: tell floating-point round-off apart from real bugs.

Compare a distributed (sharded) training run with a single-device reference and learn, per
tensor, whether the difference is round-off or a bug — and where the bug was born.

* Trace a training step on every rank: :class:`Tracer` (needs torch).
* Check two traces: :func:`check` returns a :class:`CheckReport`
  (also ``python -m ttrace check REFERENCE CANDIDATE``); two summary traces
  (``Tracer(..., summaries=True)``): :func:`check_summaries`.
* Price one op's tolerance: :func:`threshold` for any op of the registry
  (:func:`ttrace.thresholds.ops`), or :func:`matmul_threshold`, :func:`linear_threshold`,
  :func:`sum_threshold`, :func:`softmax_threshold`, :func:`norm_threshold`,
  :func:`elementwise_threshold`, :func:`allreduce_threshold`, :func:`cross_entropy_threshold`.
* In tests: :func:`ttrace.testing.assert_close`, a drop-in for
  ``torch.testing.assert_close`` whose tolerance is priced from the op and its arithmetic.

Importing ttrace does not import torch and changes no process-wide state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import errors
from ._ttrace import __version__
from .errors import (
    DistributedCheckError,
    InternalError,
    InvalidInputError,
    NoFiniteBoundError,
    TraceError,
    TtraceError,
    UnsupportedLayoutError,
)
from .report import CheckReport, TensorRow, check, load, load_all
from .summaries import SummaryReport, check_summaries
from .thresholds import (
    Threshold,
    Verdict,
    allreduce_threshold,
    cross_entropy_threshold,
    elementwise_threshold,
    linear_threshold,
    matmul_threshold,
    norm_threshold,
    parse_policy,
    softmax_threshold,
    sum_threshold,
    threshold,
)

__all__ = [
    "__version__",
    "CheckReport",
    "Mesh",
    "ModuleLayout",
    "SummaryReport",
    "TensorRow",
    "Threshold",
    "Tracer",
    "Verdict",
    "allreduce_threshold",
    "cross_entropy_threshold",
    "check",
    "check_summaries",
    "elementwise_threshold",
    "errors",
    "linear_threshold",
    "load",
    "load_all",
    "matmul_threshold",
    "norm_threshold",
    "parse_policy",
    "softmax_threshold",
    "sum_threshold",
    "threshold",
    "TtraceError",
    "InvalidInputError",
    "TraceError",
    "NoFiniteBoundError",
    "UnsupportedLayoutError",
    "DistributedCheckError",
    "InternalError",
]


if TYPE_CHECKING:  # the lazily imported names, typed for type checkers
    from .tracer import Mesh as Mesh
    from .tracer import ModuleLayout as ModuleLayout
    from .tracer import Tracer as Tracer

_LAZY = ("Tracer", "Mesh", "ModuleLayout")


def __getattr__(name: str) -> Any:
    # The tracer needs torch: imported on first use, so `import ttrace` stays light.
    if name in _LAZY:
        from . import tracer

        return getattr(tracer, name)
    raise AttributeError(f"module 'ttrace' has no attribute {name!r}")

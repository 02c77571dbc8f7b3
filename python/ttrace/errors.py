"""The exceptions ttrace raises.

Every error of the Rust core arrives as one of these classes, with the core's message and its
error variant in ``kind`` (for instance ``"ShapeMismatch"``); a Rust panic arrives as
:class:`InternalError` instead of crashing the interpreter.
"""

from __future__ import annotations

__all__ = [
    "TtraceError",
    "InvalidInputError",
    "TraceError",
    "NoFiniteBoundError",
    "UnsupportedLayoutError",
    "DistributedCheckError",
    "InternalError",
]


class TtraceError(Exception):
    """Base class of every ttrace error."""

    def __init__(self, message: str, kind: str = "Error") -> None:
        super().__init__(message)
        #: The Rust core's error variant (``"InvalidParameter"``, ``"File"``, ...).
        self.kind = kind


class InvalidInputError(TtraceError, ValueError):
    """An argument ttrace cannot use: a malformed policy, an unknown name, mismatched shapes,
    a value that is not representable in its declared format."""


class TraceError(TtraceError):
    """A trace directory that cannot be read or merged: a missing or malformed file or
    manifest, shards that do not fit their declared layout, replicas that disagree."""


class NoFiniteBoundError(TtraceError, ArithmeticError):
    """No finite threshold exists: a rounding may overflow, or the op may lose every digit."""


class UnsupportedLayoutError(TtraceError, ValueError):
    """A tensor's parallel layout (a DTensor placement, a mesh) that the trace format cannot
    express; the message names the tensor and the placement."""


class DistributedCheckError(TtraceError, RuntimeError):
    """A check shared among ``torch.distributed`` ranks that could not finish: a checker rank
    died, or did not answer within the timeout. Every surviving rank raises it; nothing is
    reported."""


class InternalError(TtraceError, RuntimeError):
    """A bug in ttrace (a Rust panic caught at the boundary). Please report it."""

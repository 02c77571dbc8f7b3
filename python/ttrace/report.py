"""Checking a candidate trace directory against a reference one."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Union

import numpy as np

from . import _ttrace
from .errors import InvalidInputError

__all__ = ["CheckReport", "TensorRow", "check", "load", "load_all"]

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class TensorRow:
    """One tensor's verdict."""

    #: Canonical id, ``module|role.index`` (``layers.0.mlp.fc1|fwd.output.0``).
    id: str
    #: Elements of the logical (merged) tensor.
    elements: int
    #: ‖candidate − reference‖_F / ‖reference‖_F in units of ε of the training dtype.
    error_eps: float
    #: The threshold in units of ε.
    threshold_eps: float
    #: error / threshold.
    ratio: float
    #: The largest |candidate − reference|.
    max_abs: float
    #: Within the threshold, and no test beyond the norm fired.
    passed: bool
    #: The tests that fired: ``"norm"`` (the error beyond the threshold), ``"scale"``,
    #: ``"bias"``, ``"sparse"`` (papers/checking.md §7).
    fired: List[str]
    #: Every test beyond the norm that applied: ``{"detector", "estimate", "threshold",
    #: "ratio", "fired", "at", "count"}`` with estimate and threshold in units of ε.
    findings: List[Dict[str, Any]]
    #: How the threshold was priced (a rule of the core, e.g. ``local``, ``carried``).
    pricing: str
    #: Why the tensor could not be compared, if so.
    problem: Optional[str]


@dataclass(frozen=True)
class CheckReport:
    """The result of :func:`check`. ``str(report)`` is the table ``ttrace check`` prints."""

    #: No tensor failed.
    passed: bool
    #: Tensors that failed.
    failures: int
    #: The first failing tensor in execution order.
    first_failure: Optional[str]
    #: The unit of the ``*_eps`` fields (machine epsilon of the training dtype).
    eps: float
    #: Every tensor, in execution order.
    rows: List[TensorRow]
    #: Where the first failure was born: module, kind, pass, tensor, detail (or None).
    localization: Optional[Dict[str, Any]]
    #: Tensors judged by each pricing rule, by the rule's description.
    pricing_counts: Dict[str, int]
    #: Where untraced code made a tensor a traced module consumes: ``{"after", "before",
    #: "tensor"}`` (the modules on either side), in execution order.
    untraced_gaps: List[Dict[str, Any]]
    #: Layouts the tracer could only guess, as the checker inferred them from the shapes:
    #: tensor id → layout (``{"dp": …, "cp": …, "tp": …}``).
    inferred_layouts: Dict[str, Dict[str, Any]]
    #: The arithmetic the traces recorded and the checker priced, per run: ``{"reference":
    #: {"autocast=f16": 18}, "candidate": {"fp32_matmul=tf32": 20}}`` (tensors per setting).
    arithmetic: Dict[str, Dict[str, int]]
    #: How the candidate's data-parallel ranks normalized their loss, where the tracer did not
    #: know and the checker settled it from the reference: ``{"local_mean", "dp", "cp",
    #: "microbatches", "divisor", "tensors", "error_local", "error_global", "error_chosen"}``
    #: (``local_mean``: each rank averaged over its own share of the batch's tokens, or each
    #: microbatch's loss was its own mean, so activation gradients were read divided by
    #: ``divisor`` — dp·cp, dp or cp, times the microbatches where each was its own mean;
    #: ``error_local`` at dp·cp·microbatches, ``error_global`` as stored, ``error_chosen`` at
    #: the divisor taken), else None.
    loss_normalization: Optional[Dict[str, Any]]
    #: The text of the report (``str(report)``).
    text: str
    #: The core's report, as JSON-ready data.
    raw: Dict[str, Any]

    def __str__(self) -> str:
        return self.text

    def __bool__(self) -> bool:
        return self.passed

    @property
    def failed_rows(self) -> List[TensorRow]:
        """The failing tensors, in execution order."""
        return [r for r in self.rows if not r.passed]

    def to_dict(self) -> Dict[str, Any]:
        """The report as plain data (what :meth:`to_json` writes)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("raw", "text")}
        return d

    def to_json(self, **kwargs: Any) -> str:
        """The report as JSON (keyword arguments go to :func:`json.dumps`)."""
        return json.dumps(self.to_dict(), **kwargs)


def _num(x: Any, missing: float) -> float:
    # JSON has no infinity or NaN: the core writes null for them.
    return float(x) if x is not None else missing


def _pricing_name(p: Any) -> str:
    if isinstance(p, str):
        return p
    if isinstance(p, dict) and len(p) == 1:
        return next(iter(p))
    return str(p)


def _fired(v: Dict[str, Any]) -> List[str]:
    ratio = v["ratio"]
    norm = v.get("problem") is None and int(v["nonfinite_mismatches"]) == 0 and (
        ratio is None or float(ratio) > 1.0)
    others = [str(f["detector"]) for f in v.get("findings", []) if f["fired"]]
    return (["norm"] if norm else []) + others


def _arithmetic(entries: List[Any]) -> Dict[str, Dict[str, int]]:
    out: Dict[str, Dict[str, int]] = {}
    for side, setting, n in entries:
        out.setdefault(str(side), {})[str(setting)] = int(n)
    return out


def check(reference: PathLike, candidate: PathLike, *, pricing: str = "auto",
          group: Any = None, timeout: Optional[float] = None) -> CheckReport:
    """Compare the candidate trace directory with the reference one.

    ``pricing="auto"`` uses thresholds the reference's producer wrote into its manifest where
    present and prices the rest from the metadata and the data; ``"local"`` prices every
    tensor from the metadata and the data. Raises :class:`ttrace.TraceError` for directories
    that cannot be read or merged (a reference without tensors is an error, never a pass).

    With ``group`` (a ``torch.distributed`` process group, or
    ``torch.distributed.group.WORLD``), every rank of the group calls ``check`` with the same
    traces and reads only its share of the tensors (balanced by bytes); the shares are
    combined over gloo and every rank returns the same report, the one a single-machine check
    gives. An error on any rank is raised on every rank; a rank that dies or does not answer
    within ``timeout`` seconds (default: the group's own timeout for a gloo group, else
    30 minutes) makes the others raise :class:`ttrace.errors.DistributedCheckError`.

    Examples::

        # torchrun --nproc-per-node 8 check.py
        import torch.distributed as dist, ttrace
        dist.init_process_group("gloo")
        report = ttrace.check("traces/reference", "traces/candidate",
                              group=dist.group.WORLD)
        if dist.get_rank() == 0:
            print(report)
    """
    if group is None:
        if timeout is not None:
            raise InvalidInputError("timeout applies to a distributed check (group=) only",
                                    "InvalidParameter")
        raw_json, text = _ttrace.check_dirs(os.fspath(reference), os.fspath(candidate),
                                            pricing)
    else:
        from ._distributed import shared_check

        raw_json, text = shared_check(os.fspath(reference), os.fspath(candidate), pricing,
                                      group, timeout)
    return report_of(raw_json, text)


def report_of(raw_json: str, text: str) -> CheckReport:
    """The report of the core's JSON and text (what every check returns)."""
    raw = json.loads(raw_json)
    rep = raw["report"]
    eps = float(rep["eps"])
    rows = []
    for v, p in zip(rep["verdicts"], raw["pricing"]):
        rows.append(
            TensorRow(
                id=v["id"],
                elements=int(v["elements"]),
                error_eps=_num(v["rel_error_eps"], float("nan")),
                threshold_eps=_num(v["threshold"], float("inf")) / eps if eps else float("nan"),
                ratio=float(v["ratio"]) if v["ratio"] is not None else float("inf"),
                max_abs=float(v["max_abs"]) if v["max_abs"] is not None else float("nan"),
                passed=bool(v["passed"]),
                fired=_fired(v),
                findings=list(v.get("findings", [])),
                pricing=_pricing_name(p),
                problem=v.get("problem"),
            )
        )
    counts = {str(rule): int(n) for (_, n, rule) in raw["pricing_summary"]}
    return CheckReport(
        passed=int(rep["failures"]) == 0,
        failures=int(rep["failures"]),
        first_failure=rep.get("first_failure"),
        eps=eps,
        rows=rows,
        localization=raw.get("localization"),
        pricing_counts=counts,
        untraced_gaps=list(raw.get("untraced", [])),
        inferred_layouts={e["tensor"]: e["layout"] for e in raw.get("inferred", [])},
        arithmetic=_arithmetic(raw.get("arithmetic", [])),
        loss_normalization=raw.get("loss"),
        text=text,
        raw=raw,
    )


def load(trace: PathLike, tensor_id: str, *, reference: Optional[PathLike] = None) -> "np.ndarray":
    """The logical tensor ``tensor_id`` of a trace directory (its ranks' shards merged by
    their layouts), as float64. With ``reference``, layouts the tracer could only guess are
    inferred against that trace's shapes first, as :func:`check` does. Raises
    :class:`ttrace.TraceError` for a missing id or unreadable files."""
    return load_all(trace, [tensor_id], reference=reference)[tensor_id]


def load_all(trace: PathLike, ids: Optional[List[str]] = None, *,
             reference: Optional[PathLike] = None) -> Dict[str, "np.ndarray"]:
    """The logical tensors ``ids`` (default: all) of a trace directory, as :func:`load` reads
    one, in trace order — the directory opened (and its guessed layouts settled) once."""
    pairs = _ttrace.load_logical(os.fspath(trace), ids,
                                 None if reference is None else os.fspath(reference))
    return dict(pairs)

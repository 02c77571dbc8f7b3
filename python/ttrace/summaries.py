"""Comparing two summary traces (``Tracer(..., summaries=True)``): what per-tensor statistics
can prove about the difference of two runs (``papers/summaries.md``).

Per step both traces hold, each tensor's lower bound on ‖candidate − reference‖ is computed
from the statistics; a difference is *proven* when the bound exceeds the tensor's threshold (a
full check with that threshold would fail too), or when NaN/±∞ counts differ, or when a
replicated tensor's copies disagree. Summaries never prove agreement — a permutation of a
tensor's elements changes no statistic — so a report with nothing proven is not a pass: trace a
step in full and :func:`ttrace.check` it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from . import _ttrace

__all__ = ["SummaryReport", "check_summaries"]

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class SummaryReport:
    """The result of :func:`check_summaries`. ``str(report)`` is the text ``ttrace check``
    prints; ``bool(report)`` is False when a difference is proven — and True only in the
    sense "nothing proven", never "equal"."""

    #: Tensor-steps proven to differ.
    proven: int
    #: The first (step, tensor id) proven to differ.
    first_proven: Optional[Tuple[int, str]]
    #: Per step: ``{"step", "compared", "largest", "proven", "not_comparable"}`` (the
    #: bounds as ``{"id", "lower", "rel_lower", "by", "threshold", "proof"}``).
    steps: List[Dict[str, Any]]
    #: Steps only the reference holds, only the candidate holds.
    unmatched_steps: Tuple[int, int]
    #: What was left out of the traces and why (a torn last line, a step not every rank
    #: wrote).
    notes: List[str]
    #: The text of the report.
    text: str
    #: The core's report, as JSON-ready data.
    raw: Dict[str, Any]

    def __str__(self) -> str:
        return self.text

    def __bool__(self) -> bool:
        return self.proven == 0


def _thresholds(thresholds: Any) -> Tuple[Dict[str, float], Optional[str]]:
    """(per-id thresholds, the text of a check report) from what :func:`check_summaries`
    takes; a report is parsed by the Rust core, as the command line parses it."""
    if thresholds is None:
        return {}, None
    if isinstance(thresholds, Mapping):
        return {str(k): float(v) for k, v in thresholds.items()}, None
    raw = getattr(thresholds, "raw", None)  # a CheckReport
    if isinstance(raw, dict):
        return {}, json.dumps(raw)
    with open(os.fspath(thresholds), "rb") as f:
        data = f.read()
    try:
        return {}, data.decode("utf-8")
    except UnicodeDecodeError:
        from .errors import InvalidInputError

        raise InvalidInputError(f"{os.fspath(thresholds)}: not UTF-8 text",
                                "InvalidParameter") from None


def check_summaries(reference: PathLike, candidate: PathLike, *, rtol: Optional[float] = None,
                    thresholds: Any = None) -> SummaryReport:
    """Compare two summary traces step by step.

    ``rtol``: the relative threshold (on ‖c − r‖ / ‖r‖) for every tensor; ``thresholds``: per
    tensor, a :class:`~ttrace.CheckReport` of a full check of a traced step of the same runs,
    the path of its JSON report, or a mapping id → relative threshold (these win over
    ``rtol``). Without either, only non-finite counts and replicas can prove a difference; the
    lower bounds are reported all the same. Raises :class:`ttrace.TraceError` for unreadable
    summary files and :class:`ttrace.InvalidInputError` when no step or no tensor could be
    compared (never an empty report).
    """
    per_id, report = _thresholds(thresholds)
    raw_json, text = _ttrace.check_summaries(os.fspath(reference), os.fspath(candidate), rtol,
                                             per_id or None, report)
    raw = json.loads(raw_json)
    first = None
    for s in raw["steps"]:
        if s["proven"]:
            first = (int(s["step"]), str(s["proven"][0]["id"]))
            break
    return SummaryReport(
        proven=sum(len(s["proven"]) for s in raw["steps"]),
        first_proven=first,
        steps=list(raw["steps"]),
        unmatched_steps=(int(raw["unmatched_steps"][0]), int(raw["unmatched_steps"][1])),
        notes=list(raw["notes"]),
        text=text,
        raw=raw,
    )

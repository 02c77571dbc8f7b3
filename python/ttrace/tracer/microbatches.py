"""Microbatches folded into the calls a reference without them makes.

A pipeline schedule (or a gradient-accumulation loop) runs each module once per microbatch:
the tracer records ``name``, ``name#1``, …, ``name#{M·c − 1}`` for a module called ``c`` times
per microbatch, microbatch by microbatch (every schedule runs a stage's forwards in microbatch
order). The reference ran the whole batch at once: call ``j`` of each microbatch is one slice
of its call ``j``. :func:`fold` concatenates them along the batch dimension, in microbatch
order — an exact operation — so each folded tensor is what the reference's call would hold
if the batch had been computed the way the candidate computed it. Parameter gradients are
read once, accumulated over the microbatches, and left alone (the trace's ``pipeline`` tells
the checker how many partial sums they add).
"""

from __future__ import annotations

from typing import Dict, List, Tuple, cast

import torch

from .._copies import HostCopy
from ..errors import InvalidInputError, UnsupportedLayoutError
from .record import _StepRecord


def _split(tid: str) -> Tuple[str, int, str]:
    """``(module, call, rest)`` of a recorded id ``module#call|role.i`` (call 0 without ``#``)."""
    name, rest = tid.split("|", 1)
    base, _, k = name.partition("#")
    return base, int(k) if k else 0, rest


def fold(order: List[str], record: _StepRecord, microbatches: int, dim: int,
         skip: bool, skipped: List[Tuple[str, str]]) -> List[str]:
    """The step's ids with each module's per-microbatch calls concatenated along ``dim`` (see
    the module docs): ``record.records`` and ``record.meta`` are updated in place, and the
    new order returned (a folded id where its first microbatch's was). A module whose calls
    are not a multiple of ``microbatches`` is an error (a schedule that skipped one — or
    ran a microbatch twice); so are calls whose layouts or shapes (but along ``dim``) differ.
    A tensor without the batch dimension (a scalar) cannot be concatenated: refused, or left
    out with ``skip`` (listed in ``skipped``)."""
    if microbatches == 1:
        return order
    groups: Dict[Tuple[str, str], List[Tuple[int, str]]] = {}
    for tid in order:
        if tid.endswith("|param_grad"):
            continue
        base, call, rest = _split(tid)
        groups.setdefault((base, rest), []).append((call, tid))
    folded: Dict[str, str] = {}
    made: Dict[Tuple[int, ...], HostCopy] = {}
    for (base, rest), calls in groups.items():
        calls.sort()
        n = len(calls)
        if n % microbatches or [c for c, _ in calls] != list(range(n)):
            raise InvalidInputError(
                f"module {base!r} ran {n} times ({base}|{rest}) in a step of {microbatches} "
                "microbatches: not the same number of calls in each (a microbatch skipped or "
                "run twice?)", "InvalidParameter")
        per = n // microbatches
        for j in range(per):
            members = [calls[m * per + j][1] for m in range(microbatches)]
            new = f"{base}|{rest}" if j == 0 else f"{base}#{j}|{rest}"
            copies = [cast(HostCopy, record.records[t]) for t in members]
            metas = [record.meta[t] for t in members]
            why = _unfoldable(copies, metas, dim)
            if why is not None:
                message = f"tensor {new!r}: its {microbatches} microbatches {why}"
                if not skip:
                    raise UnsupportedLayoutError(message, "Layout")
                skipped.append((new, message))
                for t in members:
                    folded[t] = ""
                continue
            key = tuple(id(c) for c in copies)
            copy = made.get(key)
            if copy is None:
                copy = made[key] = HostCopy(torch.cat([c.wait() for c in copies], dim))
                # What the members' sharing by identity must still be verified against.
                record.folded.extend(c for c in copies if c.checks)
            for t in members:
                folded[t] = new
                record.records.pop(t, None)
            record.records[new] = copy
            record.meta[new] = metas[0]
    out, seen = [], set()
    for tid in order:
        new = folded.get(tid, tid)
        if new and new not in seen:
            seen.add(new)
            out.append(new)
    return out


def _unfoldable(copies: List[HostCopy], metas: List[dict], dim: int) -> "str | None":
    """Why the members cannot be concatenated along ``dim``, or None."""
    shapes = [tuple(c.shape) for c in copies]
    if len(shapes[0]) <= dim:
        return f"have no dimension {dim} to be concatenated along (shape {list(shapes[0])})"
    cut = [s[:dim] + s[dim + 1:] for s in shapes]
    if any(c != cut[0] for c in cut) or any(c.dtype != copies[0].dtype for c in copies):
        return f"do not have one shape but along dimension {dim} ({[list(s) for s in shapes]})"
    if any(m["layout"] != metas[0]["layout"] for m in metas):
        return "have different layouts"
    return None

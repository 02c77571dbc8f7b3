"""``assert_close`` for tests, with a tolerance priced from what is compared.

``torch.testing.assert_close`` judges every comparison with fixed per-dtype tolerances
(BF16: rtol 1.6e-2, atol 1e-5). Those are loose for a short FP32-accumulated reduction and
too tight for a long one, and they know nothing of the order of operations. Here the
tolerance is the threshold of the op that produced the tensors, computed from its inputs and
from the arithmetic on each side — the same thresholds ``ttrace check`` uses::

    from ttrace.testing import assert_close

    y_ref = torch.nn.functional.linear(x, w)              # one device
    y_tp = row_parallel_linear(x, w)                      # your sharded kernel, 2 ranks
    assert_close(y_tp, y_ref, op="linear", inputs=(x, w),
                 candidate="in=bf16,acc=f32,out=bf16,order=splitk:2:bf16:ring")

When to use which:

* ``assert_close``: a unit test of one op or kernel whose inputs you hold (a sharded linear,
  a fused softmax, a custom all-reduce), compared with a reference computation of the same op.
* Trace checking (:class:`ttrace.Tracer` + :func:`ttrace.check`): a whole training step of a
  parallelized model, where inputs of later modules already differ and a failure must be
  localized to the module (or the code between modules) that caused it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

import numpy as np

from . import thresholds as _th
from ._arrays import as_core, as_float64
from .errors import InvalidInputError

if TYPE_CHECKING:
    from .tracer.placements import ModuleLayout

__all__ = ["assert_close", "copy_sharded", "seed_everything", "threshold_for"]

def _default_policy(x: Any) -> str:
    fmt = as_core(x)[1]
    acc = "f64" if fmt == "f64" else "f32"
    out = "f32" if fmt in ("e4m3", "e5m2") else fmt
    return f"in={fmt},acc={acc},out={out}"


def threshold_for(
    op: str,
    inputs: Sequence[Any],
    *,
    reference: str,
    candidate: Optional[str] = None,
    delta: float = 1e-6,
    guaranteed: bool = False,
    **options: Any,
) -> "_th.Threshold":
    """The threshold of ``op`` on ``inputs`` (see :func:`assert_close` for the ops), through
    the library's op registry (:func:`ttrace.thresholds.threshold`)."""
    known = {"reference_form", "candidate_form", "reference_variance", "candidate_variance",
             "eps", "pricing"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"threshold_for() got unexpected options {', '.join(unknown)}")

    def side(policy: str, who: str) -> str:
        return _th._with(policy, **{k: str(options[f"{who}_{k}"]) for k in ("form", "variance")
                                    if f"{who}_{k}" in options})

    cand = candidate if candidate is not None else reference
    return _th.threshold(
        op, inputs, reference=side(reference, "reference"), candidate=side(cand, "candidate"),
        delta=delta, guaranteed=guaranteed, pricing=str(options.get("pricing", "auto")),
        eps=float(options.get("eps", 1e-5)),
    )


def assert_close(
    actual: Any,
    expected: Any,
    *,
    op: str,
    inputs: Sequence[Any],
    reference: Optional[str] = None,
    candidate: Optional[str] = None,
    delta: float = 1e-6,
    guaranteed: bool = False,
    name: str = "tensor",
    **options: Any,
) -> "_th.Verdict":
    """Assert that ``actual`` (the candidate's result) differs from ``expected`` (the
    reference's) by no more than round-off of ``op`` on ``inputs``.

    ``op``: ``matmul`` (inputs ``(a, b[, bias])``), ``linear`` (``(x, weight[, bias])`` as
    ``torch.nn.functional.linear``), ``sum`` / ``mean`` (last dimension), ``softmax``
    (``reference_form`` / ``candidate_form`` = ``standard`` or ``online:B``), ``layernorm`` /
    ``rmsnorm`` (``(x, weight[, bias])``, ``eps``, ``reference_variance`` /
    ``candidate_variance``), ``add`` (``(x, y)``), ``scale:C``, ``gelu``, ``silu``, ``exp``,
    ``allreduce`` (inputs = the ranks' partial tensors), ``cross_entropy`` (``(logits,
    target)``, integer targets, PyTorch's mean over rows whose target is not -100: the scalar
    loss) and ``cross_entropy_grad`` (the same inputs: the loss's gradient in the logits).

    ``reference`` / ``candidate``: the arithmetic of each side as policy text (see
    :mod:`ttrace.thresholds`). The reference defaults to the inputs' dtype with FP32
    accumulation (``in=bf16,acc=f32,out=bf16`` for BF16 inputs); the candidate defaults to
    the reference — then only a bit-identical result passes. What GPUs run: ``in=tf32`` for
    TF32 matmuls, ``order=any`` on both sides for a vendor kernel of unknown order,
    ``order=hopper-fp8-fast`` for FP8 ``torch._scaled_mm`` on Hopper.

    ``delta``: the false-alarm probability of the threshold under the random-rounding model;
    ``guaranteed=True`` uses the worst-case bound instead.

    Raises ``AssertionError`` naming the tensor, the error and the threshold in ε, and the
    worst element; returns the :class:`ttrace.Verdict` otherwise.
    """
    ref = reference if reference is not None else _default_policy(inputs[0])
    t = threshold_for(
        op, inputs, reference=ref, candidate=candidate, delta=delta, guaranteed=guaranteed,
        **options,
    )
    a64 = as_float64(actual, "actual")
    e64 = as_float64(expected, "expected")
    if a64.shape != e64.shape:
        raise AssertionError(
            f"{name}: shapes differ: actual {tuple(a64.shape)}, expected {tuple(e64.shape)}"
        )
    v = t.check(expected, actual)
    if v.passed:
        return v
    if v.problem is not None:
        raise AssertionError(f"{name}: not judged: {v.problem}")
    diff = np.abs(a64 - e64)
    nan_mismatch = np.isnan(a64) != np.isnan(e64)
    if nan_mismatch.any():
        worst = np.unravel_index(int(np.argmax(nan_mismatch)), a64.shape)
    else:
        worst = np.unravel_index(int(np.nanargmax(diff)) if diff.size else 0, a64.shape)
    conf = "guaranteed" if t.delta is None else f"probabilistic, delta={t.delta:g}"
    eps = v.rel_error / v.rel_error_eps if v.rel_error_eps else float("nan")
    fired = v.fired
    lines = [
        f"{name}: the difference is larger than round-off of {op} can explain"
        + (f" (fired: {', '.join(fired)})" if fired else ""),
        f"  error     {v.rel_error_eps:.4g} eps  (||actual - expected||_F / ||expected||_F = "
        f"{v.rel_error:.4e})",
        f"  threshold {v.threshold / eps if eps == eps and eps else float('nan'):.4g} eps  "
        f"({conf}; norm ratio {v.ratio:.3g})",
    ]
    # A test beyond the norm has its own statistic: say which fired and by how much.
    for f in v.details.get("findings", []):
        if f.get("fired"):
            lines.append(
                f"  {f['detector']} test: statistic {float(f['estimate']):.4g} eps against its "
                f"threshold {float(f['threshold']):.4g} eps (ratio {float(f['ratio']):.3g})"
            )
    lines += [
        f"  worst element at index {tuple(int(i) for i in worst)}: actual {a64[worst]!r}, "
        f"expected {e64[worst]!r}, |diff| {diff[worst]!r}",
        f"  reference: {t.reference}",
        f"  candidate: {t.candidate}",
    ]
    if candidate is None or t.reference == t.candidate:
        lines.append(
            "  (the candidate's arithmetic is the reference's, so only a bit-identical result "
            "passes: pass candidate= the arithmetic that ran, e.g. its order, or order=any "
            "for a kernel of unknown order)"
        )
    if v.nonfinite_mismatches:
        lines.insert(1, f"  {v.nonfinite_mismatches} elements are NaN or infinite on one side only")
    raise AssertionError("\n".join(lines))


# --- building a sharded model beside its reference ----------------------------------------------

def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators alike in the reference and sharded runs.
    (This sets process-wide generator state, as any seeding does; it is never called on
    import.)"""
    import random

    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _shard(t: Any, placement: Any, rank: int, parts: int) -> Any:
    """Rank ``rank``'s part of ``t`` under a :class:`~ttrace.tracer.placements.Placement`."""
    if not placement.is_split:
        return t
    dim = placement.dim % t.dim()
    groups = placement.groups
    n = t.shape[dim]
    if n % (groups * parts):
        raise InvalidInputError(
            f"dimension {dim} of length {n} does not split into {groups}x{parts}",
            "InvalidParameter",
        )
    view = t.reshape(*t.shape[:dim], groups, parts, n // (groups * parts), *t.shape[dim + 1:])
    return view.select(dim + 1, rank).reshape(*t.shape[:dim], n // parts, *t.shape[dim + 1:])


def copy_sharded(reference: Any, sharded: Any, layouts: Dict[str, ModuleLayout], tp_rank: int,
                 tp: int, skip: Sequence[str] = ()) -> None:
    """Copy every parameter of the module ``reference`` into ``sharded`` (same module names),
    taking rank ``tp_rank``'s slice of the parameters the layouts declare split. Shapes must
    match; parameters named in ``skip`` are left alone."""
    import torch

    from .tracer.placements import replicate

    with torch.no_grad():
        ref = dict(reference.named_parameters())
        for name, p in sharded.named_parameters():
            if name in skip:
                continue
            if name not in ref:
                raise InvalidInputError(
                    f"parameter {name!r} of the sharded model is not in the reference",
                    "UnknownName",
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

"""Per-op thresholds: how far a candidate's result may lie from the reference's by round-off.

Each function prices "the reference's arithmetic against the candidate's" for one op on the
given inputs, and returns a :class:`Threshold` on ‖candidate − reference‖_F. The arithmetic is
a policy text, the grammar of the ``ttrace`` CLI and of the Rust ``Policy``::

    in=bf16,acc=f32,out=bf16                       # BF16 in and out, FP32 accumulation
    in=bf16,acc=f32,out=bf16,order=splitk:2:bf16:ring   # + split over 2 ranks, BF16 partials
                                                   #   combined in ring order

A *probabilistic* threshold (the default, failure probability ``delta`` = 1e-6 under the
random-rounding model) is far tighter than the *guaranteed* one (``guaranteed=True``), which
holds for every input and every rounding. Every probabilistic threshold is checked against
the two declared executions, which ttrace's engine runs (for an order that is a family, such
as ``order=any``, every member): where their difference contradicts the model (at
delta = 1e-3), the guaranteed threshold is returned and its ``delta`` is ``None``.
Derivations: ``papers/`` in the repository.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _ttrace
from ._arrays import as_core
from .errors import InvalidInputError

__all__ = [
    "Threshold",
    "Verdict",
    "parse_policy",
    "ops",
    "threshold",
    "matmul_threshold",
    "linear_threshold",
    "sum_threshold",
    "softmax_threshold",
    "norm_threshold",
    "elementwise_threshold",
    "allreduce_threshold",
    "cross_entropy_threshold",
]


def parse_policy(text: str) -> str:
    """Parse and validate a policy text; returns its canonical form.

    >>> parse_policy("in=bf16, acc=f32, out=bf16")
    'in=bf16,acc=f32,out=bf16,order=sequential'
    """
    return _ttrace.parse_policy(text)


@dataclass(frozen=True)
class Verdict:
    """The verdict on one pair of tensors."""

    #: Within the threshold, with no non-finite mismatch, and no test beyond the norm (scale,
    #: bias, sparse) fired.
    passed: bool
    #: ‖candidate − reference‖_F / ‖reference‖_F.
    rel_error: float
    #: ``rel_error`` in units of ε of the tensor's format.
    rel_error_eps: float
    #: The relative threshold.
    threshold: float
    #: ``rel_error / threshold``.
    ratio: float
    #: The largest |candidate − reference|.
    max_abs: float
    #: The largest distance in units in the last place of the format.
    max_ulp: int
    #: Elements where exactly one side is NaN or ±∞ (or they differ).
    nonfinite_mismatches: int
    #: Elements compared.
    elements: int
    #: Everything the core reported.
    details: Dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    #: Why the pair could not be judged (shapes that differ, tensors of another size than the
    #: threshold was priced for, no element at all); such a verdict never passes.
    problem: Optional[str] = None

    @property
    def fired(self) -> List[str]:
        """The tests that fired: ``"norm"`` (beyond the threshold), ``"scale"``, ``"bias"``,
        ``"sparse"``."""
        norm = self.problem is None and self.nonfinite_mismatches == 0 and self.ratio > 1.0
        others = [str(f["detector"]) for f in self.details.get("findings", []) if f["fired"]]
        return (["norm"] if norm else []) + others

    @classmethod
    def _from_core(cls, d: Dict[str, Any]) -> "Verdict":
        # The core writes values that are not numbers (a pair that was not judged) as None.
        def num(key: str, missing: float = float("nan")) -> float:
            return float(d[key]) if d[key] is not None else missing

        return cls(
            passed=bool(d["passed"]),
            rel_error=num("rel_error"),
            rel_error_eps=num("rel_error_eps"),
            threshold=num("threshold"),
            ratio=num("ratio", float("inf")),
            max_abs=num("max_abs"),
            max_ulp=int(d["max_ulp"]),
            nonfinite_mismatches=int(d["nonfinite_mismatches"]),
            elements=int(d["elements"]),
            details=d,
            problem=str(d["problem"]) if d.get("problem") is not None else None,
        )


class Threshold:
    """A threshold on ‖candidate − reference‖_F for one op (see the module docs)."""

    def __init__(self, core: Any, op: str, reference: str, candidate: str) -> None:
        self._core = core
        #: The op priced.
        self.op = op
        #: The reference's and the candidate's policy texts (canonical).
        self.reference = reference
        self.candidate = candidate

    @property
    def abs_frobenius(self) -> float:
        """The threshold on ‖candidate − reference‖_F."""
        return self._core.abs_frobenius

    @property
    def relative(self) -> float:
        """``abs_frobenius / ‖reference‖_F``."""
        return self._core.relative

    @property
    def per_element(self) -> float:
        """A bound on any one element's difference."""
        return self._core.per_element

    @property
    def guaranteed_relative(self) -> float:
        """The worst-case relative difference (holds for every rounding)."""
        return self._core.guaranteed_relative

    @property
    def expected_relative(self) -> float:
        """The expected (root-mean-square) relative difference under the rounding model.

        NaN for a guaranteed threshold of a product or sum priced without the model (by two
        GEMMs of the operands' magnitudes, as the default pricing does): it needs none.
        """
        return self._core.expected_relative

    @property
    def delta(self) -> Optional[float]:
        """The failure probability, or ``None`` for a guaranteed threshold."""
        return self._core.delta

    @property
    def elements(self) -> int:
        """Elements of the op's result."""
        return self._core.elements

    @property
    def reference_norm(self) -> float:
        """‖reference‖_F of the exact result the threshold is relative to."""
        return self._core.reference_norm

    @property
    def identical(self) -> bool:
        """Both sides compute bit-identical results: any difference is a bug."""
        return self._core.identical

    def check(self, reference: Any, candidate: Any) -> Verdict:
        """Judge a pair of results (torch tensors or NumPy arrays of the same shape). Results
        of another size than the op's on the priced inputs (:attr:`elements`), or of none, are
        not judged: the verdict fails and says why (:attr:`Verdict.problem`)."""
        r, rf = as_core(reference, "reference")
        c, cf = as_core(candidate, "candidate")
        return Verdict._from_core(self._core.check(r, rf, c, cf))

    def to_dict(self) -> Dict[str, Any]:
        """Every field of the core's threshold."""
        d = dict(self._core.to_dict())
        d.update(op=self.op, reference_policy=self.reference, candidate_policy=self.candidate)
        return d

    def __repr__(self) -> str:
        kind = "guaranteed" if self.delta is None else f"delta={self.delta:g}"
        return (
            f"Threshold(op={self.op!r}, relative={self.relative:.3e}, "
            f"abs_frobenius={self.abs_frobenius:.3e}, {kind})"
        )


def _delta(delta: float, guaranteed: bool) -> Optional[float]:
    return None if guaranteed else float(delta)


def _policies(reference: str, candidate: Optional[str]) -> "tuple[str, str]":
    ref = _ttrace.parse_policy(reference, "reference")
    return ref, _ttrace.parse_policy(candidate, "candidate") if candidate is not None else ref


def _operands(names: Sequence[str], values: Sequence[Any]) -> List[Tuple[Any, str]]:
    return [as_core(v, n) for n, v in zip(names, values)]


def _with(policy: str, **keys: str) -> str:
    """A side's text: the policy with the op's algorithm keys (``form=``, ``variance=``)."""
    return ",".join([policy] + [f"{k}={v}" for k, v in keys.items()])


def ops() -> List[str]:
    """Every op :func:`threshold` prices (``scale:C`` stands for ``scale:`` and a number)."""
    return list(_ttrace.ops())


def threshold(
    op: str,
    inputs: Sequence[Any],
    *,
    reference: str,
    candidate: Optional[str] = None,
    delta: float = 1e-6,
    guaranteed: bool = False,
    pricing: str = "auto",
    eps: float = 1e-5,
) -> Threshold:
    """The threshold of any op (:func:`ops`) on its operands, in the op's order:

    ``matmul`` ``(a, b[, bias])``; ``linear`` ``(x, weight[, bias])`` as
    ``torch.nn.functional.linear``; ``sum`` / ``mean`` ``(x,)`` along the last dimension;
    ``allreduce`` (one partial tensor per rank); ``softmax`` ``(x,)``; ``layernorm``
    ``(x, weight[, bias])``; ``rmsnorm`` ``(x, weight)``; ``add`` ``(x, y)``; ``scale:C``,
    ``gelu``, ``silu``, ``exp`` ``(x,)``; ``cross_entropy`` and ``cross_entropy_grad``
    ``(logits, target)``, integer targets (:func:`cross_entropy_threshold`); ``attention``
    and ``attention:causal`` ``(q, k, v)``, one head's ``softmax(q·kᵀ/√d)·v`` (q [m, d],
    k [n, d], v [n, dv]; causal: torch's ``is_causal``), each side in its ``form``.

    ``reference`` / ``candidate`` (default: the reference) are policy texts with two more
    keys the policy does not hold: ``form=standard|online:B`` (softmax, attention) and
    ``variance=twopass|welford|onepass`` (LayerNorm). ``eps``: the normalizations' ε;
    ``pricing`` as for :func:`matmul_threshold` (``matmul``, ``linear``, ``sum``, ``mean``);
    for ``layernorm`` and ``rmsnorm``, ``"fast"`` prices each side's sums by the all-random
    model compiled for the row length (about half the walk's time; the walk where the
    engine's executions do not fit it, and for near-constant rows) and ``"auto"`` takes it
    for probabilistic thresholds from 65,536 elements in rows of at least 256. Every op goes
    through the library's one op registry, as ``ttrace threshold OP`` does.
    """
    if op in ("cross_entropy", "cross_entropy_grad") and len(inputs) == 2:
        # Integer targets, and PyTorch's ignore_index rows, as cross_entropy_threshold takes
        # them.
        return cross_entropy_threshold(
            inputs[0], inputs[1], reference=reference, candidate=candidate,
            gradient=op == "cross_entropy_grad", delta=delta, guaranteed=guaranteed,
        )
    ref = _ttrace.parse_side(reference, "reference")
    cand = _ttrace.parse_side(candidate, "candidate") if candidate is not None else ref
    parts = [as_core(v, f"operand {i}") for i, v in enumerate(inputs)]
    core = _ttrace.threshold(op, parts, ref, cand, _delta(delta, guaranteed), pricing,
                             float(eps))
    return Threshold(core, op, ref, cand)


def matmul_threshold(
    a: Any,
    b: Any,
    *,
    reference: str,
    candidate: Optional[str] = None,
    bias: Any = None,
    delta: float = 1e-6,
    guaranteed: bool = False,
    pricing: str = "auto",
) -> Threshold:
    """C = A·B (+ bias) under ``reference`` versus ``candidate`` (default: the same policy).

    ``a`` is [m, k], ``b`` is [k, n]; the threshold is on the [m, n] result. ``pricing``:
    ``"walk"`` visits every rounding (the tightest threshold, about 250 ns per multiply-add),
    ``"fast"`` gathers the model's statistics in a vectorized pass (tens of times one GEMM;
    about 1.1× the walk's threshold at 4,096 outputs, up to 1.5× with few), ``"auto"`` (the
    default) takes the fast pass for large products. Where the pass finds structured data
    it hands them to the walk, up to 2**25 multiply-adds over distinct rows and columns;
    beyond that the threshold returned is the guaranteed one (its ``delta`` is ``None``).
    A guaranteed threshold (``guaranteed=True``) is priced by two GEMMs of the operands'
    magnitudes under ``"auto"`` and ``"fast"`` (a few times one GEMM; the walk's bound within
    1e-4, never below it).
    """
    ref, cand = _policies(reference, candidate)
    values = [a, b] + ([bias] if bias is not None else [])
    core = _ttrace.threshold("matmul", _operands(["a", "b", "bias"], values), ref, cand,
                             _delta(delta, guaranteed), pricing)
    return Threshold(core, "matmul", ref, cand)


def linear_threshold(
    x: Any,
    weight: Any,
    bias: Any = None,
    *,
    reference: str,
    candidate: Optional[str] = None,
    delta: float = 1e-6,
    guaranteed: bool = False,
    pricing: str = "auto",
) -> Threshold:
    """``torch.nn.functional.linear``: y = x·weightᵀ + bias, with ``x`` [m, k] and ``weight``
    [n, k] as PyTorch stores it (``pricing`` as for :func:`matmul_threshold`)."""
    ref, cand = _policies(reference, candidate)
    values = [x, weight] + ([bias] if bias is not None else [])
    core = _ttrace.threshold("linear", _operands(["x", "weight", "bias"], values), ref, cand,
                             _delta(delta, guaranteed), pricing)
    return Threshold(core, "linear", ref, cand)


def sum_threshold(
    x: Any,
    *,
    reference: str,
    candidate: Optional[str] = None,
    mean: bool = False,
    delta: float = 1e-6,
    guaranteed: bool = False,
    pricing: str = "auto",
) -> Threshold:
    """Sums (or means, ``mean=True``) along the last dimension of ``x`` (``pricing`` as for
    :func:`matmul_threshold`: a sum is priced as the product of a row of ones and ``x``
    transposed)."""
    ref, cand = _policies(reference, candidate)
    op = "mean" if mean else "sum"
    core = _ttrace.threshold(op, _operands(["x"], [x]), ref, cand, _delta(delta, guaranteed),
                             pricing)
    return Threshold(core, op, ref, cand)


def softmax_threshold(
    x: Any,
    *,
    reference: str,
    candidate: Optional[str] = None,
    reference_form: str = "standard",
    candidate_form: str = "standard",
    delta: float = 1e-6,
    guaranteed: bool = False,
) -> Threshold:
    """Softmax along the last dimension. A form is ``standard`` or ``online:B`` (blockwise
    over B keys with online rescaling, as flash and ring attention do)."""
    ref, cand = _policies(reference, candidate)
    core = _ttrace.threshold("softmax", _operands(["x"], [x]), _with(ref, form=reference_form),
                             _with(cand, form=candidate_form), _delta(delta, guaranteed))
    return Threshold(core, "softmax", ref, cand)


def norm_threshold(
    x: Any,
    weight: Any,
    bias: Any = None,
    *,
    op: str = "layernorm",
    eps: float = 1e-5,
    reference: str,
    candidate: Optional[str] = None,
    reference_variance: str = "twopass",
    candidate_variance: str = "twopass",
    delta: float = 1e-6,
    guaranteed: bool = False,
    pricing: str = "auto",
) -> Threshold:
    """LayerNorm (``op="layernorm"``, variance ``twopass``, ``welford`` or ``onepass``) or
    RMSNorm (``op="rmsnorm"``) over the last dimension of ``x``. ``pricing``: ``"walk"``
    prices each side's sums by the determined-rounding walk, ``"fast"`` by the all-random
    model compiled for the row length (the walk where the engine's executions do not fit
    it), ``"auto"`` (the default) the second for probabilistic thresholds from 65,536
    elements in rows of at least 256."""
    if op not in ("layernorm", "rmsnorm"):
        raise InvalidInputError(
            f"invalid op: unknown normalization '{op}' (layernorm, rmsnorm)", "InvalidParameter"
        )
    ref, cand = _policies(reference, candidate)
    values = [x, weight] + ([bias] if bias is not None else [])
    core = _ttrace.threshold(
        op, _operands(["x", "weight", "bias"], values), _with(ref, variance=reference_variance),
        _with(cand, variance=candidate_variance), _delta(delta, guaranteed), pricing, float(eps),
    )
    return Threshold(core, op, ref, cand)


def elementwise_threshold(
    op: str,
    x: Any,
    y: Any = None,
    *,
    reference: str,
    candidate: Optional[str] = None,
    delta: float = 1e-6,
    guaranteed: bool = False,
) -> Threshold:
    """An elementwise op: ``add`` (x + y), ``scale:C`` (C·x), ``gelu`` (tanh form), ``silu``,
    ``exp``."""
    if op not in ("add", "gelu", "silu", "exp") and not op.startswith("scale:"):
        raise InvalidInputError(
            f"invalid op: unknown elementwise op '{op}' (add, scale:C, gelu, silu, exp)",
            "InvalidParameter",
        )
    ref, cand = _policies(reference, candidate)
    values = [x] + ([y] if y is not None else [])
    core = _ttrace.threshold(op, _operands(["x", "y"], values), ref, cand,
                             _delta(delta, guaranteed))
    return Threshold(core, op, ref, cand)


def allreduce_threshold(
    partials: Sequence[Any],
    *,
    reference: str,
    candidate: Optional[str] = None,
    delta: float = 1e-6,
    guaranteed: bool = False,
) -> Threshold:
    """The sum of ranks' partial tensors: the reference's order (say, sequential in FP32)
    against the candidate's (say ``order=ring``, BF16 partials)."""
    ref, cand = _policies(reference, candidate)
    parts = [as_core(p, f"partial {i}") for i, p in enumerate(partials)]
    core = _ttrace.threshold("allreduce", parts, ref, cand, _delta(delta, guaranteed))
    return Threshold(core, "allreduce", ref, cand)


def _class_indices(target: Any, ignore_index: Optional[int]) -> Tuple[Any, Any]:
    """The targets as a float64 array of class indices, and the mask of the rows kept (those
    whose target is not ``ignore_index``)."""
    import numpy as np

    if type(target).__module__.startswith("torch"):
        target = target.detach().cpu().numpy()
    t = np.asarray(target)
    if t.ndim != 1:
        raise InvalidInputError(
            f"target: one class index per row (a 1-D array), got shape {t.shape}",
            "ShapeMismatch",
        )
    if t.dtype.kind not in "iuf":
        raise InvalidInputError(f"target: dtype {t.dtype} is not a number", "InvalidParameter")
    keep = np.ones(t.shape, dtype=bool) if ignore_index is None else t != ignore_index
    return t[keep].astype(np.float64), keep


def cross_entropy_threshold(
    logits: Any,
    target: Any,
    *,
    reference: str,
    candidate: Optional[str] = None,
    ignore_index: Optional[int] = -100,
    gradient: bool = False,
    delta: float = 1e-6,
    guaranteed: bool = False,
) -> Threshold:
    """The mean cross-entropy of ``logits`` [rows, vocab] against ``target`` [rows] (integer
    class indices), as ``torch.nn.functional.cross_entropy`` computes it with its default
    mean reduction: the threshold is on the scalar loss. Rows whose target is
    ``ignore_index`` are left out of the loss and of its mean, as PyTorch leaves them.

    A vocabulary-parallel loss (Megatron's, torchtitan's) is the candidate's order
    ``splitk:R:F:tree`` — each of R ranks sums its shard of the vocabulary, the partial sums
    all-reduced in format F. Both sides read the logits in the same input format and
    accumulate in the same format (orders and output formats may differ).

    ``gradient=True`` prices the loss's gradient in the (kept rows') logits instead, what
    ``loss.backward()`` writes to ``logits.grad`` — a threshold on its Frobenius norm.
    """
    import numpy as np

    ref, cand = _policies(reference, candidate)
    arr, fmt = as_core(logits, "logits")
    if arr.ndim != 2:
        raise InvalidInputError(
            f"logits: [rows, vocab] with the classes last, got shape {tuple(arr.shape)} "
            "(flatten [batch, seq, vocab] logits with .reshape(-1, vocab) and their targets "
            "with .reshape(-1), as language-model losses do)",
            "ShapeMismatch",
        )
    t, keep = _class_indices(target, ignore_index)
    if keep.shape == (arr.shape[0],) and not keep.any():
        raise InvalidInputError(
            f"target: every row's target is ignore_index ({ignore_index}): the loss is "
            "empty (PyTorch's mean of no rows is NaN)",
            "InvalidParameter",
        )
    if keep.shape == (arr.shape[0],) and not keep.all():
        arr = np.ascontiguousarray(arr[keep])
    op = "cross_entropy_grad" if gradient else "cross_entropy"
    core = _ttrace.threshold(op, [(arr, fmt), (t, "f64")], ref, cand, _delta(delta, guaranteed))
    return Threshold(core, op, ref, cand)

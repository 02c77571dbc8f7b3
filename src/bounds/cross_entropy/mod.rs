//! Comparison thresholds for the mean cross-entropy of logits against integer targets — the
//! loss of a language model, vocabulary-parallel or not — as `engine::nn::cross_entropy`
//! executes it: per row m = max z, êⱼ = ra(exp(ra(zⱼ − m))), Ŝ = Σ êⱼ in the side's order,
//! ℓ = ra(ra(m + ra(ln Ŝ)) − z_target); loss = ro(ra(Σ ℓ / rows)), the Σ in the same order.
//!
//! Model (papers/bounds-cross-entropy.md). Both sides read the same logits in the same input
//! and accumulator formats, so they compute the same numerators êⱼ (the maximum is exact,
//! a vocabulary-parallel all-reduce of maxima included); they differ in the order of the two
//! sums and in their output formats.
//! * A row's denominator: Ŝ_s = T + E_s with T = Σ êⱼ exact and E_s the reduction error of the
//!   side's order (`reduction_error`, or the fast pass for large vocabularies). To first order
//!   ln Ŝ_c − ln Ŝ_r = (E_c − E_r)/Ŝ_r; exactly, |ln Ŝ_c − ln Ŝ_r| ≤ |Ŝ_c − Ŝ_r|/min(Ŝ_r, Ŝ_c),
//!   and every computed denominator is at least 1 (the maximum's term is exactly 1, the other
//!   terms are non-negative and every rounding is monotone).
//! * The rounded ln, the addition of m and the subtraction of the target's logit round nearly
//!   equal values on both sides (`ElementDiff::round_both`), unless every value within the
//!   guaranteed difference rounds to the same point (`round_pair`: then the sides agree).
//! * The rows' differences are independent (distinct roundings) and add up in the loss's sum:
//!   their sub-Gaussian parts add their proxies, their deterministic parts add signed, their
//!   rounding parts (zero-mean under the uniform-phase model, bounded) by Hoeffding. Identical
//!   rows with the same target differ identically: one component times their count.
//! * The loss's own sum of the ℓ in the two orders (`reduction_error` on the reference's ℓ;
//!   guaranteed: the reference's exactly, the candidate's by Higham's depths on its ℓ, which
//!   lie within the rows' guaranteed bounds of the reference's), the division by the row count
//!   (exact for a power of two) and each side's output rounding.

use crate::bounds::checked::{checked_by_executions, each_member, Executions};
use crate::bounds::compare::{row_classes, Confidence, ElementDiff, Threshold, ThresholdSums};
use crate::bounds::op::model::{Gain, OpModel, OpOptions, OpSide, Operand, OperandRole};
use crate::bounds::ops::{check_output, round_sides};
use crate::bounds::reduction::{
    dot_guaranteed_weights, lift_family, overflow_error, overflow_threshold, reduction_error,
    reduction_error_within_any, ReductionError,
};
use crate::bounds::softmax::{computed_numerators, denominator_accumulation};
use crate::error::{Error, Result};
use crate::format::Format;
use crate::order::{Accumulation, Order};
use crate::policy::arith::Arith;
use crate::policy::Policy;
use crate::tensor::Tensor;
use crate::trace::ModuleKind;

pub(crate) mod grad;

pub use grad::cross_entropy_grad_threshold;

/// Threshold on |loss_c − loss_r| for the mean cross-entropy of `logits` ([rows, vocab]; −∞
/// masks a class) against `targets` (one class per row), computed under `reference` and under
/// `candidate`. Both sides read the logits in the same input format and accumulate in the same
/// format with the same overflow behaviour (their orders and output formats may differ: a
/// vocabulary-parallel loss is [`Order::SplitK`] over the vocabulary shards, its partial sums
/// all-reduced in the partial format; a vendor kernel of unknown order is a family,
/// [`Order::AnyOf`] — `order=any` — priced for every member it may run, on either side).
///
/// Assumptions (papers/bounds-cross-entropy.md): the probabilistic threshold rests on the
/// random-rounding model (independent roundings with a uniform phase); the guaranteed one on
/// nothing but round-to-nearest (or monotone truncation) in every operation and the
/// libm logarithm erring by at most one f64 ulp.
///
/// A probabilistic threshold is checked first by the engine's executions of both sides: where
/// their difference exceeds the model's threshold at δ_s = min(δ, 10⁻³) (the norm or one
/// element), the data carry structure the model does not capture and the guaranteed threshold
/// is returned, its `confidence` saying so (papers/bounds-reductions.md §4).
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{cross_entropy_threshold, Confidence};
/// use ttrace::{Format, Order, Policy, Tensor};
/// # fn main() -> ttrace::Result<()> {
/// let logits = Tensor::rounded(&[4, 1000], (0..4000).map(|i| 3.0 * (i as f64 * 0.37).sin())
///     .collect(), Format::BF16, ttrace::Overflow::Saturating)?;
/// let r: Policy = "in=bf16,acc=f32,out=f32".parse()?;
/// // Vocabulary-parallel over 4 ranks: each rank's partial sum, all-reduced in FP32.
/// let c: Policy = "in=bf16,acc=f32,out=f32,order=splitk:4:f32:tree".parse()?;
/// let t = cross_entropy_threshold(&logits, &[3, 17, 999, 0], &r, &c,
///     Confidence::default_probabilistic())?;
/// assert!(t.abs_frobenius > 0.0 && t.relative < 1e-5);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidParameter`] for sides that differ in input or accumulator format or
/// overflow, for Kahan and tensor-core orders and families holding them (not priced here), and for
/// invalid policies; [`Error::ShapeMismatch`] for logits that are not [rows, vocab] with
/// rows, vocab ≥ 1; [`Error::LengthMismatch`] for a target count other than the row count;
/// [`Error::InvalidParameter`] for a target outside the vocabulary; [`Error::NonFinite`] for a
/// NaN or +∞ logit, or a target whose logit is masked (its loss is +∞);
/// [`Error::NoFiniteBound`] or [`Error::Overflow`] when a rounding may overflow.
pub fn cross_entropy_threshold(
    logits: &Tensor,
    targets: &[usize],
    reference: &Policy,
    candidate: &Policy,
    confidence: Confidence,
) -> Result<Threshold> {
    let build = |conf| cross_entropy_model(logits, targets, reference, candidate, conf);
    checked_by_executions(confidence, &build, &|| {
        executions(logits, targets, reference, candidate)
    })
}

/// Both sides' loss as the engine executes it (for every member of a family), `None` where it
/// cannot (an engine error).
pub(crate) fn executions(
    logits: &Tensor,
    targets: &[usize],
    reference: &Policy,
    candidate: &Policy,
) -> Option<Executions> {
    each_member((reference, candidate), |_, p| {
        let y = crate::engine::cross_entropy(logits, targets, p);
        y.ok().map(Tensor::into_values)
    })
}

/// [`cross_entropy_threshold`] as the model prices it (not checked by the executions).
fn cross_entropy_model(
    logits: &Tensor,
    targets: &[usize],
    reference: &Policy,
    candidate: &Policy,
    confidence: Confidence,
) -> Result<Threshold> {
    let lr = lse_rows(logits, targets, reference, candidate, confidence)?;
    let LseRows {
        ref class_of,
        ref lses,
        ref diffs,
        same_order,
        family,
        a,
        ref ar,
        acc: (ref acc_r, ref acc_c),
        ..
    } = lr;
    let rows = class_of.len();
    // Per (class, target): its loss and the difference of its losses. A loss the accumulator
    // cannot hold (FP16 logits near its range) has no finite bound.
    let limit = overflow_threshold(a);
    let mut keyed = std::collections::BTreeMap::new();
    for &(c, t) in lr.groups.keys() {
        let l = ar.sub(lses[c], lr.row(c)[t]);
        let mut d = diffs[c];
        if !same_order {
            round_pair(&mut d, a, lses[c] - lr.row(c)[t], !family);
        }
        let magnitude = l.abs().max(lses[c].abs()) + d.guaranteed;
        if magnitude.is_nan() || magnitude >= limit {
            return Err(overflow_error(a, magnitude, "a row's loss"));
        }
        keyed.insert((c, t), (d, l));
    }
    // Per row its loss and the guaranteed bound of its difference.
    let (losses, row_bound): (Vec<f64>, Vec<f64>) = class_of
        .iter()
        .zip(targets)
        .map(|(&c, &t)| (keyed[&(c, t)].1, keyed[&(c, t)].0.guaranteed))
        .unzip();
    // The rows' differences summed: independent across classes, coherent within one.
    let mut d = ElementDiff::default();
    let mut hoeffding = 0.0;
    for (key, (row, _)) in &keyed {
        let w = lr.groups[key] as f64;
        d.offset += w * row.offset;
        d.bias_bound += w * row.bias_bound;
        d.guaranteed += w * row.guaranteed;
        d.proxy += w * w * row.proxy;
        d.rounding_mean_square += w * w * row.rounding_mean_square;
        hoeffding += w * w * (row.rounding_bound.powi(2) + row.rounding_bound_proxy);
    }
    d.rounding_bound_proxy = hoeffding;
    // The loss's sum of the rows' losses in each side's order.
    let total = crate::order::sum(&losses, acc_r)?;
    if !same_order {
        // The reference sums its own losses, exactly these; the candidate sums losses known
        // only within the rows' guaranteed bounds of them: a rounding is determined for it
        // only where every such value rounds alike (an FP32 loss rounded to BF16 partials
        // takes the candidate's own value's rounding, not the reference's).
        // Under a family the reference's own losses are known within the same bounds (two
        // members differ by at most twice a member's own error; the bound covers both sides').
        let radius: Vec<f64> = row_bound
            .iter()
            .map(|b| if family { 2.0 * b } else { *b })
            .collect();
        let er = if family {
            reduction_error_within_any(&losses, &radius, acc_r, false)?
        } else {
            reduction_error(&losses, acc_r, false)?
        };
        let ec = reduction_error_within_any(&losses, &radius, acc_c, false)?;
        let sum = ElementDiff::from_reductions(er, ec, 0.0);
        // The candidate sums its own losses, each within its row's bound of the reference's
        // (Higham's depths, the largest over a family's members); so does a family's
        // reference.
        let bound = |acc: &Accumulation| -> Result<f64> {
            let (weights, constant) = family_weights(acc, rows)?;
            Ok(losses
                .iter()
                .zip(&radius)
                .zip(&weights)
                .map(|((l, b), w)| (l.abs() + b) * w)
                .sum::<f64>()
                + constant)
        };
        let reference_part = if family { bound(acc_r)? } else { er.guaranteed };
        if ec.mean != 0.0 || (family && er.mean != 0.0) {
            // A rounding determined over the whole interval of its operand returns the same
            // value wherever the losses lie in it: it absorbs their differences, which then
            // do not reach the loss (an FP32 loss of 525.08 rounded to a BF16 partial gives
            // 524 on both sides of a row difference of 3·10⁻⁴; the adversary's search found
            // the rows' offset cancelling part of the sum's: 1.00025× the threshold). The
            // rows' determined offset may be absorbed wholly, in part or not at all: its
            // sign is unknown.
            d.bias_bound += d.offset.abs();
            d.offset = 0.0;
        }
        d.offset += sum.offset;
        d.bias_bound += sum.bias_bound;
        d.proxy += sum.proxy;
        d.guaranteed += reference_part + bound(acc_c)?;
    }
    // The mean: a division by the row count (exact for a power of two), then each side's
    // output rounding.
    let loss = ar.div(total, rows as f64);
    d.scale(1.0 / rows as f64);
    if !rows.is_power_of_two() && !same_order {
        round_pair(&mut d, a, total / rows as f64, !family);
    }
    check_output(&d, loss, (reference.output, candidate.output))?;
    if d == ElementDiff::default() && reference.output == candidate.output {
        // The same order, or every rounding determined alike: the same loss.
        return Ok(Threshold::identical(confidence, loss.abs(), 1));
    }
    round_sides(&mut d, (a, a), (reference.output, candidate.output), loss);
    let mut sums = ThresholdSums::new(confidence, 1);
    sums.add(&d, 1);
    let norm = reference
        .output
        .round(loss, reference.accumulation.overflow)
        .abs();
    let mut th = sums.threshold(norm);
    // One element: its own bound (sub-Gaussian at δ) is a bound on the norm too, and the
    // tighter one where the norm's quadratic-form tail is wider.
    if th.per_element < th.abs_frobenius {
        th.abs_frobenius = th.per_element;
        th.relative = if th.per_element == 0.0 {
            0.0
        } else if norm > 0.0 {
            th.per_element / norm
        } else {
            f64::INFINITY
        };
    }
    Ok(th)
}

/// What the loss and its gradient share: the logits in the input format, their classes of
/// identical rows, the reference's log-sum-exp per class as it computes it, and per class the
/// difference of the two sides' log-sum-exps (`ElementDiff`; zero when the denominators are
/// summed in the same order).
pub(crate) struct LseRows {
    /// The logits rounded to the input format.
    pub z: Tensor,
    /// The row length.
    pub vocab: usize,
    /// Each row's class of identical rows.
    pub class_of: Vec<usize>,
    /// Per class, (its first row, its count).
    pub classes: Vec<(usize, usize)>,
    /// Per (class, target), how many rows: rows alike in their logits and target differ
    /// alike.
    pub groups: std::collections::BTreeMap<(usize, usize), usize>,
    /// Per class, the reference's lse = ra(m + ra(ln Ŝ)).
    pub lses: Vec<f64>,
    /// Per class, lse_c − lse_r.
    pub diffs: Vec<ElementDiff>,
    /// Both sides sum the denominators (and the loss) in the same order.
    pub same_order: bool,
    /// A side runs a kernel family: the reference's own values (`lses`, the losses) are those
    /// of one member, the real ones within the guaranteed differences of them.
    pub family: bool,
    /// The accumulator format.
    pub a: Format,
    /// The accumulator's arithmetic (its output format the reference's).
    pub ar: Arith,
    /// The two sides' accumulations of values in the accumulator format.
    pub acc: (Accumulation, Accumulation),
}

impl LseRows {
    /// The logits of class `c`'s rows.
    pub fn row(&self, c: usize) -> &[f64] {
        let first = self.classes[c].0;
        &self.z.values()[first * self.vocab..(first + 1) * self.vocab]
    }
}

/// Validate the operands and sides of a cross-entropy (loss or gradient) and price the rows'
/// log-sum-exps ([`LseRows`]).
pub(crate) fn lse_rows(
    logits: &Tensor,
    targets: &[usize],
    reference: &Policy,
    candidate: &Policy,
    confidence: Confidence,
) -> Result<LseRows> {
    reference.validate()?;
    candidate.validate()?;
    if reference.input() != candidate.input()
        || reference.accumulator() != candidate.accumulator()
        || reference.accumulation.overflow != candidate.accumulation.overflow
    {
        return Err(Error::InvalidParameter {
            name: "candidate",
            reason: "cross-entropy thresholds are implemented for two sides with the same input \
                     and accumulator formats and overflow (orders and output formats may differ)"
                .into(),
        });
    }
    for (side, p) in [("reference", reference), ("candidate", candidate)] {
        let o = &p.accumulation.order;
        let members = lift_family(o).unwrap_or_else(|| vec![o.clone()]);
        if members
            .iter()
            .any(|m| m.has_family() || m.has_tensor_core() || *m == Order::Kahan)
        {
            return Err(Error::InvalidParameter {
                name: if side == "reference" {
                    "reference"
                } else {
                    "candidate"
                },
                reason: format!(
                    "cross-entropy thresholds price plain orders (sequential, pairwise, blocked, \
                     split) and families of them (`any`); the {side}'s order {o} is not \
                     supported"
                ),
            });
        }
    }
    let shape = logits.shape();
    if shape.len() != 2 || shape[0] == 0 || shape[1] == 0 {
        return Err(Error::ShapeMismatch {
            what: "cross-entropy threshold: logits [rows, vocab] with rows, vocab >= 1".into(),
            expected: vec![1, 1],
            found: shape.to_vec(),
        });
    }
    let (rows, vocab) = (shape[0], shape[1]);
    if targets.len() != rows {
        return Err(Error::LengthMismatch {
            what: "cross-entropy threshold: one target per row of the logits",
            left: rows,
            right: targets.len(),
        });
    }
    if let Some((i, &t)) = targets.iter().enumerate().find(|(_, &t)| t >= vocab) {
        return Err(Error::InvalidParameter {
            name: "targets",
            reason: format!("target {t} at row {i} is not below the vocabulary size {vocab}"),
        });
    }
    let z = logits.cast(
        reference.input(),
        reference.input_overflow(reference.input()),
    );
    for (r, row) in z.values().chunks(vocab).enumerate() {
        if let Some(&v) = row.iter().find(|v| v.is_nan() || **v == f64::INFINITY) {
            return Err(Error::NonFinite {
                what: format!("cross-entropy threshold: row {r} of the logits"),
                value: v,
            });
        }
        if row[targets[r]] == f64::NEG_INFINITY {
            return Err(Error::NonFinite {
                what: format!(
                    "cross-entropy threshold: row {r}'s target {} is masked (its loss is +inf)",
                    targets[r]
                ),
                value: f64::NEG_INFINITY,
            });
        }
    }
    let a = reference.accumulator();
    let ar = Arith::new(a, reference.output, reference.accumulation.overflow);
    let (acc_r, acc_c) = (
        denominator_accumulation(reference),
        denominator_accumulation(candidate),
    );
    // A kernel family is not one execution: the same family on both sides may differ, and
    // the reference's own values are known only within its members' spread.
    let family = acc_r.order.has_family() || acc_c.order.has_family();
    let same_order = acc_r == acc_c && !family;
    // Identical rows have identical log-sum-exps (and differences).
    let (class_of, classes) = row_classes(z.values(), vocab);
    let row_of = |c: usize| &z.values()[classes[c].0 * vocab..(classes[c].0 + 1) * vocab];
    let max_of = |row: &[f64]| row.iter().fold(f64::NEG_INFINITY, |x, &y| x.max(y));
    let numerators: Vec<Vec<f64>> = (0..classes.len())
        .map(|c| computed_numerators(row_of(c), max_of(row_of(c)), reference))
        .collect();
    // The reference's denominators and log-sum-exps as it computes them.
    let sums = numerators
        .iter()
        .map(|e| crate::order::sum(e, &acc_r))
        .collect::<Result<Vec<f64>>>()?;
    let lses: Vec<f64> = (0..classes.len())
        .map(|c| ar.add(max_of(row_of(c)), ar.ln(sums[c])))
        .collect();
    let dens = if same_order || family {
        vec![None; classes.len()]
    } else {
        denominators(&numerators, &acc_r, &acc_c, confidence)?
    };
    let mut by_class: Vec<ElementDiff> = vec![ElementDiff::default(); classes.len()];
    if !same_order {
        for (c, d) in by_class.iter_mut().enumerate() {
            let (er, ec) = match dens[c] {
                Some(pair) => pair,
                None => (
                    reduction_error(&numerators[c], &acc_r, false)?,
                    reduction_error(&numerators[c], &acc_c, false)?,
                ),
            };
            *d = ElementDiff::from_reductions(er, ec, 0.0);
            // ln Ŝ_c − ln Ŝ_r: to first order (Ŝ_c − Ŝ_r)/Ŝ_r; guaranteed by the mean value
            // theorem, both denominators being at least max(1, Ŝ_r − G); each side's f64
            // logarithm within one f64 ulp.
            let (s, g) = (sums[c], d.guaranteed);
            d.scale(1.0 / s);
            let libm = 2.0 * f64::EPSILON * s.ln().abs();
            // Both denominators lie in [max(1, Ŝ_r − G), Ŝ_r + G] (under a family, each within
            // its own bound of the exact sum T): the logarithms differ by at most the log of
            // that interval's ratio, and by the mean value theorem at most G / its floor.
            let (lo, hi) = if family {
                let t: f64 = numerators[c].iter().sum::<f64>() * (1.0 - 1e-12);
                let own = er.guaranteed.max(ec.guaranteed);
                (t - own, t * (1.0 + 2e-12) + own)
            } else {
                (s - g, s + g)
            };
            let floor = lo.max(1.0);
            let x = (g / floor).min((hi / floor).ln());
            d.guaranteed = x + libm;
            // The first-order model's remainder, |ln(1 + y) − y| ≤ y²/(2(1 − |y|)) for
            // |y| ≤ x < 1: a deterministic part of unknown sign (BF16 partial sums make it
            // visible).
            let second = if x < 0.5 {
                x * x / (2.0 * (1.0 - x))
            } else {
                x
            };
            d.bias_bound += libm + second;
            round_pair(d, a, s.ln(), !family);
            round_pair(d, a, max_of(row_of(c)) + ar.ln(s), !family);
        }
    }
    let mut groups = std::collections::BTreeMap::new();
    for (r, &c) in class_of.iter().enumerate() {
        *groups.entry((c, targets[r])).or_insert(0) += 1;
    }
    Ok(LseRows {
        z,
        vocab,
        class_of,
        classes,
        groups,
        lses,
        diffs: by_class,
        same_order,
        family,
        a,
        ar,
        acc: (acc_r, acc_c),
    })
}

/// Per-term weights and a constant bounding the guaranteed error of any sum under `acc`
/// ([`dot_guaranteed_weights`]); for a family, the largest over its members.
fn family_weights(acc: &Accumulation, n: usize) -> Result<(Vec<f64>, f64)> {
    let Some(members) = lift_family(&acc.order) else {
        return dot_guaranteed_weights(acc, n);
    };
    let (mut weights, mut constant) = (vec![0.0; n], 0.0f64);
    for m in members {
        let member = Accumulation {
            order: m,
            ..acc.clone()
        };
        let (w, c) = dot_guaranteed_weights(&member, n)?;
        for (a, b) in weights.iter_mut().zip(w) {
            *a = f64::max(*a, b);
        }
        constant = constant.max(c);
    }
    Ok((weights, constant))
}

/// Both sides round their values — the reference's `v` (exact, up to f64's rounding of
/// `v` itself), the candidate's within `d.guaranteed` of it — to `f`: where every value of
/// that interval rounds to the same point the two sides agree exactly from here on (an lse
/// whose ln is far below its maximum's spacing), else a rounding of nearly equal values
/// ([`ElementDiff::round_both`]).
/// `known`: whether `v` is the reference's value (not under a kernel family, whose
/// reference runs an unknown member: then always the rounding of nearly equal values).
pub(crate) fn round_pair(d: &mut ElementDiff, f: Format, v: f64, known: bool) {
    let r = d.guaranteed + v.abs() * f64::EPSILON;
    let ov = crate::format::Overflow::NonSaturating;
    if known && r.is_finite() && f.round(v - r, ov) == f.round(v + r, ov) {
        *d = ElementDiff::default();
    } else if known {
        d.round_both(f, v);
    } else {
        // The reference's value itself is within the guaranteed difference of `v`: the
        // spacings are taken that much further out.
        d.round_both(f, v.abs() + d.guaranteed);
    }
}

/// Per class of rows, both sides' reduction errors of the denominators from the fast pass
/// (papers/bounds-reductions.md §5.1) where it applies to their rows, `None` for the walk.
fn denominators(
    numerators: &[Vec<f64>],
    acc_r: &Accumulation,
    acc_c: &Accumulation,
    confidence: Confidence,
) -> Result<Vec<Option<(ReductionError, ReductionError)>>> {
    let mut out = vec![None; numerators.len()];
    let vocab = numerators.first().map_or(0, Vec::len);
    if vocab < 1024 || acc_r.accumulator != Format::F32 || acc_c.accumulator != Format::F32 {
        return Ok(out);
    }
    let probabilistic = matches!(confidence, Confidence::Probabilistic { .. });
    let terms: Vec<f64> = numerators.iter().flatten().copied().collect();
    if let Some(priced) =
        crate::bounds::fast::sum_rows(&terms, vocab, (acc_r, acc_c), probabilistic)?
    {
        for (slot, p) in out.iter_mut().zip(priced) {
            *slot = Some(p);
        }
    }
    Ok(out)
}

/// `cross_entropy` and `cross_entropy_grad` in the op registry: the mean cross-entropy of
/// `logits` [rows, vocab] against `target` [rows] (class indices, integers below vocab), each
/// side in its order — the scalar loss ([`cross_entropy_threshold`]; gain ‖(p − onehot)/rows‖_F,
/// the loss's gradient in the logits, first order by Cauchy–Schwarz) or, with `gradient`, its
/// gradient in the logits as a loss module's backward pass writes it, the upstream gradient 1
/// ([`cross_entropy_grad_threshold`]; gain the largest probability — the bound `softmax_gain`
/// puts on the softmax's Jacobian — over the row count). Probabilities in f64.
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyModel {
    /// The gradient in the logits rather than the loss.
    pub gradient: bool,
}

/// The targets of the registry's `target` operand: integers in [0, vocab).
fn class_indices(t: &Tensor, rows: usize) -> Result<Vec<usize>> {
    if t.len() != rows {
        return Err(Error::LengthMismatch {
            what: "cross_entropy: one target per row of the logits",
            left: rows,
            right: t.len(),
        });
    }
    t.values()
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            if v >= 0.0 && v.fract() == 0.0 && v < usize::MAX as f64 {
                Ok(v as usize)
            } else {
                Err(Error::InvalidParameter {
                    name: "target",
                    reason: format!("target {v} at row {i} is not a class index (an integer >= 0)"),
                })
            }
        })
        .collect()
}

impl OpModel for CrossEntropyModel {
    fn operand_names(&self) -> &'static [&'static str] {
        &["logits", "target"]
    }

    fn operands(&self, m: usize, k: usize, _n: usize) -> Vec<Operand> {
        vec![
            Operand::new("logits", &[m, k], OperandRole::Data),
            Operand::new("target", &[m], OperandRole::ClassIndex),
        ]
    }

    fn threshold(
        &self,
        inputs: &[&Tensor],
        reference: &OpSide,
        candidate: &OpSide,
        _: &OpOptions,
        confidence: Confidence,
    ) -> Result<Threshold> {
        let rows = inputs[0].shape().first().copied().unwrap_or(0);
        let targets = class_indices(inputs[1], rows)?;
        let (r, c) = (&reference.policy, &candidate.policy);
        if self.gradient {
            cross_entropy_grad_threshold(inputs[0], &targets, 1.0, r, c, confidence)
        } else {
            cross_entropy_threshold(inputs[0], &targets, r, c, confidence)
        }
    }

    fn module_kinds(&self) -> &'static [ModuleKind] {
        if self.gradient {
            &[]
        } else {
            &[ModuleKind::Loss]
        }
    }

    fn gain(&self, inputs: &[&Tensor], options: &OpOptions) -> Result<Gain> {
        let x = inputs[0];
        let targets = class_indices(inputs[1], x.shape().first().copied().unwrap_or(0))?;
        let rows = x.shape().first().copied().unwrap_or(0).max(1);
        if self.gradient {
            let softmax = crate::bounds::softmax::SoftmaxModel.gain(&[x], options)?;
            return Ok(Gain {
                gain: softmax.gain / rows as f64,
            });
        }
        let k = x.shape().last().copied().unwrap_or(1).max(1);
        let mut sq = 0.0;
        for (row, &t) in x.values().chunks(k).zip(&targets) {
            let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let e: Vec<f64> = row.iter().map(|v| (v - m).exp()).collect();
            let s: f64 = e.iter().sum();
            for (j, v) in e.iter().enumerate() {
                let g = v / s - if j == t { 1.0 } else { 0.0 };
                sq += g * g;
            }
        }
        Ok(Gain {
            gain: sq.sqrt() / rows as f64,
        })
    }
}

//! The threshold of the mean cross-entropy's gradient in the logits, as
//! `engine::nn::cross_entropy_backward` computes it: per row the log-sum-exp lse of the loss,
//! then dzⱼ = ro(mul(sub(pⱼ, [j = t]), c)) with pⱼ = ra(exp(ra(zⱼ − lse))) and
//! c = ra(ra(dloss) / rows) — what a loss module's backward pass writes (papers/
//! bounds-cross-entropy.md, "The gradient").
//!
//! The two sides differ only through lse (the denominators' order): Δaⱼ = −Δlse for every
//! element of a row, so Δpⱼ = −pⱼ·Δlse to first order — one component common to the row, as
//! a softmax's denominator is (`bounds/softmax.rs`) — and through each element's own roundings
//! of nearly equal values (the argument, exp, the one-hot subtraction unless exact, the scaling
//! unless by a power of two, the output).

use crate::bounds::checked::{checked_by_executions, each_member, Executions};
use crate::bounds::compare::{Confidence, ElementDiff, Threshold, ThresholdSums};
use crate::bounds::cross_entropy::{lse_rows, round_pair, LseRows};
use crate::bounds::ops::{check_output, round_sides};
use crate::error::Result;
use crate::policy::Policy;
use crate::tensor::Tensor;

/// Threshold on ‖dz_c − dz_r‖_F for the gradient of the mean cross-entropy of `logits`
/// ([rows, vocab]) against `targets` in the logits, times the upstream gradient `dloss`
/// (1 for a loss that is the end of the graph), computed under `reference` and `candidate`.
/// The sides as for [`cross_entropy_threshold`](crate::bounds::cross_entropy_threshold).
///
/// Assumptions: as for the loss (papers/bounds-cross-entropy.md); libm's exp within one f64
/// ulp.
///
/// A probabilistic threshold is checked first by the engine's executions of both sides: where
/// their difference exceeds the model's threshold at δ_s = min(δ, 10⁻³) (the norm or one
/// element), the data carry structure the model does not capture and the guaranteed threshold
/// is returned, its `confidence` saying so (papers/bounds-reductions.md §4).
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{cross_entropy_grad_threshold, Confidence};
/// use ttrace::{Format, Policy, Tensor};
/// # fn main() -> ttrace::Result<()> {
/// let logits = Tensor::rounded(&[4, 1000], (0..4000).map(|i| 3.0 * (i as f64 * 0.37).sin())
///     .collect(), Format::BF16, ttrace::Overflow::Saturating)?;
/// let r: Policy = "in=bf16,acc=f32,out=bf16".parse()?;
/// let c: Policy = "in=bf16,acc=f32,out=bf16,order=splitk:8:f32:tree".parse()?;
/// let t = cross_entropy_grad_threshold(&logits, &[3, 17, 999, 0], 1.0, &r, &c,
///     Confidence::default_probabilistic())?;
/// assert!(t.relative > 0.0 && t.relative < 0.01);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// Those of [`cross_entropy_threshold`](crate::bounds::cross_entropy_threshold);
/// [`Error::NonFinite`](crate::Error::NonFinite) for a non-finite `dloss`.
pub fn cross_entropy_grad_threshold(
    logits: &Tensor,
    targets: &[usize],
    dloss: f64,
    reference: &Policy,
    candidate: &Policy,
    confidence: Confidence,
) -> Result<Threshold> {
    let build = |conf| grad_model(logits, targets, dloss, (reference, candidate), conf);
    checked_by_executions(confidence, &build, &|| {
        executions(logits, targets, dloss, (reference, candidate))
    })
}

/// Both sides' gradient as the engine executes it (for every member of a family), `None`
/// where it cannot (an engine error).
pub(crate) fn executions(
    logits: &Tensor,
    targets: &[usize],
    dloss: f64,
    (reference, candidate): (&Policy, &Policy),
) -> Option<Executions> {
    each_member((reference, candidate), |_, p| {
        let y = crate::engine::cross_entropy_backward(logits, targets, dloss, p);
        y.ok().map(Tensor::into_values)
    })
}

/// [`cross_entropy_grad_threshold`] as the model prices it (not checked by the executions).
fn grad_model(
    logits: &Tensor,
    targets: &[usize],
    dloss: f64,
    (reference, candidate): (&Policy, &Policy),
    confidence: Confidence,
) -> Result<Threshold> {
    if !dloss.is_finite() {
        return Err(crate::Error::NonFinite {
            what: "cross-entropy gradient threshold: the upstream gradient dloss".into(),
            value: dloss,
        });
    }
    let lr = lse_rows(logits, targets, reference, candidate, confidence)?;
    let LseRows {
        vocab,
        ref class_of,
        ref lses,
        ref diffs,
        same_order,
        family,
        a,
        ref ar,
        ..
    } = lr;
    let rows = class_of.len();
    let c = ar.div(ar.ra(dloss), rows as f64);
    let exact_scale = c == 0.0 || (c.abs().log2().fract() == 0.0);
    let outputs = (reference.output, candidate.output);
    let mut sums = ThresholdSums::new(confidence, rows * vocab);
    let mut norm_sq = 0.0;
    // Rows alike in their logits and target: one group each.
    for (&(k, t), &count) in &lr.groups {
        let row = lr.row(k);
        let lse = lses[k];
        let dl = diffs[k];
        // The row's common part: lse's own random and rounding parts (the latter bounded:
        // Hoeffding), carried to every element by −p·c.
        let row_proxy = dl.proxy + dl.rounding_bound.powi(2) + dl.rounding_bound_proxy;
        let mut row_p2c2 = 0.0;
        // Elements alike: the same logit, both or neither the target.
        let mut alike: std::collections::BTreeMap<(u64, bool), usize> = Default::default();
        for (j, &zj) in row.iter().enumerate() {
            *alike.entry((zj.to_bits(), j == t)).or_insert(0) += 1;
        }
        for (&(bits, is_target), &same) in &alike {
            let zj = f64::from_bits(bits);
            let arg = ar.sub(zj, lse);
            let p = ar.exp(arg);
            let onehot = if is_target { 1.0 } else { 0.0 };
            let g = (p - onehot) * c;
            norm_sq += ar.ro(ar.mul(ar.sub(p, onehot), c)).powi(2) * (same * count) as f64;
            if zj == f64::NEG_INFINITY {
                // A masked class: p = 0 on both sides, exactly.
                continue;
            }
            let mut d = ElementDiff::default();
            // A probability that underflows to an exact zero on both sides however lse moves
            // within its bound (a logit far below the row's maximum): no difference.
            let far =
                ar.exp(ar.sub(zj, lse) + 2.0 * dl.guaranteed + a.ulp(zj - lse).unwrap_or(0.0));
            let underflows = p == 0.0 && far == 0.0;
            if !same_order && !underflows {
                // The argument: −Δlse, then a rounding of nearly equal values.
                d.offset = -dl.offset;
                d.bias_bound = dl.bias_bound;
                d.proxy = row_proxy;
                d.guaranteed = dl.guaranteed;
                round_pair(&mut d, a, zj - lse, !family);
                // exp: Δp = p·Δa to first order; exactly within p·(e^|Δa| − 1); each side's
                // f64 exp within one f64 ulp.
                let ga = d.guaranteed;
                d.scale(p);
                d.guaranteed = p * ga.exp_m1() + 2.0 * f64::EPSILON * p;
                // The first-order model's remainder, |e^y − 1 − y| ≤ (y²/2)·e^|y|: a
                // deterministic part of unknown sign (BF16 partial sums make it visible).
                d.bias_bound += 2.0 * f64::EPSILON * p + p * ga * ga / 2.0 * ga.exp();
                round_pair(&mut d, a, arg.exp(), !family);
                // p − 1 is exact (Sterbenz) while both sides' p lie in [0.5, 2].
                if is_target && p - 2.0 * d.guaranteed < 0.5 {
                    round_pair(&mut d, a, p - 1.0, !family);
                }
                d.scale(c);
                if !exact_scale {
                    round_pair(&mut d, a, g, !family);
                }
            }
            // An element both sides compute alike (its argument's rounding determined) takes
            // no row part, and its output roundings agree too.
            let alike = d == ElementDiff::default();
            if !(alike && outputs.0 == outputs.1) {
                check_output(&d, g, outputs)?;
                round_sides(&mut d, (a, a), outputs, g);
            }
            let row_part = row_proxy * (p * c).powi(2);
            if !same_order && !alike {
                d.proxy -= row_part;
                d.proxy = d.proxy.max(0.0);
                d.shared_proxy = row_part;
                row_p2c2 += (p * c).powi(2) * same as f64;
            }
            sums.add_group(&d, same * count);
        }
        if !same_order && row_p2c2 > 0.0 {
            let common = ElementDiff {
                proxy: row_proxy * row_p2c2,
                spread: true,
                ..ElementDiff::default()
            };
            sums.add_group(&common, count);
        }
    }
    if same_order && reference.output == candidate.output {
        return Ok(Threshold::identical(
            confidence,
            norm_sq.sqrt(),
            rows * vocab,
        ));
    }
    Ok(sums.threshold(norm_sq.sqrt()))
}

//! Comparison thresholds for softmax along the last dimension: standard (max-subtracted) and
//! blockwise online, each with its own reduction order, as `engine::nn` executes them.
//!
//! Model (papers/bounds-softmax.md). Every quantity is positive, so each side computes
//! p̂ᵢ = pᵢ(1 + ρᵢ) with, to first order, ρᵢ = nᵢ − σ + (trailing roundings):
//! * nᵢ, the relative error of the numerator: the rounding of dᵢ = xᵢ − m in the accumulator A
//!   (an absolute error of d is a relative error of exp(d)), the rounding of exp, and for the
//!   online form the block rescale factor f_B = exp(m_B − m) (two roundings) and the product
//!   e·f_B (one rounding);
//! * σ, the relative error of the denominator: its reduction's own error (`reduction_error` on
//!   the exact numerators, in the side's order; for the online form the per-block sums, the
//!   products l_B·f_B and their sequential sum) plus Σⱼ pⱼnⱼ;
//! * the division and the output rounding: roundings of nearly equal values (`compare`).
//!
//! When both sides compute the numerators identically (same form, same formats, same block),
//! the nᵢ are shared and cancel, and D = p ⊙ (σ_r − σ_c) up to the trailing roundings. The
//! denominator term is common to a whole row, so it enters the tensor threshold as one
//! sub-Gaussian component per row (‖p_row‖²·Var(σ_r − σ_c)), not one per element.
//! Guaranteed: |ρ| ≤ max|n| + max|σ| + O(u²) with |n| ≤ u·(|d| + 1) (+ the online factor
//! terms) and |σ| ≤ G_S/S + Σ pⱼ|nⱼ|, inflated by 1/(1 − |σ|).

use crate::bounds::checked::{checked_by_executions, each_member, member_policies, Executions};
use crate::bounds::compare::{row_classes, Confidence, ElementDiff, Threshold, ThresholdSums};
use crate::bounds::op::model::{Gain, OpModel, OpOptions, OpSide};
use crate::bounds::ops::output::GuaranteedRounding;
use crate::bounds::reduction::{reduction_error, ReductionError};
use crate::engine::nn::numerators_alike;
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use crate::order::{Accumulation, Order};
use crate::policy::AttentionImpl;
use crate::policy::Policy;
use crate::tensor::Tensor;
use std::rc::Rc;

/// Per-element and per-row error statistics of one side's softmax of one row.
struct SideRow {
    /// Exact-model probabilities pᵢ (shared, like the two following, with a side that
    /// computes the same numerators: [`SideRow::with_denominator`]).
    p: Rc<Vec<f64>>,
    /// Variance of the numerator's relative error nᵢ.
    num_var: Rc<Vec<f64>>,
    /// Bound on |nᵢ|.
    num_max: Rc<Vec<f64>>,
    /// Variance of the denominator's own relative error (excluding the numerators' share).
    den_var: f64,
    /// Bound on the denominator's own relative error.
    den_max: f64,
    /// Deterministic part (absorbed terms) of the denominator's relative error.
    den_mean: f64,
    /// Bound on the denominator's relative tie error (deterministic, unknown sign).
    den_tie: f64,
    /// The online form's block factors ra(exp(ra(m_B − m))), by block maximum: each factor's
    /// relative rounding error is shared by every element of the blocks with that maximum and
    /// by their part of the denominator, (variance, that part's weight l_B·f_B / l, and the
    /// elements' Σ p²).
    factors: std::collections::BTreeMap<u64, (f64, f64, f64)>,
    /// The exact-model denominator s = Σ exp(xᵢ − m).
    sum: f64,
}

impl SideRow {
    /// The same row on a side that computes the same numerators (the standard form, the same
    /// accumulator and overflow) and whose standard-form denominator errs by `es`: what
    /// [`side_row`] computes for that side, without computing the numerators again.
    fn with_denominator(&self, es: ReductionError) -> SideRow {
        let s = self.sum;
        SideRow {
            p: Rc::clone(&self.p),
            num_var: Rc::clone(&self.num_var),
            num_max: Rc::clone(&self.num_max),
            // As `side_row` accumulates them from zero.
            den_var: (0.0 + es.variance) / (s * s),
            den_max: (0.0 + es.guaranteed) / s,
            den_mean: (0.0 + es.mean) / s,
            den_tie: (0.0 + es.tie_bound) / s,
            factors: self.factors.clone(),
            sum: s,
        }
    }
}

/// Variance and bound of the absolute error of rounding the exact `v` to `f` (exact when the
/// value lies on f's grid).
fn rounding_stats(f: Format, v: f64) -> (f64, f64) {
    if f.round(v, Overflow::NonSaturating) == v {
        return (0.0, 0.0);
    }
    let ulp = f.ulp(v).unwrap_or(0.0);
    (ulp * ulp / 12.0, ulp / 2.0)
}

/// The numerators ra(exp(ra(x − m))) of one block (or of a whole row, standard form) with
/// maximum `m`, as a side computes them: the terms its sum really adds (−∞, a mask, gives 0).
pub(crate) fn computed_numerators(chunk: &[f64], m: f64, policy: &Policy) -> Vec<f64> {
    let (a, ov) = (policy.accumulator(), policy.accumulation.overflow);
    chunk
        .iter()
        .map(|&x| {
            if x == f64::NEG_INFINITY {
                0.0
            } else {
                a.round(a.add_rounded(x, -m, ov).exp(), ov)
            }
        })
        .collect()
}

/// The accumulation of a side's denominator: its order, on values of the accumulator format.
pub(crate) fn denominator_accumulation(policy: &Policy) -> Accumulation {
    let mut acc = policy.accumulation.clone();
    acc.input = policy.accumulator();
    acc
}

/// The standard form's numerators of every row, computed once when both sides compute them
/// alike (the standard form on both, the same input and accumulator formats and overflows):
/// the model, the denominators' pricing and the check's executions all read them, where each
/// computed them again before (three `exp` per element, a third of a threshold's time).
struct Numerators {
    /// ra(exp(ra(xᵢ − m))), m the row's maximum, as both sides compute them
    /// ([`computed_numerators`], the engine's `masked_exp`): 0 where xᵢ = −∞.
    computed: Vec<f64>,
    /// exp(xᵢ − m) in `f64`: the exact model's numerators (0 where xᵢ = −∞).
    model: Vec<f64>,
}

/// One row of [`Numerators`].
#[derive(Clone, Copy)]
struct RowNumerators<'a> {
    computed: &'a [f64],
    model: &'a [f64],
}

impl Numerators {
    /// The numerators of the rows (of `n`) of `xi`, values of the policy's input format, as
    /// `policy` computes them. One `exp` per element: where the side's ra(xᵢ − m) is the
    /// `f64` difference itself, its exponential is the model's.
    fn of(xi: &[f64], n: usize, policy: &Policy) -> Numerators {
        let (a, ov) = (policy.accumulator(), policy.accumulation.overflow);
        let (mut computed, mut model) =
            (Vec::with_capacity(xi.len()), Vec::with_capacity(xi.len()));
        for row in xi.chunks(n.max(1)) {
            let m = row.iter().fold(f64::NEG_INFINITY, |x, &y| x.max(y));
            for &x in row {
                let dlocal = x - m;
                let el = dlocal.exp();
                let t = if x == f64::NEG_INFINITY {
                    0.0
                } else {
                    let d = a.add_rounded(x, -m, ov);
                    a.round(if d == dlocal { el } else { d.exp() }, ov)
                };
                computed.push(t);
                model.push(el);
            }
        }
        Numerators { computed, model }
    }

    /// Row `r` (of `n` elements).
    fn row(&self, r: usize, n: usize) -> RowNumerators<'_> {
        RowNumerators {
            computed: &self.computed[r * n..(r + 1) * n],
            model: &self.model[r * n..(r + 1) * n],
        }
    }
}

/// A softmax threshold's input, validated: the values in the input format, the row length,
/// and the numerators where both sides compute them alike.
struct Prepared {
    xi: Tensor,
    n: usize,
    numerators: Option<Numerators>,
}

/// One side's statistics of one row; `den`, when given, is the standard form's denominator
/// error already priced (by the fast path, for every row at once); `nums`, the row's
/// numerators as this side computes them, when computed already; `variances`, whether the
/// numerators' variances are wanted (they are left 0 where both sides share the numerators,
/// whose errors cancel).
fn side_row(
    row: &[f64],
    policy: &Policy,
    imp: AttentionImpl,
    den: Option<ReductionError>,
    nums: Option<RowNumerators>,
    variances: bool,
) -> Result<SideRow> {
    let a = policy.accumulator();
    let n = row.len();
    let m = row.iter().fold(f64::NEG_INFINITY, |x, &y| x.max(y));
    let acc = denominator_accumulation(policy);
    let block = match imp {
        AttentionImpl::Standard => n,
        AttentionImpl::Online { block } => block.max(1),
    };
    let mut num_var = vec![0.0; n];
    let mut num_max = vec![0.0; n];
    let mut e = vec![0.0; n]; // exact model numerators exp(x − m)
    let mut block_terms = vec![]; // l_B · f_B, exact
    let mut computed_terms = vec![]; // ra(l̂_B · f̂_B), as the side computes them
    let mut standard_terms = vec![]; // the computed numerators, standard form
    let mut factors = std::collections::BTreeMap::new();
    let mut den_var_abs = 0.0;
    let mut den_max_abs = 0.0;
    let mut den_mean_abs = 0.0;
    let mut den_tie_abs = 0.0;
    let u = a.unit_roundoff();
    for (bi, chunk) in row.chunks(block).enumerate() {
        let base = bi * block;
        let mb = chunk.iter().fold(f64::NEG_INFINITY, |x, &y| x.max(y));
        let online = block < n;
        if (mb - m).exp() == 0.0 {
            // A masked block (every element −∞) or one so far below the row's maximum that
            // its factor underflows: both sides compute exact zeros for it, which add nothing.
            continue;
        }
        // Factor f_B = exp(m_B − m): rounding of the difference (absolute → relative) and of exp.
        let (fvar, fmax) = if online {
            let (dv, dm) = rounding_stats(a, mb - m);
            let fb = (mb - m).exp();
            let (ev, em) = rounding_stats(a, fb);
            (dv + ev / (fb * fb), dm + em / fb + u * 1e-3)
        } else {
            (0.0, 0.0)
        };
        let fb = (mb - m).exp();
        let mut block_e = Vec::with_capacity(chunk.len());
        // The numerators as the side computes them (their own errors are the nᵢ above): the
        // terms its sums add, unless the standard form's one sum is priced already.
        let ov = policy.accumulation.overflow;
        // The standard form's numerators computed already (`Numerators`), when given.
        let nums = nums.filter(|_| !online);
        let computed = match nums {
            _ if !online && den.is_some() => vec![],
            Some(nums) => nums.computed.to_vec(),
            None => computed_numerators(chunk, mb, policy),
        };
        for (j, &x) in chunk.iter().enumerate() {
            let i = base + j;
            let dlocal = x - mb;
            let el = match nums {
                Some(nums) => nums.model[i],
                None => dlocal.exp(),
            };
            if el == 0.0 || el * fb == 0.0 {
                // Masked (−∞) or underflowed even in f64 (a −1e4 additive mask): an exact zero
                // numerator on both sides (exp of an argument below −745 is 0).
                block_e.push(0.0);
                continue;
            }
            let (dv, dm) = rounding_stats(a, dlocal);
            let (ev, em) = rounding_stats(a, el);
            let mut v = if variances { dv + ev / (el * el) } else { 0.0 };
            // libm's exp is faithful: allow half an f64 ulp more in the bound.
            let mut mx = dm + em / el + f64::EPSILON;
            if online {
                let prod = el * fb;
                let (pv, pm) = rounding_stats(a, prod);
                // The factor's own error (fvar) is shared by the block: priced in `factors`.
                if variances {
                    v += pv / (prod * prod);
                }
                mx += fmax + pm / prod;
            }
            num_var[i] = v;
            num_max[i] = mx;
            e[i] = el * fb;
            if online {
                block_e.push(el);
            }
        }
        if online {
            // The block sum in the side's order, then the product l_B·f_B (rounded) is added.
            let eb = reduction_error(&computed, &acc, false)?;
            let lb: f64 = block_e.iter().sum();
            den_var_abs += eb.variance * fb * fb;
            let f = factors.entry(mb.to_bits()).or_insert((fvar, 0.0, 0.0));
            f.0 = f.0.max(fvar);
            f.1 += lb * fb;
            f.2 += block_e.iter().map(|el| (el * fb).powi(2)).sum::<f64>();
            den_mean_abs += eb.mean * fb;
            den_tie_abs += eb.tie_bound * fb;
            den_max_abs += eb.guaranteed * fb + fmax * lb * fb;
            block_terms.push(lb * fb);
            let f_hat = a.round(a.add_rounded(mb, -m, ov).exp(), ov);
            computed_terms.push(a.round(crate::order::sum(&computed, &acc)? * f_hat, ov));
        } else {
            standard_terms = computed;
        }
    }
    let s: f64 = e.iter().sum();
    if block < n {
        // l = Σ_B ra(l̂_B·f̂_B) added sequentially in A: the additions' errors on the terms the
        // side really adds (the products as computed; their own errors — block sums, factors,
        // product roundings — are priced above and below), so absorptions and roundings the
        // data determine are carried exactly, as in the standard form; plus one rounding of
        // each product.
        let outer = Accumulation::new(a, a, Order::Sequential);
        let eo = reduction_error(&computed_terms, &outer, false)?;
        let prod_var: f64 = block_terms.iter().map(|&t| rounding_stats(a, t).0).sum();
        let prod_max: f64 = block_terms.iter().map(|&t| rounding_stats(a, t).1).sum();
        den_var_abs += eo.variance + prod_var;
        den_mean_abs += eo.mean;
        den_tie_abs += eo.tie_bound;
        den_max_abs += eo.guaranteed + prod_max;
    } else {
        let es = match den {
            Some(es) => es,
            None => reduction_error(&standard_terms, &acc, false)?,
        };
        den_var_abs += es.variance;
        den_mean_abs += es.mean;
        den_tie_abs += es.tie_bound;
        den_max_abs += es.guaranteed;
    }
    let p: Vec<f64> = e.iter().map(|v| v / s).collect();
    Ok(SideRow {
        p: Rc::new(p),
        num_var: Rc::new(num_var),
        num_max: Rc::new(num_max),
        den_var: den_var_abs / (s * s),
        den_max: den_max_abs / s,
        den_mean: den_mean_abs / s,
        den_tie: den_tie_abs / s,
        factors: factors
            .into_iter()
            .map(|(k, (v, w, p2))| (k, (v, w / s, p2 / (s * s))))
            .collect(),
        sum: s,
    })
}

/// Threshold for softmax along the last dimension of `x`, computed under `reference` with the
/// form `ref_impl` and under `candidate` with `cand_impl` (standard, or online with a block
/// size). Both sides must read the same inputs in the same input format and accumulate in the
/// same format (different orders and output formats are allowed).
///
/// A probabilistic threshold is checked first by the engine's executions of both sides: where
/// their difference exceeds the model's threshold at δ_s = min(δ, 10⁻³) (the norm or one
/// element), the data carry structure the model does not capture and the guaranteed threshold
/// is returned, its `confidence` saying so (papers/bounds-reductions.md §4).
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{softmax_threshold, Confidence};
/// use ttrace::engine::AttentionImpl;
/// use ttrace::{Format, Policy, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// let x = Tensor::rounded(&[2, 128], (0..256).map(|i| 3.0 * (i as f64 * 0.7).sin()).collect(),
///     Format::BF16, ttrace::Overflow::Saturating)?;
/// let p: Policy = "in=bf16,acc=f32,out=bf16".parse()?;
/// // The standard softmax against the online (flash-style) one in blocks of 32.
/// let t = softmax_threshold(&x, &p, AttentionImpl::Standard, &p,
///     AttentionImpl::Online { block: 32 }, Confidence::default_probabilistic())?;
/// assert!(t.relative > 0.0);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidParameter`] for sides that differ in input or accumulator format, an
/// invalid block size, policy or confidence; [`Error::NoFiniteBound`] for a row masked
/// entirely (its softmax is 0/0); [`Error::Overflow`] when a rounding may overflow.
pub fn softmax_threshold(
    x: &Tensor,
    reference: &Policy,
    ref_impl: AttentionImpl,
    candidate: &Policy,
    cand_impl: AttentionImpl,
    confidence: Confidence,
) -> Result<Threshold> {
    let sides = ((reference, ref_impl), (candidate, cand_impl));
    let prepared = prepare(x, sides)?;
    let build = |conf| softmax_model(&prepared, sides, conf);
    checked_by_executions(confidence, &build, &|| {
        let (rs, cs) = (member_policies(reference), member_policies(candidate));
        match &prepared.numerators {
            // Every member computes the numerators the model computed: the engine's outputs
            // from them (`engine::nn::softmax_from_numerators`).
            Some(nums) if rs.iter().chain(&cs).all(|p| numerators_alike(p, reference)) => {
                let run = |ps: &[Policy]| -> Vec<Vec<f64>> {
                    ps.iter()
                        .map(|p| {
                            crate::engine::nn::softmax_from_numerators(
                                &nums.computed,
                                prepared.n,
                                p,
                            )
                        })
                        .collect()
                };
                Some((run(&rs), run(&cs)))
            }
            _ => executions(x, sides.0, sides.1),
        }
    })
}

/// The checks of [`softmax_threshold`]'s arguments, its input in the input format, and the
/// numerators when both sides compute them alike in the standard form.
fn prepare(
    x: &Tensor,
    ((reference, ref_impl), (candidate, cand_impl)): (
        (&Policy, AttentionImpl),
        (&Policy, AttentionImpl),
    ),
) -> Result<Prepared> {
    reference.validate()?;
    candidate.validate()?;
    if reference.input() != candidate.input() || reference.accumulator() != candidate.accumulator()
    {
        return Err(Error::InvalidParameter {
            name: "candidate",
            reason: "softmax thresholds are implemented for two sides with the same input and \
                     accumulator formats (orders, forms and output formats may differ)"
                .into(),
        });
    }
    let n = *x.shape().last().unwrap_or(&0);
    if n == 0 {
        return Err(Error::ShapeMismatch {
            what: "softmax threshold: needs a non-empty last dimension".into(),
            expected: vec![1],
            found: x.shape().to_vec(),
        });
    }
    let rows = x.len() / n;
    let xi = x.cast(
        reference.input(),
        reference.input_overflow(reference.input()),
    );
    for r in 0..rows {
        let row = &xi.values()[r * n..(r + 1) * n];
        // −∞ is a mask (an exact zero probability); NaN and +∞ have no softmax, and neither
        // has a row whose every element is masked (0/0).
        if let Some(&v) = row.iter().find(|v| v.is_nan() || **v == f64::INFINITY) {
            return Err(Error::NonFinite {
                what: format!("softmax threshold: row {r} of the input"),
                value: v,
            });
        }
        if row.iter().all(|&v| v == f64::NEG_INFINITY) {
            return Err(Error::NonFinite {
                what: format!(
                    "softmax threshold: row {r} is masked entirely (its softmax is 0/0); \
                     every row needs one finite element"
                ),
                value: f64::NEG_INFINITY,
            });
        }
    }
    let standard = (ref_impl, cand_impl) == (AttentionImpl::Standard, AttentionImpl::Standard);
    let numerators = (standard && numerators_alike(reference, candidate))
        .then(|| Numerators::of(xi.values(), n, reference));
    Ok(Prepared { xi, n, numerators })
}

/// Both sides' softmax as the engine executes them (for every member of a family), `None`
/// where it cannot (an engine error).
pub(crate) fn executions(
    x: &Tensor,
    (reference, ref_impl): (&Policy, AttentionImpl),
    (candidate, cand_impl): (&Policy, AttentionImpl),
) -> Option<Executions> {
    if (ref_impl, cand_impl) == (AttentionImpl::Standard, AttentionImpl::Standard) {
        // The standard form on both sides: their numerators computed once where alike.
        let (rs, cs) = (member_policies(reference), member_policies(candidate));
        let all: Vec<&Policy> = rs.iter().chain(&cs).collect();
        let mut y: Vec<Vec<f64>> = crate::engine::nn::softmax_each(x, &all)
            .ok()?
            .into_iter()
            .map(Tensor::into_values)
            .collect();
        let c = y.split_off(rs.len());
        return Some((y, c));
    }
    each_member((reference, candidate), |cand, p| {
        let y = match if cand { cand_impl } else { ref_impl } {
            AttentionImpl::Standard => crate::engine::softmax(x, p),
            AttentionImpl::Online { block } => crate::engine::online_softmax(x, block, p),
        };
        y.ok().map(Tensor::into_values)
    })
}

/// [`softmax_threshold`] as the model prices it (not checked by the executions).
fn softmax_model(
    prepared: &Prepared,
    ((reference, ref_impl), (candidate, cand_impl)): (
        (&Policy, AttentionImpl),
        (&Policy, AttentionImpl),
    ),
    confidence: Confidence,
) -> Result<Threshold> {
    let (xi, n) = (&prepared.xi, prepared.n);
    let rows = xi.len() / n;
    let identical = reference.same_execution(candidate) && ref_impl == cand_impl;
    let shared_numerators = ref_impl == cand_impl;
    let a = reference.accumulator();
    // (The rows were checked in `prepare`.)
    // Identical rows differ identically, and so do the elements of a row with the same logit
    // in the same block of each side's form (their numerators, probabilities and trailing
    // roundings are the same computations): one component each, with its multiplicity.
    // An element's numerator is computed from its logit and its block's maximum: equal pairs
    // give equal numerators (and equal rounding errors) on that side.
    let block_maxima = |row: &[f64], imp: AttentionImpl| -> Vec<u64> {
        let b = match imp {
            AttentionImpl::Standard => row.len(),
            AttentionImpl::Online { block } => block.max(1),
        };
        row.chunks(b)
            .flat_map(|c| {
                let m = c.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v)).to_bits();
                std::iter::repeat_n(m, c.len())
            })
            .collect()
    };
    let (_, classes) = row_classes(xi.values(), n);
    // The output roundings, decided once for every element.
    let outputs = GuaranteedRounding::new((a, a), (reference.output, candidate.output));
    let same_numerators = reference.accumulation.overflow == candidate.accumulation.overflow;
    let nums = prepared.numerators.as_ref();
    let dens = fast_denominators(
        xi,
        (n, nums),
        &classes,
        reference,
        candidate,
        (ref_impl, cand_impl),
        confidence,
    )?;
    // Each class of rows priced alone (in parallel; folded in order below, so that the
    // threshold does not depend on the number of threads): its Σ p² and its components.
    type Priced = (f64, ThresholdSums);
    let indexed: Vec<(usize, (usize, usize))> = classes.iter().copied().enumerate().collect();
    let priced = crate::parallel::map(&indexed, |&(class, (r, count))| -> Result<Priced> {
        // The class's components folded into sums of its own (merged in class order below):
        // no list of a component per element is kept.
        let mut groups = ThresholdSums::new(confidence, rows * n);
        let row = &xi.values()[r * n..(r + 1) * n];
        let (den_r, den_c) = dens[class].map_or((None, None), |(r, c)| (Some(r), Some(c)));
        let row_nums = nums.map(|nums| nums.row(r, n));
        // The numerators' own variances cancel where both sides share them.
        let variances = !shared_numerators;
        let sr = side_row(row, reference, ref_impl, den_r, row_nums, variances)?;
        let sc = match den_c {
            // Priced by the pass: the same numerators on both sides (`fast_denominators`).
            Some(es) if same_numerators => sr.with_denominator(es),
            _ => side_row(row, candidate, cand_impl, den_c, row_nums, variances)?,
        };
        let p_sq: f64 = sr.p.iter().map(|p| p * p).sum();
        if identical {
            return Ok((p_sq, groups));
        }
        // Alike elements: the same logit under the same block maximum on each side (the
        // row's on both in the standard form, where the logit alone is the key).
        let order = if (ref_impl, cand_impl) == (AttentionImpl::Standard, AttentionImpl::Standard) {
            let words: Vec<u64> = row.iter().map(|v| v.to_bits()).collect();
            crate::bounds::keyed::classes_of_words(&words)
        } else {
            let (max_r, max_c) = (block_maxima(row, ref_impl), block_maxima(row, cand_impl));
            alike_elements(row.len(), |j| (row[j].to_bits(), max_r[j], max_c[j]))
        };
        // Denominator terms, common to the row; alike numerators err alike (coherently).
        let (mut dvar, mut dmax) = (sr.den_var + sc.den_var, sr.den_max + sc.den_max);
        if !shared_numerators {
            for &(j, same) in &order {
                let pj = sr.p[j] * same as f64;
                dvar += pj * pj * (sr.num_var[j] + sc.num_var[j]);
                dmax += pj * (sr.num_max[j] + sc.num_max[j]);
            }
        }
        let inflate = if dmax < 0.5 {
            1.0 / (1.0 - dmax)
        } else {
            f64::INFINITY
        };
        groups.add_group(
            &ElementDiff {
                proxy: dvar * p_sq,
                guaranteed: dmax * p_sq.sqrt() * inflate,
                spread: true,
                ..ElementDiff::default()
            },
            count,
        );
        // Each block factor's rounding moves its blocks' elements (Σ p² over them) and their
        // share w of the denominator (w·p for every element), coherently.
        for side in [&sr, &sc] {
            for &(fv, w, p2) in side.factors.values() {
                let reach = p2.sqrt() + w * p_sq.sqrt();
                groups.add_group(
                    &ElementDiff {
                        proxy: fv * reach * reach,
                        spread: true,
                        ..ElementDiff::default()
                    },
                    count,
                );
            }
        }
        for &(j, same) in &order {
            let p = sr.p[j];
            if p == 0.0 && sc.p[j] == 0.0 {
                // Masked on both sides: exactly zero.
                continue;
            }
            let (nv, nm) = if shared_numerators {
                (0.0, 0.0)
            } else {
                (
                    p * p * (sr.num_var[j] + sc.num_var[j]),
                    p * (sr.num_max[j] + sc.num_max[j]),
                )
            };
            // The first-order model's remainder: each side's (1 + n)/(1 + σ) − (1 + n − σ)
            // and the cross terms of the two sides are at most (|n| + |σ|)²/(1 − |σ|) of p, a
            // deterministic part of unknown sign (visible where BF16 partial sums make σ
            // ~2⁻⁹: a two-class row, vocabulary-parallel, erred beyond the first-order
            // bound in 329 of 3,000 trials without it).
            let second = p * (dmax + sr.num_max[j] + sc.num_max[j]).powi(2) * inflate;
            let mut d = ElementDiff {
                offset: p * (sr.den_mean - sc.den_mean),
                bias_bound: p * (sr.den_tie + sc.den_tie) + second,
                proxy: nv,
                guaranteed: (nm + p * dmax) * inflate,
                ..ElementDiff::default()
            };
            // The row's denominator part enters E|Δ| of this element's trailing roundings.
            let row_part = p * p * dvar;
            d.proxy += row_part;
            d.round_both(a, p);
            outputs.round(&mut d, p);
            d.proxy -= row_part;
            d.shared_proxy = row_part;
            groups.add_group(&d, same * count);
        }
        Ok((p_sq, groups))
    });
    // Merged class by class in order: the same threshold on any number of threads.
    let mut sums = ThresholdSums::new(confidence, rows * n);
    let mut norm_sq = 0.0;
    for (item, &(_, count)) in priced.into_iter().zip(&classes) {
        let (p_sq, part) = item?;
        norm_sq += p_sq * count as f64;
        sums.merge(&part);
    }
    if identical {
        return Ok(Threshold::identical(confidence, norm_sq.sqrt(), rows * n));
    }
    Ok(sums.threshold(norm_sq.sqrt()))
}

/// The classes of `n` elements by `key`: each class's first element and its size, in order of
/// first appearance.
fn alike_elements<K: std::hash::Hash + Eq>(
    n: usize,
    key: impl Fn(usize) -> K,
) -> Vec<(usize, usize)> {
    let mut alike: crate::bounds::keyed::DataMap<K, usize> =
        crate::bounds::keyed::DataMap::with_capacity_and_hasher(n, Default::default());
    let mut order: Vec<(usize, usize)> = vec![];
    for j in 0..n {
        let next = order.len();
        let g = *alike.entry(key(j)).or_insert(next);
        if g == next {
            order.push((j, 0));
        }
        order[g].1 += 1;
    }
    order
}

/// Elements whose numerators [`fast_denominators`] holds at once (8 bytes each, and about as
/// much again in the pass's packed copy): larger tensors are priced in chunks of rows.
const FAST_CHUNK: usize = 1 << 22;

/// The standard form's denominators of the classes of rows priced by the fast path
/// (papers/bounds-reductions.md §5.1), when both sides compute the same numerators (the
/// standard form on both, the same accumulator) and sum them in FP32: per class, the
/// reference's and the candidate's reduction errors, or `None` for a class the walk prices —
/// every class when the sides are not of that kind, the classes of a chunk of rows (at most
/// [`FAST_CHUNK`] elements, or one row) when the fast path does not apply to them or their
/// sums fail its structure test.
fn fast_denominators(
    x: &Tensor,
    (n, nums): (usize, Option<&Numerators>),
    classes: &[(usize, usize)],
    reference: &Policy,
    candidate: &Policy,
    imps: (AttentionImpl, AttentionImpl),
    confidence: Confidence,
) -> Result<Vec<Option<(ReductionError, ReductionError)>>> {
    let sides = (reference, candidate);
    fast_denominators_in(x, (n, nums), classes, sides, imps, confidence, FAST_CHUNK)
}

/// [`fast_denominators`] in chunks of at most `chunk` elements (or one row).
fn fast_denominators_in(
    x: &Tensor,
    (n, nums): (usize, Option<&Numerators>),
    classes: &[(usize, usize)],
    (reference, candidate): (&Policy, &Policy),
    imps: (AttentionImpl, AttentionImpl),
    confidence: Confidence,
    chunk: usize,
) -> Result<Vec<Option<(ReductionError, ReductionError)>>> {
    let mut dens = vec![None; classes.len()];
    let standard = imps == (AttentionImpl::Standard, AttentionImpl::Standard);
    if !standard || reference.same_execution(candidate) || n == 0 {
        return Ok(dens);
    }
    let probabilistic = matches!(confidence, Confidence::Probabilistic { .. });
    let accs = (
        &denominator_accumulation(reference),
        &denominator_accumulation(candidate),
    );
    // The same accumulator (required) and overflow compute the same numerators.
    let same = reference.accumulation.overflow == candidate.accumulation.overflow;
    let per_chunk = (chunk / n).max(1);
    'chunks: for (c, chunk) in classes.chunks(per_chunk).enumerate() {
        let mut terms = Vec::with_capacity(chunk.len() * n);
        for &(r, _) in chunk {
            let row = &x.values()[r * n..(r + 1) * n];
            let m = row.iter().fold(f64::NEG_INFINITY, |x, &y| x.max(y));
            let tr = match nums {
                Some(nums) => nums.row(r, n).computed,
                None => &computed_numerators(row, m, reference)[..],
            };
            if !same && computed_numerators(row, m, candidate) != tr {
                continue 'chunks;
            }
            terms.extend_from_slice(tr);
        }
        if let Some(priced) = crate::bounds::fast::sum_rows(&terms, n, accs, probabilistic)? {
            for (slot, p) in dens[c * per_chunk..].iter_mut().zip(priced) {
                *slot = Some(p);
            }
        }
    }
    Ok(dens)
}

/// `softmax` in the op registry: along the last dimension of `x`, each side in its form
/// ([`OpSide::form`]: standard or online/flash with its block); threshold
/// [`softmax_threshold`]; gain the largest probability (first order,
/// [`softmax_gain`](crate::bounds::softmax_gain)), on the probabilities computed in f64.
#[derive(Debug, Clone, Copy)]
pub struct SoftmaxModel;

impl OpModel for SoftmaxModel {
    fn threshold(
        &self,
        inputs: &[&Tensor],
        reference: &OpSide,
        candidate: &OpSide,
        _: &OpOptions,
        confidence: Confidence,
    ) -> Result<Threshold> {
        softmax_threshold(
            inputs[0],
            &reference.policy,
            reference.form,
            &candidate.policy,
            candidate.form,
            confidence,
        )
    }

    fn gain(&self, inputs: &[&Tensor], _: &OpOptions) -> Result<Gain> {
        let x = inputs[0];
        let k = x.shape().last().copied().unwrap_or(1).max(1);
        let mut p = Vec::with_capacity(x.len());
        for row in x.values().chunks(k) {
            let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let e: Vec<f64> = row.iter().map(|v| (v - m).exp()).collect();
            let s: f64 = e.iter().sum();
            p.extend(e.into_iter().map(|v| v / s));
        }
        Ok(crate::bounds::softmax_gain(&Tensor::from_parts_unchecked(
            x.shape(),
            p,
            Format::F64,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::SplitMix64;

    /// The numerators a threshold computes once are the engine's, value for value, and the
    /// outputs computed from them are the engine's softmax bit for bit: FP32 logits whose
    /// differences from the row's maximum round in FP32 (2⁴⁰ apart, so that the `exp` of the
    /// rounded difference is not the model's), masks, BF16 and FP16 logits, outputs in BF16,
    /// saturating accumulation, orders of every kind.
    #[test]
    fn numerators_computed_once_are_the_engines() {
        let mut g = SplitMix64::for_name("softmax_numerators", 0);
        let (rows, n) = (6, 97);
        for (input, spread) in [
            (Format::F32, 1.0),
            (Format::F32, 1e12),
            (Format::BF16, 3.0),
            (Format::F16, 8.0),
        ] {
            let v: Vec<f64> = (0..rows * n)
                .map(|i| match i % 11 {
                    3 => f64::NEG_INFINITY,
                    // A tiny value beside the large ones: x − m rounds in FP32.
                    5 => input.round(g.normal() * 1e-3, Overflow::Saturating),
                    _ => input.round(spread * g.normal(), Overflow::Saturating),
                })
                .collect();
            let x = Tensor::from_vec(&[rows, n], v, input).unwrap();
            for (out, order, overflow) in [
                (Format::F32, Order::Sequential, Overflow::NonSaturating),
                (
                    Format::BF16,
                    Order::Pairwise { base: 8 },
                    Overflow::Saturating,
                ),
                (Format::F32, Order::blocked(16), Overflow::NonSaturating),
            ] {
                let mut p = Policy::new(input, Format::F32, out).with_order(order.clone());
                p.accumulation.overflow = overflow;
                let xi = x.cast(input, p.input_overflow(input));
                let nums = Numerators::of(xi.values(), n, &p);
                let ar = crate::policy::arith::Arith::new(p.accumulator(), p.output, overflow);
                let mut engine = vec![0.0; n];
                for (r, row) in xi.values().chunks(n).enumerate() {
                    let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                    crate::engine::nn::masked_exp(&ar, row, m, &mut engine);
                    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(nums.row(r, n).computed),
                        bits(&engine),
                        "{input} row {r}"
                    );
                    let model: Vec<f64> = row.iter().map(|&v| (v - m).exp()).collect();
                    assert_eq!(bits(nums.row(r, n).model), bits(&model));
                }
                let y = crate::engine::nn::softmax_from_numerators(&nums.computed, n, &p);
                let expected = crate::engine::softmax(&x, &p).unwrap().into_values();
                assert_eq!(
                    y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{input} {out} {order:?}"
                );
            }
        }
    }

    /// Each row's denominators are priced on their own, so a tensor priced in chunks of rows
    /// gets, class by class, what it gets priced whole (the chunks' bookkeeping), on rows
    /// where no chunk falls back to the walk; and every class is priced.
    #[test]
    fn denominators_priced_in_chunks_are_those_priced_whole() {
        let (rows, n) = (23, 256);
        let mut g = SplitMix64::for_name("softmax_chunks", 0);
        let mut v: Vec<f64> = (0..rows * n)
            .map(|_| Format::BF16.round(2.0 * g.normal(), Overflow::Saturating))
            .collect();
        // Two repeated rows: classes, not rows, are priced.
        v.copy_within(0..n, 5 * n);
        v.copy_within(n..2 * n, 17 * n);
        let x = Tensor::from_vec(&[rows, n], v, Format::BF16).unwrap();
        let (_, classes) = row_classes(x.values(), n);
        assert_eq!(classes.len(), rows - 2);
        let r = Policy::new(Format::BF16, Format::F32, Format::F32);
        let c = r.clone().with_order(Order::Pairwise { base: 8 });
        let std = (AttentionImpl::Standard, AttentionImpl::Standard);
        let conf = Confidence::default_probabilistic();
        let price =
            |chunk| fast_denominators_in(&x, (n, None), &classes, (&r, &c), std, conf, chunk);
        let whole = price(usize::MAX).unwrap();
        assert!(whole.iter().all(Option::is_some));
        for chunk in [1, n, 3 * n, 7 * n + 5] {
            let parts = price(chunk).unwrap();
            for (a, b) in whole.iter().zip(&parts) {
                let (a, b) = (a.unwrap(), b.unwrap());
                let bits = |e: ReductionError| {
                    [e.guaranteed, e.mean, e.variance, e.tie_bound].map(f64::to_bits)
                };
                assert_eq!(
                    (bits(a.0), bits(a.1)),
                    (bits(b.0), bits(b.1)),
                    "chunk {chunk}"
                );
            }
        }
    }
}

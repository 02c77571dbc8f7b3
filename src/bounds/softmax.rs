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

use crate::bounds::compare::{finish, Confidence, ElementDiff, Threshold};
use crate::bounds::ops::round_sides;
use crate::bounds::reduction::{random_rounding_error, reduction_error};
use crate::engine::attention::AttentionImpl;
use crate::engine::policy::Policy;
use crate::engine::tensor::Tensor;
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use crate::order::{Accumulation, Order};

/// Per-element and per-row error statistics of one side's softmax of one row.
struct SideRow {
    /// Exact-model probabilities pᵢ.
    p: Vec<f64>,
    /// Variance of the numerator's relative error nᵢ.
    num_var: Vec<f64>,
    /// Bound on |nᵢ|.
    num_max: Vec<f64>,
    /// Variance of the denominator's own relative error (excluding the numerators' share).
    den_var: f64,
    /// Bound on the denominator's own relative error.
    den_max: f64,
    /// Deterministic part (absorbed terms) of the denominator's relative error.
    den_mean: f64,
    /// Bound on the denominator's relative tie error (deterministic, unknown sign).
    den_tie: f64,
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

fn side_row(row: &[f64], policy: &Policy, imp: AttentionImpl) -> Result<SideRow> {
    let a = policy.accumulator();
    let n = row.len();
    let m = row.iter().fold(f64::NEG_INFINITY, |x, &y| x.max(y));
    let mut acc = policy.accumulation.clone();
    acc.input = a;
    let block = match imp {
        AttentionImpl::Standard => n,
        AttentionImpl::Online { block } => block.max(1),
    };
    let mut num_var = vec![0.0; n];
    let mut num_max = vec![0.0; n];
    let mut e = vec![0.0; n]; // exact model numerators exp(x − m)
    let mut block_terms = vec![]; // l_B · f_B, exact
    let mut standard_terms = vec![]; // the computed numerators, standard form
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
        // The numerators as the side computes them, ra(exp(ra(x − m_B))): the terms its sum
        // really adds (their own errors are the nᵢ above).
        let ov = policy.accumulation.overflow;
        let computed: Vec<f64> = chunk
            .iter()
            .map(|&x| {
                if x == f64::NEG_INFINITY {
                    0.0
                } else {
                    a.round(a.add_rounded(x, -mb, ov).exp(), ov)
                }
            })
            .collect();
        for (j, &x) in chunk.iter().enumerate() {
            let i = base + j;
            let dlocal = x - mb;
            let el = dlocal.exp();
            if el == 0.0 || el * fb == 0.0 {
                // Masked (−∞) or underflowed even in f64 (a −1e4 additive mask): an exact zero
                // numerator on both sides (exp of an argument below −745 is 0).
                block_e.push(0.0);
                continue;
            }
            let (dv, dm) = rounding_stats(a, dlocal);
            let (ev, em) = rounding_stats(a, el);
            let mut v = dv + ev / (el * el);
            // libm's exp is faithful: allow half an f64 ulp more in the bound.
            let mut mx = dm + em / el + f64::EPSILON;
            if online {
                let prod = el * fb;
                let (pv, pm) = rounding_stats(a, prod);
                v += fvar + pv / (prod * prod);
                mx += fmax + pm / prod;
            }
            num_var[i] = v;
            num_max[i] = mx;
            e[i] = el * fb;
            block_e.push(el);
        }
        if !online {
            standard_terms = computed.clone();
        }
        if online {
            // The block sum in the side's order, then the product l_B·f_B (rounded) is added.
            let eb = reduction_error(&computed, &acc, false)?;
            let lb: f64 = block_e.iter().sum();
            den_var_abs += eb.variance * fb * fb + fvar * (lb * fb).powi(2);
            den_mean_abs += eb.mean * fb;
            den_tie_abs += eb.tie_bound * fb;
            den_max_abs += eb.guaranteed * fb + fmax * lb * fb;
            block_terms.push(lb * fb);
        }
    }
    let s: f64 = e.iter().sum();
    if block < n {
        // l = Σ_B fl(l_B·f_B) added sequentially in A: the additions' errors, plus one rounding
        // of each product (counted for every block, the first included, to stay on the safe
        // side of the walker's load rounding).
        let outer = Accumulation::new(Format::F64, a, Order::Sequential);
        // Its terms are computed values the model knows only approximately: all-random model.
        let eo = random_rounding_error(&block_terms, &outer, false)?;
        let prod_var: f64 = block_terms.iter().map(|&t| rounding_stats(a, t).0).sum();
        let prod_max: f64 = block_terms.iter().map(|&t| rounding_stats(a, t).1).sum();
        den_var_abs += eo.variance + prod_var;
        den_mean_abs += eo.mean;
        den_tie_abs += eo.tie_bound;
        den_max_abs += eo.guaranteed + prod_max;
    } else {
        let es = reduction_error(&standard_terms, &acc, false)?;
        den_var_abs += es.variance;
        den_mean_abs += es.mean;
        den_tie_abs += es.tie_bound;
        den_max_abs += es.guaranteed;
    }
    let p: Vec<f64> = e.iter().map(|v| v / s).collect();
    Ok(SideRow {
        p,
        num_var,
        num_max,
        den_var: den_var_abs / (s * s),
        den_max: den_max_abs / s,
        den_mean: den_mean_abs / s,
        den_tie: den_tie_abs / s,
    })
}

/// Threshold for softmax along the last dimension of `x`, computed under `reference` with the
/// form `ref_impl` and under `candidate` with `cand_impl` (standard, or online with a block
/// size). Both sides must read the same inputs in the same input format and accumulate in the
/// same format (different orders and output formats are allowed).
pub fn softmax_threshold(
    x: &Tensor,
    reference: &Policy,
    ref_impl: AttentionImpl,
    candidate: &Policy,
    cand_impl: AttentionImpl,
    confidence: Confidence,
) -> Result<Threshold> {
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
    let identical = reference == candidate && ref_impl == cand_impl;
    let shared_numerators = ref_impl == cand_impl;
    let a = reference.accumulator();
    let mut diffs = Vec::with_capacity(rows * (n + 1));
    let mut norm_sq = 0.0;
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
        let sr = side_row(row, reference, ref_impl)?;
        let sc = side_row(row, candidate, cand_impl)?;
        let p_sq: f64 = sr.p.iter().map(|p| p * p).sum();
        norm_sq += p_sq;
        if identical {
            continue;
        }
        // Denominator terms, common to the row.
        let (mut dvar, mut dmax) = (sr.den_var + sc.den_var, sr.den_max + sc.den_max);
        if !shared_numerators {
            for j in 0..n {
                let pj = sr.p[j];
                dvar += pj * pj * (sr.num_var[j] + sc.num_var[j]);
                dmax += pj * (sr.num_max[j] + sc.num_max[j]);
            }
        }
        let inflate = if dmax < 0.5 {
            1.0 / (1.0 - dmax)
        } else {
            f64::INFINITY
        };
        diffs.push(ElementDiff {
            proxy: dvar * p_sq,
            guaranteed: dmax * p_sq.sqrt() * inflate,
            spread: true,
            ..ElementDiff::default()
        });
        for j in 0..n {
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
            let mut d = ElementDiff {
                offset: p * (sr.den_mean - sc.den_mean),
                bias_bound: p * (sr.den_tie + sc.den_tie),
                proxy: nv,
                guaranteed: (nm + p * dmax) * inflate,
                ..ElementDiff::default()
            };
            // The row's denominator part enters E|Δ| of this element's trailing roundings.
            let row_part = p * p * dvar;
            d.proxy += row_part;
            d.round_both(a, p);
            round_sides(&mut d, (a, a), (reference.output, candidate.output), p);
            d.proxy -= row_part;
            diffs.push(d);
        }
    }
    Ok(finish(
        &diffs,
        norm_sq.sqrt(),
        confidence,
        identical,
        rows * n,
    ))
}

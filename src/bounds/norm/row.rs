//! One side's error model of one normalized row (papers/bounds-norm.md): the mean, the
//! variance (two-pass, one-pass or Welford), rstd and the elements, each rounding's variance
//! and bound, and the rows whose roundings the data determine exactly.

use super::NormOp;
use crate::bounds::reduction::{
    reduction_error, reduction_error_within, RandomModel, ReductionError,
};
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use crate::policy::arith::Arith;
use crate::policy::Policy;
use crate::policy::Variance;

/// Variance and bound of the rounding to `f` of a computed value known to lie within `b` of
/// the exact `v`: exact only when nothing is uncertain and `v` lies on the grid.
pub(super) fn rounding_within(f: Format, v: f64, b: f64) -> (f64, f64) {
    if b == 0.0 && f.round(v, Overflow::NonSaturating) == v {
        return (0.0, 0.0);
    }
    let ulp = f.ulp(v.abs() + b).unwrap_or(f64::INFINITY);
    (ulp * ulp / 12.0, ulp / 2.0)
}

/// The computed value of a reduction whose every rounding the walk determines (no random
/// part), when that pins it to one point of its result grid `rf`: the exact sum plus the
/// determined error lies within half a spacing of that point, with room for the ties of
/// unknown direction and the f64 sum of the determined errors.
pub(super) fn determined_value(
    exact: f64,
    e: &ReductionError,
    rf: Format,
    ov: Overflow,
) -> Option<f64> {
    if e.variance != 0.0 {
        return None;
    }
    let c = exact + e.mean;
    let s_hat = rf.round(c, ov);
    let below = rf
        .ulp(s_hat.abs() * (1.0 - 2.0 * rf.unit_roundoff()))
        .unwrap_or(0.0);
    let slack = e.tie_bound + c.abs() * 4.0 * f64::EPSILON;
    (s_hat.is_finite() && (c - s_hat).abs() + slack < below / 2.0).then_some(s_hat)
}

/// Whether values of `f` have at most 26 significant bits, so that the product of two of them
/// is exact in `f64` (every format up to FP32).
pub(super) fn narrow(f: Format) -> bool {
    f.unit_roundoff() >= 2f64.powi(-26)
}

/// One side's sums priced by the all-random model compiled for the row length
/// ([`Pricing::Fast`](crate::bounds::Pricing::Fast)): every rounding that is not exact is
/// random, none is determined from the data (the walk's determined roundings are not
/// followed), and a mean or variance counts as known only where every rounding of its sum is
/// exact.
pub(super) struct FastSums {
    /// The sum of the row (LayerNorm's mean).
    mean: Option<RandomModel>,
    /// The sum of the squares (the variance, RMSNorm's mean square).
    squares: Option<RandomModel>,
}

impl FastSums {
    /// The models of `policy`'s sums for `op` over rows of `n` values, or `None` where one
    /// is outside the compiled model (Kahan's order, families, tensor cores: the walk prices
    /// them).
    pub(super) fn new(op: NormOp, policy: &Policy, n: usize) -> Option<FastSums> {
        let model = |input, is_dot| {
            let mut acc = policy.accumulation.clone();
            acc.input = input;
            RandomModel::new(&acc, n, is_dot).ok().flatten()
        };
        let a = policy.accumulator();
        let mut fast = FastSums {
            mean: None,
            squares: None,
        };
        match op {
            NormOp::LayerNorm(Variance::Welford) => {}
            NormOp::LayerNorm(Variance::TwoPass) => {
                fast.mean = Some(model(policy.input(), false)?);
                fast.squares = Some(model(a, true)?);
            }
            NormOp::LayerNorm(Variance::OnePass) => {
                fast.mean = Some(model(policy.input(), false)?);
                fast.squares = Some(model(policy.input(), true)?);
            }
            NormOp::RmsNorm => fast.squares = Some(model(policy.input(), true)?),
        }
        Some(fast)
    }
}

/// The statistics of a sum of `terms` (within `radii`): the compiled model's where `model` is
/// given, else the walk's (`acc`, `is_dot`).
fn sum_error(
    model: Option<&RandomModel>,
    terms: &[f64],
    radii: &[f64],
    acc: &crate::order::Accumulation,
    is_dot: bool,
) -> Result<ReductionError> {
    match model {
        Some(m) => m.error_within(terms, radii),
        None if radii.is_empty() => reduction_error(terms, acc, is_dot),
        None => reduction_error_within(terms, radii, acc, is_dot),
    }
}

/// Whether every rounding a model priced was exact (no random, determined or tie part).
fn all_exact(e: &ReductionError) -> bool {
    e.variance == 0.0 && e.mean == 0.0 && e.tie_bound == 0.0
}

/// One side's statistics for one row.
pub(super) struct SideRow {
    /// The exact model mean (0 for RMSNorm).
    pub(super) mu: f64,
    /// The side's computed dᵢ = ra(xᵢ − μ̂), when its μ̂ is determined.
    pub(super) d_hat: Option<Vec<f64>>,
    /// The side's computed x̂ source (d̂ᵢ, or xᵢ for RMSNorm) and rstd, when every rounding
    /// before them is determined: the side's output is then known exactly.
    pub(super) exact: Option<(Vec<f64>, f64)>,
    pub(super) mu_tie: f64,
    pub(super) rho_tie: f64,
    pub(super) mu_var: f64,
    pub(super) mu_max: f64,
    pub(super) mu_mean: f64,
    pub(super) rho_var: f64,
    pub(super) rho_max: f64,
    pub(super) rho_mean: f64,
    /// Per element: variance and bound of the rounding of dᵢ (absolute).
    pub(super) d_var: Vec<f64>,
    pub(super) d_max: Vec<f64>,
    /// Per element: |d̂ᵢ − dᵢ| at most (the mean's error and the dᵢ rounding; 0 for RMSNorm).
    pub(super) e_max: Vec<f64>,
}

/// A side whose output is known exactly: no statistics, the computed x̂ sources and rstd.
pub(super) fn exact_side(mu: f64, n: usize, src: Vec<f64>, rstd: f64) -> SideRow {
    SideRow {
        mu,
        d_hat: None,
        exact: Some((src, rstd)),
        mu_tie: 0.0,
        rho_tie: 0.0,
        mu_var: 0.0,
        mu_max: 0.0,
        mu_mean: 0.0,
        rho_var: 0.0,
        rho_max: 0.0,
        rho_mean: 0.0,
        d_var: vec![0.0; n],
        d_max: vec![0.0; n],
        e_max: vec![0.0; n],
    }
}

/// One side's model of one row. `determine`: the side runs one kernel (no family of orders),
/// so roundings the data determine may be computed exactly. `fast`: the side's sums priced
/// by the compiled all-random model instead of the walk.
pub(super) fn side_row(
    x: &[f64],
    op: NormOp,
    eps: f64,
    policy: &Policy,
    determine: bool,
    fast: Option<&FastSums>,
) -> Result<SideRow> {
    let mean_model = fast.and_then(|f| f.mean.as_ref());
    let squares_model = fast.and_then(|f| f.squares.as_ref());
    // The walk's determined values are its own; the all-random model knows a sum only where
    // every rounding of it is exact.
    let known = |e: &ReductionError| fast.is_none() || all_exact(e);
    let a = policy.accumulator();
    let n = x.len() as f64;
    let mut acc_in = policy.accumulation.clone();
    acc_in.input = policy.input();
    let mut acc_a = policy.accumulation.clone();
    acc_a.input = a;
    let ov = policy.accumulation.overflow;
    let exact_sum = crate::exact::exact_sum(x);
    let mu = exact_sum / n;
    let centered = matches!(op, NormOp::LayerNorm(_));
    let (mut mu_var, mut mu_max, mut mu_mean, mut mu_tie) = (0.0, 0.0, 0.0, 0.0);
    // The side's μ̂ = ra(Ŝ/n), when every rounding of its sum is determined: then the dᵢ it
    // computes are known exactly too.
    let mut mu_hat = None;
    if centered && op != NormOp::LayerNorm(Variance::Welford) {
        let es = sum_error(mean_model, x, &[], &acc_in, false)?;
        mu_tie = es.tie_bound / n;
        // The division rounds the computed Ŝ/n, not the exact mean: exact only when the sum
        // is (a representable mean says nothing about Ŝ/n otherwise).
        let (rv, rm) = rounding_within(a, mu, es.guaranteed / n);
        mu_var = es.variance / (n * n) + rv;
        mu_max = es.guaranteed / n + rm;
        mu_mean = es.mean / n;
        let rf = acc_in.order.result_format(a);
        if let Some(s_hat) = determined_value(exact_sum, &es, rf, ov).filter(|_| known(&es)) {
            // Every rounding up to μ̂ is known: its error is a determined offset.
            let m = a.round(s_hat / n, ov);
            mu_hat = Some(m);
            (mu_var, mu_max, mu_mean, mu_tie) = (0.0, (m - mu).abs(), m - mu, 0.0);
        }
    }
    let d_hat: Option<Vec<f64>> =
        mu_hat.map(|m| x.iter().map(|&v| a.add_rounded(v, -m, ov)).collect());
    let d: Vec<f64> = x
        .iter()
        .map(|&v| if centered { v - mu } else { v })
        .collect();
    let mut d_var = vec![0.0; x.len()];
    let mut d_max = vec![0.0; x.len()];
    // The roundings of dᵢ = x − μ̂ for a μ̂ known within mu_max.
    let price_d = |mu_max: f64, d_var: &mut [f64], d_max: &mut [f64]| {
        for (i, &di) in d.iter().enumerate() {
            (d_var[i], d_max[i]) = rounding_within(a, di, mu_max);
        }
    };
    // The side's computed variance, when determined.
    let mut var_hat = None;
    let (var_exact, mut var_var, mut var_max, mut var_mean, var_tie);
    match op {
        NormOp::LayerNorm(Variance::TwoPass) if d_hat.is_some() => {
            // The side's dᵢ are known: var = ra(dot(d̂, d̂)/n) on its actual terms, and the
            // difference of Σd̂² from Σd² is a determined part of its error.
            let dh = d_hat.as_deref().unwrap_or(&[]);
            let sq: Vec<f64> = dh.iter().map(|v| v * v).collect();
            var_exact = d.iter().map(|v| v * v).sum::<f64>() / n;
            let shift = sq.iter().sum::<f64>() / n - var_exact;
            let ed = sum_error(squares_model, &sq, &[], &acc_a, true)?;
            if narrow(a) && known(&ed) {
                let rf = acc_a.order.result_format(a);
                var_hat = determined_value(crate::exact::exact_sum(&sq), &ed, rf, ov)
                    .map(|s| a.round(s / n, ov));
            }
            let (rv, rm) = rounding_within(a, var_exact + shift, ed.guaranteed / n);
            var_var = ed.variance / (n * n) + rv;
            var_max = ed.guaranteed / n + shift.abs() + rm;
            var_mean = ed.mean / n + shift;
            var_tie = ed.tie_bound / n + (var_exact.abs() + shift.abs()) * 8.0 * f64::EPSILON;
        }
        NormOp::LayerNorm(Variance::TwoPass) => {
            price_d(mu_max, &mut d_var, &mut d_max);
            let sq: Vec<f64> = d.iter().map(|v| v * v).collect();
            var_exact = sq.iter().sum::<f64>() / n;
            // The side squares its computed dᵢ, known within eᵢ = mu_max + d_maxᵢ: the walk on
            // the model's squares with radii (2|dᵢ| + eᵢ)·eᵢ determines the roundings that
            // round alike over them (squares added onto one outlier's all round the same way:
            // issue 34), the rest are random (the dᵢ roundings themselves are added below).
            let radii: Vec<f64> = d
                .iter()
                .zip(&d_max)
                .map(|(di, dm)| {
                    let e = mu_max + dm;
                    (2.0 * di.abs() + e) * e
                })
                .collect();
            let ed = sum_error(squares_model, &sq, &radii, &acc_a, true)?;
            var_var = ed.variance / (n * n);
            var_max = ed.guaranteed / n;
            var_mean = ed.mean / n;
            var_tie = ed.tie_bound / n;
            // The dᵢ roundings move the variance by (2dᵢ/n)·η, and dᵢ² by (2dᵢ + η)·η. Those
            // on the same grid with the same residue of xᵢ err alike: coherently per group.
            let mut coherent: std::collections::BTreeMap<(u64, u64), (f64, f64)> =
                Default::default();
            for (i, &di) in d.iter().enumerate() {
                var_max += (2.0 * di.abs() + d_max[i]) * d_max[i] / n;
                if d_var[i] > 0.0 {
                    let ulp = a.ulp(di).unwrap_or(0.0);
                    let residue = x[i] - ulp * (x[i] / ulp).floor();
                    let e = coherent
                        .entry((ulp.to_bits(), residue.to_bits()))
                        .or_insert((0.0, d_var[i]));
                    e.0 += 2.0 * di / n;
                }
            }
            // Coherent within a group, independent across groups; never below the
            // independent sum (a group's terms may also partly cancel in another order).
            let independent: f64 = d
                .iter()
                .zip(&d_var)
                .map(|(&di, &v)| (2.0 * di / n).powi(2) * v)
                .sum();
            let grouped: f64 = coherent.values().map(|(s, v)| s * s * v).sum();
            var_var += independent.max(grouped);
            // The division rounds the computed Σd̂²/n, within var_max of the exact variance.
            let (rv, rm) = rounding_within(a, var_exact, var_max);
            var_var += rv;
            var_max += rm;
        }
        NormOp::LayerNorm(Variance::OnePass) | NormOp::RmsNorm => {
            let sq: Vec<f64> = x.iter().map(|v| v * v).collect();
            let ms = sq.iter().sum::<f64>() / n;
            // dot(x, x): the exact products xᵢ², handled as the policy's products are.
            let ed = sum_error(squares_model, &sq, &[], &acc_in, true)?;
            let ms_hat = if narrow(policy.input()) && known(&ed) {
                let rf = acc_in.order.result_format(a);
                determined_value(crate::exact::exact_sum(&sq), &ed, rf, ov)
                    .map(|s| a.round(s / n, ov))
            } else {
                None
            };
            let (rv, rm) = rounding_within(a, ms, ed.guaranteed / n);
            var_var = ed.variance / (n * n) + rv;
            var_max = ed.guaranteed / n + rm;
            var_mean = ed.mean / n;
            var_tie = ed.tie_bound / n + 2.0 * mu.abs() * mu_tie;
            if centered {
                price_d(mu_max, &mut d_var, &mut d_max);
                let sq_max = 2.0 * mu.abs() * mu_max + mu_max * mu_max;
                let (qv, qm) = rounding_within(a, mu * mu, sq_max);
                var_var += 4.0 * mu * mu * mu_var + qv;
                var_max += sq_max + qm;
                var_mean -= 2.0 * mu * mu_mean;
                var_exact = ms - mu * mu;
                let (sv, sm) = rounding_within(a, var_exact, var_max);
                var_var += sv;
                var_max += sm;
                var_hat = match (ms_hat, mu_hat) {
                    (Some(ms), Some(m)) if narrow(a) => {
                        Some(a.add_rounded(ms, -a.round(m * m, ov), ov))
                    }
                    _ => None,
                };
            } else {
                var_exact = ms;
                var_hat = ms_hat;
            }
        }
        NormOp::LayerNorm(Variance::Welford) => {
            // Welford's updating form is one sequential recurrence whatever the order
            // ([`Variance::Welford`]): its μ̂ and M̂2 are computed as the engine computes them.
            // (A first-order random model of its roundings was 2–3× low on large-mean rows,
            // whose updates round alike step after step: issue 34.)
            let ar = Arith::new(a, policy.output, ov);
            let (mut m, mut m2) = (0.0, 0.0);
            for (k, &xv) in x.iter().enumerate() {
                let delta = ar.sub(xv, m);
                m = ar.add(m, ar.div(delta, (k + 1) as f64));
                m2 = ar.add(m2, ar.mul(delta, ar.sub(xv, m)));
            }
            let src: Vec<f64> = x.iter().map(|&v| ar.sub(v, m)).collect();
            let v = ar.add(ar.div(m2, n), ar.ra(eps));
            let rstd = ar.ra(1.0 / v.sqrt());
            if !(rstd.is_finite() && rstd > 0.0) {
                return Err(Error::NoFiniteBound {
                    what: format!("{op:?} of a row of {} values", x.len()),
                    reason: format!(
                        "its computed variance + eps is {v:e}: rstd is {rstd} and the output \
                         not finite"
                    ),
                });
            }
            return Ok(exact_side(mu, x.len(), src, rstd));
        }
    }
    // Every rounding before x̂ determined: the side's output is computed exactly, as the
    // engine computes it (rstd = ra(1/√ra(var + ra(eps)))).
    if determine {
        let src = if centered {
            d_hat.clone()
        } else {
            Some(x.to_vec())
        };
        if let (Some(src), Some(var)) = (src, var_hat) {
            let v = a.add_rounded(var, a.round(eps, ov), ov);
            let rstd = a.round(1.0 / v.sqrt(), ov);
            if rstd.is_finite() && rstd > 0.0 {
                return Ok(exact_side(mu, x.len(), src, rstd));
            }
        }
    }
    let v = var_exact + eps;
    let (vv, vm) = rounding_within(a, v, var_max);
    var_var += vv;
    var_max += vm;
    // A computed var + eps within var_max of v: rstd = 1/√(v(1 + δ)), |δ| ≤ r = var_max/v.
    // With r ≥ 1 the computed value may be zero or negative (one-pass variance of rows whose
    // |mean| ≫ std cancels): rstd may be infinite or NaN, and no finite threshold holds.
    let r = var_max / v;
    if r >= 1.0 || r.is_nan() {
        return Err(Error::NoFiniteBound {
            what: format!("{op:?} of a row of {} values", x.len()),
            reason: format!(
                "its variance {var_exact:.3e} (+ eps) may be computed with an error up to \
                 {var_max:.3e}, so the computed value may be zero or negative and the output \
                 infinite or NaN (mean² / variance = {:.3e}; use the two-pass form)",
                mu * mu / var_exact.max(f64::MIN_POSITIVE)
            ),
        });
    }
    let rstd = 1.0 / v.sqrt();
    let rstd_max = rstd * (1.0 / (1.0 - r).sqrt() - 1.0);
    let (rv, rm) = rounding_within(a, rstd, rstd_max);
    // ρ = 1/√(1 + δ) − 1 for the relative error δ of var + eps: −δ/2 to first order, but
    // convex, so where δ may be a large fraction of v (rows whose variance is eps-sized, a
    // one-pass variance that cancels) the first order is low: within |δ| ≤ δ* — its mean and
    // ties plus six standard deviations, at most r — |ρ| ≤ c·|δ|/2 with the secant slope
    // c = 2(1/√(1 − δ*) − 1)/δ*, which scales the model's random ρ and its ties.
    let d_star = ((var_mean.abs() + var_tie + 6.0 * var_var.sqrt()) / v).min(r);
    let curve = if d_star > 1e-9 {
        2.0 * (1.0 / (1.0 - d_star).sqrt() - 1.0) / d_star
    } else {
        1.0
    };
    let rho_var = var_var / (4.0 * v * v) * curve * curve + rv / (rstd * rstd);
    let rho_max = 1.0 / (1.0 - r).sqrt() - 1.0 + rm / rstd;
    // The determined part of δ is known: its ρ is computed, not linearized.
    let rho_mean = if var_mean / v > -0.5 {
        1.0 / (1.0 + var_mean / v).sqrt() - 1.0
    } else {
        -var_mean / (2.0 * v) * curve
    };
    let rho_tie = var_tie / (2.0 * v) * curve;
    let e_max = if !centered {
        vec![0.0; x.len()]
    } else if let Some(dh) = &d_hat {
        dh.iter().zip(&d).map(|(h, e)| (h - e).abs()).collect()
    } else {
        d_max.iter().map(|m| m + mu_max).collect()
    };
    Ok(SideRow {
        mu,
        d_hat,
        exact: None,
        mu_tie,
        rho_tie,
        mu_var,
        mu_max,
        mu_mean,
        rho_var,
        rho_max,
        rho_mean,
        d_var,
        d_max,
        e_max,
    })
}

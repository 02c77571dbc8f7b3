//! Comparison thresholds for LayerNorm and RMSNorm (two-pass and one-pass variance), as
//! `engine::nn::layer_norm` / `rms_norm` execute them, between two policies that read the same
//! inputs and accumulate in the same format (orders, variance algorithms and output formats
//! may differ). Derivation: papers/bounds-norm.md.
//!
//! Per row, each side's errors to first order:
//! * mean: μ̂ = fl(S/n), error E_μ = E_S/n + η_μ (E_S the sum's reduction error);
//! * variance: two-pass var = fl(dot(d, d)/n) with dᵢ = fl(xᵢ − μ̂): E_var = E_dot/n +
//!   Σ (2dᵢ/n)·η_dᵢ + η_var; one-pass var = fl(fl(dot(x, x)/n) − fl(μ̂²)):
//!   E_var = E_dot(x)/n + η_ms − 2μ·E_μ − η_μ² + η_var (its cancellation shows in the ulps
//!   of ms and μ², which are as large as ms, not var); RMSNorm: ms = fl(dot(x, x)/n) only;
//! * rstd = fl(1/√fl(var + eps)): relative error ρ = −(E_var + η_v)/(2v) + η_r/rstd;
//! * element i: x̂ᵢ = fl(dᵢ·rstd), y = fl(fl(x̂ᵢ·γᵢ) + βᵢ), then the output rounding.
//!
//! The difference of the two sides splits into a row-common part
//! γ ⊙ (−rstd·ΔE_μ·1 + Δρ·x̂) — one sub-Gaussian component per row — and per-element parts:
//! the dᵢ roundings (independent unless the two sides share μ̂) and the trailing roundings of
//! nearly equal values.

use crate::bounds::compare::{grouped_threshold, row_classes, Confidence, ElementDiff, Threshold};
use crate::bounds::ops::round_sides;
use crate::bounds::reduction::{reduction_error, reduction_error_within, ReductionError};
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use crate::policy::arith::Arith;
use crate::policy::Policy;
use crate::policy::Variance;
use crate::tensor::Tensor;

/// Variance and bound of the rounding to `f` of a computed value known to lie within `b` of
/// the exact `v`: exact only when nothing is uncertain and `v` lies on the grid.
fn rounding_within(f: Format, v: f64, b: f64) -> (f64, f64) {
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
fn determined_value(exact: f64, e: &ReductionError, rf: Format, ov: Overflow) -> Option<f64> {
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
fn narrow(f: Format) -> bool {
    f.unit_roundoff() >= 2f64.powi(-26)
}

/// Which normalization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormOp {
    /// LayerNorm with the given variance algorithm.
    LayerNorm(Variance),
    /// RMSNorm.
    RmsNorm,
}

/// One side's statistics for one row.
struct SideRow {
    /// The exact model mean (0 for RMSNorm).
    mu: f64,
    /// The side's computed dᵢ = ra(xᵢ − μ̂), when its μ̂ is determined.
    d_hat: Option<Vec<f64>>,
    /// The side's computed x̂ source (d̂ᵢ, or xᵢ for RMSNorm) and rstd, when every rounding
    /// before them is determined: the side's output is then known exactly.
    exact: Option<(Vec<f64>, f64)>,
    mu_tie: f64,
    rho_tie: f64,
    mu_var: f64,
    mu_max: f64,
    mu_mean: f64,
    rho_var: f64,
    rho_max: f64,
    rho_mean: f64,
    /// Per element: variance and bound of the rounding of dᵢ (absolute).
    d_var: Vec<f64>,
    d_max: Vec<f64>,
    /// Per element: |d̂ᵢ − dᵢ| at most (the mean's error and the dᵢ rounding; 0 for RMSNorm).
    e_max: Vec<f64>,
}

/// A side whose output is known exactly: no statistics, the computed x̂ sources and rstd.
fn exact_side(mu: f64, n: usize, src: Vec<f64>, rstd: f64) -> SideRow {
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
/// so roundings the data determine may be computed exactly.
fn side_row(x: &[f64], op: NormOp, eps: f64, policy: &Policy, determine: bool) -> Result<SideRow> {
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
        let es = reduction_error(x, &acc_in, false)?;
        mu_tie = es.tie_bound / n;
        // The division rounds the computed Ŝ/n, not the exact mean: exact only when the sum
        // is (a representable mean says nothing about Ŝ/n otherwise).
        let (rv, rm) = rounding_within(a, mu, es.guaranteed / n);
        mu_var = es.variance / (n * n) + rv;
        mu_max = es.guaranteed / n + rm;
        mu_mean = es.mean / n;
        let rf = acc_in.order.result_format(a);
        if let Some(s_hat) = determined_value(exact_sum, &es, rf, ov) {
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
            let ed = reduction_error(&sq, &acc_a, true)?;
            if narrow(a) {
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
            let ed = reduction_error_within(&sq, &radii, &acc_a, true)?;
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
            let ed = reduction_error(&sq, &acc_in, true)?;
            let ms_hat = if narrow(policy.input()) {
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

/// The data of a normalization for [`norm_threshold`]: the rows (last dimension) of `x`, the
/// weight γ, LayerNorm's bias β, and the ε added to the variance.
#[derive(Debug, Clone, Copy)]
pub struct NormData<'a> {
    /// The input; rows along its last dimension.
    pub x: &'a Tensor,
    /// γ, one per element of a row.
    pub weight: &'a Tensor,
    /// β (LayerNorm), one per element of a row.
    pub bias: Option<&'a Tensor>,
    /// The ε added to the variance (≥ 0).
    pub eps: f64,
}

/// How one side normalizes: the algorithm and its arithmetic.
#[derive(Debug, Clone, Copy)]
pub struct NormSide<'a> {
    /// LayerNorm (with its variance algorithm) or RMSNorm.
    pub op: NormOp,
    /// The arithmetic.
    pub policy: &'a Policy,
}

/// Threshold for a normalization of `data` computed by `reference` versus `candidate`.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{norm_threshold, Confidence, NormData, NormOp, NormSide};
/// use ttrace::engine::{layer_norm, Variance};
/// use ttrace::{Format, Order, Overflow, Policy, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// let x = Tensor::rounded(&[4, 256], (0..1024).map(|i| 2.0 + (i as f64 * 0.37).sin()).collect(),
///     Format::BF16, Overflow::Saturating)?;
/// let gamma = Tensor::rounded(&[256], (0..256).map(|i| 1.0 + i as f64 / 512.0).collect(),
///     Format::BF16, Overflow::Saturating)?;
/// let beta = Tensor::zeros(&[256], Format::BF16);
/// // The reference reduces sequentially with a two-pass variance; the candidate reduces
/// // pairwise with Welford's updates.
/// let r: Policy = "in=bf16,acc=f32,out=bf16".parse()?;
/// let c = r.clone().with_order(Order::pairwise(1));
/// let data = NormData { x: &x, weight: &gamma, bias: Some(&beta), eps: 1e-5 };
/// let t = norm_threshold(
///     &data,
///     NormSide { op: NormOp::LayerNorm(Variance::TwoPass), policy: &r },
///     NormSide { op: NormOp::LayerNorm(Variance::Welford), policy: &c },
///     Confidence::default_probabilistic(),
/// )?;
/// let (yr, _) = layer_norm(&x, &gamma, &beta, 1e-5, Variance::TwoPass, &r)?;
/// let (yc, _) = layer_norm(&x, &gamma, &beta, 1e-5, Variance::Welford, &c)?;
/// assert!(t.check(&yr, &yc).passed);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidParameter`] for sides with different input or accumulator formats or
/// different functions (LayerNorm against RMSNorm), or an invalid ε;
/// [`Error::ShapeMismatch`] for a weight or bias that does not match a row;
/// [`Error::NoFiniteBound`] when a one-pass variance may lose every digit.
pub fn norm_threshold(
    data: &NormData<'_>,
    reference: NormSide<'_>,
    candidate: NormSide<'_>,
    confidence: Confidence,
) -> Result<Threshold> {
    let NormData {
        x,
        weight,
        bias,
        eps,
    } = *data;
    let (ref_op, reference) = (reference.op, reference.policy);
    let (cand_op, candidate) = (candidate.op, candidate.policy);
    reference.validate()?;
    candidate.validate()?;
    if reference.input() != candidate.input() || reference.accumulator() != candidate.accumulator()
    {
        return Err(Error::InvalidParameter {
            name: "candidate",
            reason: "norm thresholds are implemented for two sides with the same input and accumulator formats".into(),
        });
    }
    if matches!(ref_op, NormOp::RmsNorm) != matches!(cand_op, NormOp::RmsNorm) {
        return Err(Error::InvalidParameter {
            name: "cand_op",
            reason: "LayerNorm and RMSNorm compute different functions; compare like with like"
                .into(),
        });
    }
    let n = *x.shape().last().unwrap_or(&0);
    if n == 0 || weight.shape() != [n] || bias.is_some_and(|b| b.shape() != [n]) {
        return Err(Error::ShapeMismatch {
            what: "norm threshold: weight (and bias) must match the normalized dimension".into(),
            expected: vec![n],
            found: weight.shape().to_vec(),
        });
    }
    if !(eps >= 0.0 && eps.is_finite()) {
        return Err(Error::InvalidParameter {
            name: "eps",
            reason: format!("must be finite and non-negative (got {eps})"),
        });
    }
    let rows = x.len() / n;
    let cast = |t: &Tensor| {
        t.cast(
            reference.input(),
            reference.input_overflow(reference.input()),
        )
    };
    let (xi, w) = (cast(x), cast(weight));
    let b = bias.map(cast);
    let a = reference.accumulator();
    let identical = reference.same_execution(candidate) && ref_op == cand_op;
    // μ̂ (and so every dᵢ) is the same on both sides when the sum runs in the same order (one
    // kernel, not a family); everything before the output rounding is the same when the
    // whole arithmetic is.
    let one_kernel = !reference.accumulation.order.has_family();
    let cand_one_kernel = !candidate.accumulation.order.has_family();
    // Welford's μ̂ comes from its own recurrence, not from the sum: shared only with Welford.
    let welford = |op: NormOp| op == NormOp::LayerNorm(Variance::Welford);
    let shared_mu = reference.accumulation.order == candidate.accumulation.order
        && one_kernel
        && welford(ref_op) == welford(cand_op);
    let same_internal =
        reference.accumulation == candidate.accumulation && ref_op == cand_op && one_kernel;
    let centered = matches!(ref_op, NormOp::LayerNorm(_));
    let bias_at = |i: usize| b.as_ref().map_or(0.0, |b| b.values()[i]);
    // The exact model of one row: μ, rstd, x̂ and y.
    let exact_row = |row: &[f64]| {
        let mu = if centered {
            row.iter().sum::<f64>() / n as f64
        } else {
            0.0
        };
        let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / n as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        let xhat: Vec<f64> = row.iter().map(|v| (v - mu) * rstd).collect();
        let y: Vec<f64> = (0..n)
            .map(|i| xhat[i] * w.values()[i] + bias_at(i))
            .collect();
        (rstd, xhat, y)
    };
    let mut norm_sq = 0.0;
    for r in 0..rows {
        let (_, _, y) = exact_row(&xi.values()[r * n..(r + 1) * n]);
        norm_sq += y.iter().map(|v| v * v).sum::<f64>();
    }
    if identical {
        return Ok(Threshold::identical(confidence, norm_sq.sqrt(), rows * n));
    }
    // Correlated components, priced once with their multiplicity (grouped_threshold):
    // identical rows; within a row, elements with identical (x, γ, β); and the roundings of
    // dᵢ = x − μ̂ that share a grid and a residue of x on it (integers, constants), which err
    // alike whatever μ̂ is.
    let (_, classes) = row_classes(xi.values(), n);
    // Each class of rows priced alone (in parallel; concatenated in order below, so that the
    // threshold does not depend on the number of threads).
    let priced = crate::parallel::map(
        &classes,
        |&(r, count)| -> Result<Vec<(ElementDiff, usize)>> {
            let mut groups: Vec<(ElementDiff, usize)> = vec![];
            let row = &xi.values()[r * n..(r + 1) * n];
            let (rstd, xhat, y) = exact_row(row);
            let sr = side_row(row, ref_op, eps, reference, one_kernel)?;
            let sc = side_row(row, cand_op, eps, candidate, cand_one_kernel)?;
            // A side whose every rounding before x̂ is determined: its output, computed as the
            // engine computes it.
            let output = |s: &SideRow, p: &Policy| {
                let ar = Arith::new(a, p.output, p.accumulation.overflow);
                s.exact.as_ref().map(|(src, r_hat)| {
                    (0..n)
                        .map(|i| {
                            let mut v = ar.mul(ar.mul(src[i], *r_hat), w.values()[i]);
                            if b.is_some() {
                                v = ar.add(v, bias_at(i));
                            }
                            ar.ro(v)
                        })
                        .collect::<Vec<f64>>()
                })
            };
            let (yr, yc) = (output(&sr, reference), output(&sc, candidate));
            if let (Some(yr), Some(yc)) = (&yr, &yc) {
                // Both sides known: the difference is too (exactly in f64; the slack covers the
                // norms the threshold and its user take of it).
                for i in 0..n {
                    let d = yc[i] - yr[i];
                    let slack = d.abs() * 1e-12;
                    groups.push((
                        ElementDiff {
                            offset: d,
                            bias_bound: slack,
                            guaranteed: d.abs() + slack,
                            ..ElementDiff::default()
                        },
                        count,
                    ));
                }
                return Ok(groups);
            }
            // One side known: its error against the exact model is a determined offset, and only
            // the other side's roundings are priced.
            let one_known = yr.is_some() || yc.is_some();
            let known_offset = |i: usize| {
                let o = yc.as_ref().map_or(0.0, |v| v[i] - y[i])
                    - yr.as_ref().map_or(0.0, |v| v[i] - y[i]);
                // The exact model's y is computed in f64.
                (
                    o,
                    (y[i].abs() + rstd * row[i].abs()) * 1e-12 + f64::MIN_POSITIVE,
                )
            };
            // Row-common part: γ ⊙ (−rstd·Δμ·1 + Δρ·x̂_side), two scalars times vectors; the
            // sub-Gaussian proxy of the sum is at most (σ₁‖v₁‖ + σ₂‖v₂‖)². The side's x̂ is
            // rstd·d̂ᵢ with |d̂ᵢ − dᵢ| ≤ e_max: the vector of Δρ is within rstd·‖γ ⊙ e_max‖ of γ ⊙ x̂.
            let e_max: Vec<f64> = (0..n).map(|i| sr.e_max[i].max(sc.e_max[i])).collect();
            let g_norm = w.values().iter().map(|v| v * v).sum::<f64>().sqrt();
            let gx_norm = (0..n)
                .map(|i| (w.values()[i] * xhat[i]).powi(2))
                .sum::<f64>()
                .sqrt()
                + rstd
                    * (0..n)
                        .map(|i| (w.values()[i] * e_max[i]).powi(2))
                        .sum::<f64>()
                        .sqrt();
            // Both sides' dᵢ known exactly: their difference is a determined offset per element,
            // and neither μ̂ nor the dᵢ roundings are random.
            let known_d = match (&sr.d_hat, &sc.d_hat) {
                (Some(dr), Some(dc)) => Some((dr, dc)),
                _ => None,
            };
            let shared_mu = (shared_mu && !one_known) || known_d.is_some();
            let same_internal = same_internal && !one_known;
            let (mu_var, mu_max) = if shared_mu {
                (0.0, 0.0)
            } else {
                (sr.mu_var + sc.mu_var, sr.mu_max + sc.mu_max)
            };
            let (rho_var, rho_max) = if same_internal {
                (0.0, 0.0)
            } else {
                (sr.rho_var + sc.rho_var, sr.rho_max + sc.rho_max)
            };
            let s1 = mu_var.sqrt() * rstd * g_norm;
            let s2 = rho_var.sqrt() * gx_norm;
            groups.push((
                ElementDiff {
                    proxy: (s1 + s2).powi(2),
                    guaranteed: mu_max * rstd * g_norm + rho_max * gx_norm,
                    spread: true,
                    ..ElementDiff::default()
                },
                count,
            ));
            let dmu_mean = if shared_mu {
                0.0
            } else {
                sc.mu_mean - sr.mu_mean
            };
            let drho_mean = sc.rho_mean - sr.rho_mean;
            let mu_tie = if shared_mu {
                0.0
            } else {
                sr.mu_tie + sc.mu_tie
            };
            let rho_tie = if same_internal {
                0.0
            } else {
                sr.rho_tie + sc.rho_tie
            };
            // The dᵢ roundings, by (grid, residue of xᵢ on it): one component each, proxy
            // Var(η)·Σ (γᵢ·rstd)² over the group.
            let mut d_groups: std::collections::BTreeMap<(u64, u64), f64> = Default::default();
            let mut elements: crate::bounds::keyed::DataMap<(u64, u64, u64), (usize, usize)> =
                Default::default();
            let mut order = vec![];
            for (i, (&xv, &gi)) in row.iter().zip(w.values()).enumerate() {
                let key = (xv.to_bits(), gi.to_bits(), bias_at(i).to_bits());
                elements
                    .entry(key)
                    .or_insert_with(|| {
                        order.push(i);
                        (i, 0)
                    })
                    .1 += 1;
                if !shared_mu {
                    let dv = sr.d_var[i] + sc.d_var[i];
                    if dv > 0.0 {
                        let ulp = a.ulp(xv - sr.mu).unwrap_or(0.0);
                        let residue = xv - ulp * (xv / ulp).floor();
                        *d_groups
                            .entry((ulp.to_bits(), residue.to_bits()))
                            .or_default() += dv * (gi * rstd).powi(2);
                    }
                }
            }
            for proxy in d_groups.values() {
                groups.push((
                    ElementDiff {
                        proxy: *proxy,
                        spread: true,
                        ..ElementDiff::default()
                    },
                    count,
                ));
            }
            for &i in &order {
                let cnt = elements[&(
                    row[i].to_bits(),
                    w.values()[i].to_bits(),
                    bias_at(i).to_bits(),
                )]
                    .1;
                let gi = w.values()[i];
                let (dv, dm) = if shared_mu {
                    (0.0, 0.0)
                } else {
                    (sr.d_var[i] + sc.d_var[i], sr.d_max[i] + sc.d_max[i])
                };
                let dd = known_d.map_or(0.0, |(dr, dc)| dc[i] - dr[i]);
                // Second order: ρ multiplies the side's x̂ = rstd·(dᵢ + eᵢ), |eᵢ| ≤ e_max. With
                // both eᵢ known, their share of the ρ means is determined.
                let (cross_mean, cross_bias) = match known_d {
                    Some((dr, dc)) => {
                        let (er, ec) = (dr[i] - (row[i] - sr.mu), dc[i] - (row[i] - sc.mu));
                        (rstd * (sc.rho_mean * ec - sr.rho_mean * er), 0.0)
                    }
                    None => (
                        0.0,
                        rstd * e_max[i] * (sr.rho_mean.abs() + sc.rho_mean.abs()),
                    ),
                };
                let (known, slack) = known_offset(i);
                let mut d = ElementDiff {
                    offset: gi * (rstd * (dd - dmu_mean) + drho_mean * xhat[i] + cross_mean)
                        + known,
                    bias_bound: gi.abs()
                        * (rstd * mu_tie
                            + rho_tie * (xhat[i].abs() + rstd * e_max[i])
                            + cross_bias)
                        + slack,
                    guaranteed: (gi.abs()
                        * (rstd * (dm + mu_max + dd.abs())
                            + rho_max * (xhat[i].abs() + rstd * e_max[i]))
                        + known.abs()
                        + slack)
                        * 1.01,
                    ..ElementDiff::default()
                };
                // The row part's and the dᵢ rounding's share of this element set E|Δ| for the
                // trailing roundings; both are priced as their own components above.
                let share = (gi * (rstd * mu_var.sqrt() + xhat[i].abs() * rho_var.sqrt())).powi(2)
                    + gi * gi * rstd * rstd * dv;
                d.proxy += share;
                if one_known {
                    // The other side's trailing roundings alone.
                    let out = if yr.is_some() {
                        candidate.output
                    } else {
                        reference.output
                    };
                    d.round_one(a, xhat[i]);
                    d.round_one(a, xhat[i] * gi);
                    if b.is_some() {
                        d.round_one(a, y[i]);
                    }
                    if !a.is_subset_of(out) {
                        d.round_one(out, y[i]);
                    }
                } else {
                    if !same_internal {
                        d.round_both(a, xhat[i]);
                        d.round_both(a, xhat[i] * gi);
                        if b.is_some() {
                            d.round_both(a, y[i]);
                        }
                    }
                    round_sides(&mut d, (a, a), (reference.output, candidate.output), y[i]);
                }
                d.proxy -= share;
                d.shared_proxy = share;
                groups.push((d, cnt * count));
            }
            Ok(groups)
        },
    );
    let mut groups: Vec<(ElementDiff, usize)> = vec![];
    for g in priced {
        groups.extend(g?);
    }
    Ok(grouped_threshold(
        &groups,
        norm_sq.sqrt(),
        confidence,
        rows * n,
    ))
}

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
use crate::bounds::reduction::{random_rounding_error, reduction_error};
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use crate::policy::Policy;
use crate::policy::Variance;
use crate::tensor::Tensor;

/// Variance and bound of the absolute error of rounding the exact `v` to `f`.
fn rounding(f: Format, v: f64) -> (f64, f64) {
    if f.round(v, Overflow::NonSaturating) == v {
        return (0.0, 0.0);
    }
    let ulp = f.ulp(v).unwrap_or(0.0);
    (ulp * ulp / 12.0, ulp / 2.0)
}

/// First-order error statistics of Welford's recurrence on the exact inputs x, every step
/// rounded to `a` (see [`Variance::Welford`]):
/// δ = ra(x_k − μ), μ' = ra(μ + ra(δ/k)), M2' = ra(M2 + ra(δ·ra(x_k − μ'))).
///
/// # Derivation (papers/bounds-norm.md, Welford)
/// With e_μ, e_M the errors of μ̂, M̂2 and η₁…η₆ the six roundings of step k (exact values δ,
/// r = x_k − μ'), to first order
/// e_μ' = (1 − 1/k)·e_μ + η₁/k + η₂ + η₃,
/// e_M' = e_M − (r + δ(1 − 1/k))·e_μ + (r − δ/k)·η₁ − δ·η₂ − δ·η₃ + δ·η₄ + η₅ + η₆.
/// The η are independent, zero-mean, uniform within half a spacing (variance ulp²/12, 0 for an
/// exact rounding): the 2×2 covariance of (e_μ, e_M) is propagated exactly under this linear
/// map. The bounds propagate |η| ≤ ulp/2 at each value's largest possible magnitude by the
/// triangle inequality, with the one second-order product (e_δ·e_r) carried.
struct WelfordError {
    /// The exact model M2 = Σ (x − μ)².
    m2: f64,
    mu_var: f64,
    mu_max: f64,
    m2_var: f64,
    m2_max: f64,
}

fn welford_error(x: &[f64], a: Format) -> WelfordError {
    // Rounding of the exact value v of a computed quantity known within b: exact only when
    // nothing is uncertain and v lies on the grid.
    let rnd = |v: f64, b: f64| -> (f64, f64) {
        if b == 0.0 && a.round(v, Overflow::NonSaturating) == v {
            return (0.0, 0.0);
        }
        let ulp = a.ulp(v.abs() + b).unwrap_or(f64::INFINITY);
        (ulp * ulp / 12.0, ulp / 2.0)
    };
    let (mut mu, mut m2) = (0.0f64, 0.0f64);
    let (mut vmu, mut vm, mut cov) = (0.0f64, 0.0f64, 0.0f64);
    let (mut bmu, mut bm) = (0.0f64, 0.0f64);
    for (k, &xk) in x.iter().enumerate() {
        let kf = (k + 1) as f64;
        let delta = xk - mu;
        let (v1, m1) = rnd(delta, bmu);
        let q = delta / kf;
        let (v2, m2r) = rnd(q, (bmu + m1) / kf);
        let mu_new = mu + q;
        let (v3, m3) = rnd(mu_new, bmu + (bmu + m1) / kf + m2r);
        let keep = 1.0 - 1.0 / kf;
        let bmu_new = keep * bmu + m1 / kf + m2r + m3;
        let r = xk - mu_new;
        let (v4, m4) = rnd(r, bmu_new);
        let p = delta * r;
        let (bd, br) = (bmu + m1, bmu_new + m4);
        let bp_in = r.abs() * bd + delta.abs() * br + bd * br;
        let (v5, m5) = rnd(p, bp_in);
        let (v6, m6) = rnd(m2 + p, bm + bp_in + m5);
        let c = -(r + delta * keep);
        let var_n_mu = v1 / (kf * kf) + v2 + v3;
        let cov_n = (r - delta / kf) * v1 / kf - delta * (v2 + v3);
        let var_n_m = (r - delta / kf).powi(2) * v1 + delta * delta * (v2 + v3 + v4) + v5 + v6;
        let vmu_new = keep * keep * vmu + var_n_mu;
        let cov_new = keep * (c * vmu + cov) + cov_n;
        vm = c * c * vmu + 2.0 * c * cov + vm + var_n_m;
        vmu = vmu_new;
        cov = cov_new;
        bm += bp_in + m5 + m6;
        bmu = bmu_new;
        mu = mu_new;
        m2 += p;
    }
    WelfordError {
        m2,
        mu_var: vmu,
        mu_max: bmu * (1.0 + 1e-12),
        m2_var: vm.max(0.0),
        m2_max: bm * (1.0 + 1e-12),
    }
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
}

fn side_row(x: &[f64], op: NormOp, eps: f64, policy: &Policy) -> Result<SideRow> {
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
    if centered {
        let es = reduction_error(x, &acc_in, false)?;
        mu_tie = es.tie_bound / n;
        let (rv, rm) = rounding(a, mu);
        mu_var = es.variance / (n * n) + rv;
        mu_max = es.guaranteed / n + rm;
        mu_mean = es.mean / n;
        if es.variance == 0.0 {
            let rf = acc_in.order.result_format(a);
            let c = exact_sum + es.mean;
            let s_hat = rf.round(c, ov);
            let below = rf
                .ulp(s_hat.abs() * (1.0 - 2.0 * rf.unit_roundoff()))
                .unwrap_or(0.0);
            let slack = es.tie_bound + c.abs() * 4.0 * f64::EPSILON;
            if s_hat.is_finite() && (c - s_hat).abs() + slack < below / 2.0 {
                mu_hat = Some(a.round(s_hat / n, ov));
            }
        }
    }
    let mut d_hat: Option<Vec<f64>> =
        mu_hat.map(|m| x.iter().map(|&v| a.add_rounded(v, -m, ov)).collect());
    let d: Vec<f64> = x
        .iter()
        .map(|&v| if centered { v - mu } else { v })
        .collect();
    let mut d_var = vec![0.0; x.len()];
    let mut d_max = vec![0.0; x.len()];
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
            let (rv, rm) = rounding(a, var_exact + shift);
            var_var = ed.variance / (n * n) + rv;
            var_max = ed.guaranteed / n + shift.abs() + rm;
            var_mean = ed.mean / n + shift;
            var_tie = ed.tie_bound / n + (var_exact.abs() + shift.abs()) * 8.0 * f64::EPSILON;
        }
        NormOp::LayerNorm(Variance::TwoPass) => {
            for (i, &di) in d.iter().enumerate() {
                let (v, m) = rounding(a, di);
                d_var[i] = v;
                d_max[i] = m;
            }
            let sq: Vec<f64> = d.iter().map(|v| v * v).collect();
            var_exact = sq.iter().sum::<f64>() / n;
            // The side squares its computed dᵢ, which the model knows only approximately: the
            // all-random model prices this sum (the dᵢ roundings are added below).
            let ed = random_rounding_error(&sq, &acc_a, false)?;
            let (rv, rm) = rounding(a, var_exact);
            var_var = ed.variance / (n * n) + rv;
            var_max = ed.guaranteed / n + rm;
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
        }
        NormOp::LayerNorm(Variance::OnePass) | NormOp::RmsNorm => {
            let sq: Vec<f64> = x.iter().map(|v| v * v).collect();
            let ms = sq.iter().sum::<f64>() / n;
            // dot(x, x): the exact products xᵢ², handled as the policy's products are.
            let ed = reduction_error(&sq, &acc_in, true)?;
            let (rv, rm) = rounding(a, ms);
            var_var = ed.variance / (n * n) + rv;
            var_max = ed.guaranteed / n + rm;
            var_mean = ed.mean / n;
            var_tie = ed.tie_bound / n + 2.0 * mu.abs() * mu_tie;
            if centered {
                for (i, &di) in d.iter().enumerate() {
                    let (v, m) = rounding(a, di);
                    d_var[i] = v;
                    d_max[i] = m;
                }
                let (qv, qm) = rounding(a, mu * mu);
                var_var += 4.0 * mu * mu * mu_var + qv;
                var_max += 2.0 * mu.abs() * mu_max + mu_max * mu_max + qm;
                var_mean -= 2.0 * mu * mu_mean;
                var_exact = ms - mu * mu;
                let (sv, sm) = rounding(a, var_exact);
                var_var += sv;
                var_max += sm;
            } else {
                var_exact = ms;
            }
        }
        NormOp::LayerNorm(Variance::Welford) => {
            // Welford's recurrence replaces the sum: its μ̂ and M̂2 errors are propagated
            // through the recurrence (welford_error); nothing about μ̂ is determined.
            let we = welford_error(x, a);
            mu_var = we.mu_var;
            mu_max = we.mu_max;
            mu_mean = 0.0;
            mu_tie = 0.0;
            d_hat = None;
            for (i, &di) in d.iter().enumerate() {
                let (v, m) = rounding(a, di);
                d_var[i] = v;
                d_max[i] = m;
            }
            var_exact = we.m2 / n;
            let (rv, rm) = rounding(a, var_exact);
            var_var = we.m2_var / (n * n) + rv;
            var_max = we.m2_max / n + rm;
            var_mean = 0.0;
            var_tie = 0.0;
        }
    }
    let v = var_exact + eps;
    let (vv, vm) = rounding(a, v);
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
    let (rv, rm) = rounding(a, rstd);
    let rho_var = var_var / (4.0 * v * v) + rv / (rstd * rstd);
    let rho_max = 1.0 / (1.0 - r).sqrt() - 1.0 + rm / rstd;
    let rho_mean = -var_mean / (2.0 * v);
    let rho_tie = var_tie / (2.0 * v);
    Ok(SideRow {
        mu,
        d_hat,
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
    let shared_mu = reference.accumulation.order == candidate.accumulation.order && one_kernel;
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
    let mut groups: Vec<(ElementDiff, usize)> = vec![];
    let (_, classes) = row_classes(xi.values(), n);
    for &(r, count) in &classes {
        let row = &xi.values()[r * n..(r + 1) * n];
        let (rstd, xhat, y) = exact_row(row);
        let sr = side_row(row, ref_op, eps, reference)?;
        let sc = side_row(row, cand_op, eps, candidate)?;
        // Row-common part: γ ⊙ (−rstd·Δμ·1 + Δρ·x̂), two scalars times fixed vectors; the
        // sub-Gaussian proxy of the sum is at most (σ₁‖v₁‖ + σ₂‖v₂‖)².
        let g_norm = w.values().iter().map(|v| v * v).sum::<f64>().sqrt();
        let gx_norm = (0..n)
            .map(|i| (w.values()[i] * xhat[i]).powi(2))
            .sum::<f64>()
            .sqrt();
        // Both sides' dᵢ known exactly: their difference is a determined offset per element,
        // and neither μ̂ nor the dᵢ roundings are random.
        let known_d = match (&sr.d_hat, &sc.d_hat) {
            (Some(dr), Some(dc)) => Some((dr, dc)),
            _ => None,
        };
        let shared_mu = shared_mu || known_d.is_some();
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
        let mut elements: std::collections::HashMap<(u64, u64, u64), (usize, usize)> =
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
            let mut d = ElementDiff {
                offset: gi * (rstd * (dd - dmu_mean) + drho_mean * xhat[i]),
                bias_bound: gi.abs() * (rstd * mu_tie + rho_tie * xhat[i].abs()),
                guaranteed: gi.abs()
                    * (rstd * (dm + mu_max + dd.abs()) + rho_max * xhat[i].abs())
                    * 1.01,
                ..ElementDiff::default()
            };
            // The row part's and the dᵢ rounding's share of this element set E|Δ| for the
            // trailing roundings; both are priced as their own components above.
            let share = (gi * (rstd * mu_var.sqrt() + xhat[i].abs() * rho_var.sqrt())).powi(2)
                + gi * gi * rstd * rstd * dv;
            d.proxy += share;
            if !same_internal {
                d.round_both(a, xhat[i]);
                d.round_both(a, xhat[i] * gi);
                if b.is_some() {
                    d.round_both(a, y[i]);
                }
            }
            round_sides(&mut d, (a, a), (reference.output, candidate.output), y[i]);
            d.proxy -= share;
            groups.push((d, cnt * count));
        }
    }
    Ok(grouped_threshold(
        &groups,
        norm_sq.sqrt(),
        confidence,
        rows * n,
    ))
}

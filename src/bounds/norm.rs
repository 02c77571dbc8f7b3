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

use crate::bounds::compare::{finish, Confidence, ElementDiff, Threshold};
use crate::bounds::ops::round_sides;
use crate::bounds::reduction::reduction_error;
use crate::engine::nn::Variance;
use crate::engine::policy::Policy;
use crate::engine::tensor::Tensor;
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};

/// Variance and bound of the absolute error of rounding the exact `v` to `f`.
fn rounding(f: Format, v: f64) -> (f64, f64) {
    if f.round(v, Overflow::NonSaturating) == v {
        return (0.0, 0.0);
    }
    let ulp = f.ulp(v).unwrap_or(0.0);
    (ulp * ulp / 12.0, ulp / 2.0)
}

/// Which normalization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormOp {
    /// LayerNorm with the given variance algorithm (Welford is not priced).
    LayerNorm(Variance),
    /// RMSNorm.
    RmsNorm,
}

/// One side's statistics for one row.
struct SideRow {
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
    let exact_sum: f64 = x.iter().sum();
    let mu = exact_sum / n;
    let centered = matches!(op, NormOp::LayerNorm(_));
    let (mut mu_var, mut mu_max, mut mu_mean, mut mu_tie) = (0.0, 0.0, 0.0, 0.0);
    if centered {
        let es = reduction_error(x, &acc_in, false)?;
        mu_tie = es.tie_bound / n;
        let (rv, rm) = rounding(a, mu);
        mu_var = es.variance / (n * n) + rv;
        mu_max = es.guaranteed / n + rm;
        mu_mean = es.mean / n;
    }
    let d: Vec<f64> = x
        .iter()
        .map(|&v| if centered { v - mu } else { v })
        .collect();
    let mut d_var = vec![0.0; x.len()];
    let mut d_max = vec![0.0; x.len()];
    let (var_exact, mut var_var, mut var_max, mut var_mean, var_tie);
    match op {
        NormOp::LayerNorm(Variance::TwoPass) => {
            for (i, &di) in d.iter().enumerate() {
                let (v, m) = rounding(a, di);
                d_var[i] = v;
                d_max[i] = m;
            }
            let sq: Vec<f64> = d.iter().map(|v| v * v).collect();
            var_exact = sq.iter().sum::<f64>() / n;
            let ed = reduction_error(&sq, &acc_a, false)?;
            let (rv, rm) = rounding(a, var_exact);
            var_var = ed.variance / (n * n) + rv;
            var_max = ed.guaranteed / n + rm;
            var_mean = ed.mean / n;
            var_tie = ed.tie_bound / n;
            // The dᵢ roundings move the variance by (2dᵢ/n)·η, and dᵢ² by (2dᵢ + η)·η.
            for (i, &di) in d.iter().enumerate() {
                var_var += (2.0 * di / n).powi(2) * d_var[i];
                var_max += (2.0 * di.abs() + d_max[i]) * d_max[i] / n;
            }
        }
        NormOp::LayerNorm(Variance::OnePass) | NormOp::RmsNorm => {
            let sq: Vec<f64> = x.iter().map(|v| v * v).collect();
            let ms = sq.iter().sum::<f64>() / n;
            let ed = reduction_error(&sq, &acc_in, false)?;
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
        NormOp::LayerNorm(Variance::Welford) => return Err(Error::InvalidParameter {
            name: "variance",
            reason:
                "thresholds for Welford's variance are not modelled yet (two-pass and one-pass are)"
                    .into(),
        }),
    }
    let v = var_exact + eps;
    let (vv, vm) = rounding(a, v);
    var_var += vv;
    var_max += vm;
    let rstd = 1.0 / v.sqrt();
    let (rv, rm) = rounding(a, rstd);
    let rho_var = var_var / (4.0 * v * v) + rv / (rstd * rstd);
    let rho_max = (var_max / (2.0 * v)) / (1.0 - (var_max / v).min(0.5)) + rm / rstd;
    let rho_mean = -var_mean / (2.0 * v);
    let rho_tie = var_tie / (2.0 * v);
    Ok(SideRow {
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

/// Threshold for a normalization of the rows (last dimension) of `x` with weight γ (and
/// bias β for LayerNorm), reference `ref_op` under `reference` versus `cand_op` under
/// `candidate`.
#[allow(clippy::too_many_arguments)]
pub fn norm_threshold(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
    ref_op: NormOp,
    reference: &Policy,
    cand_op: NormOp,
    candidate: &Policy,
    confidence: Confidence,
) -> Result<Threshold> {
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
    let identical = reference == candidate && ref_op == cand_op;
    // μ̂ (and so every dᵢ) is the same on both sides when the sum runs in the same order;
    // everything before the output rounding is the same when the whole arithmetic is.
    let shared_mu = reference.accumulation.order == candidate.accumulation.order;
    let same_internal = reference.accumulation == candidate.accumulation && ref_op == cand_op;
    let mut diffs = vec![];
    let mut norm_sq = 0.0;
    for r in 0..rows {
        let row = &xi.values()[r * n..(r + 1) * n];
        let centered = matches!(ref_op, NormOp::LayerNorm(_));
        let mu = if centered {
            row.iter().sum::<f64>() / n as f64
        } else {
            0.0
        };
        let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / n as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        let xhat: Vec<f64> = row.iter().map(|v| (v - mu) * rstd).collect();
        let y: Vec<f64> = (0..n)
            .map(|i| xhat[i] * w.values()[i] + b.as_ref().map_or(0.0, |b| b.values()[i]))
            .collect();
        norm_sq += y.iter().map(|v| v * v).sum::<f64>();
        if identical {
            continue;
        }
        let sr = side_row(row, ref_op, eps, reference)?;
        let sc = side_row(row, cand_op, eps, candidate)?;
        // Row-common part: γ ⊙ (−rstd·Δμ·1 + Δρ·x̂), two scalars times fixed vectors; the
        // sub-Gaussian proxy of the sum is at most (σ₁‖v₁‖ + σ₂‖v₂‖)².
        let g_norm = w.values().iter().map(|v| v * v).sum::<f64>().sqrt();
        let gx_norm = (0..n)
            .map(|i| (w.values()[i] * xhat[i]).powi(2))
            .sum::<f64>()
            .sqrt();
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
        let row_proxy = (s1 + s2).powi(2);
        diffs.push(ElementDiff {
            proxy: row_proxy,
            guaranteed: mu_max * rstd * g_norm + rho_max * gx_norm,
            ..ElementDiff::default()
        });
        let dmu_mean = sc.mu_mean - sr.mu_mean;
        let drho_mean = sc.rho_mean - sr.rho_mean;
        for i in 0..n {
            let gi = w.values()[i];
            let (dv, dm) = if shared_mu {
                (0.0, 0.0)
            } else {
                (sr.d_var[i] + sc.d_var[i], sr.d_max[i] + sc.d_max[i])
            };
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
            let mut d = ElementDiff {
                offset: gi * (-rstd * dmu_mean + drho_mean * xhat[i]),
                bias_bound: gi.abs() * (rstd * mu_tie + rho_tie * xhat[i].abs()),
                proxy: gi * gi * rstd * rstd * dv,
                guaranteed: gi.abs() * (rstd * (dm + mu_max) + rho_max * xhat[i].abs()) * 1.01,
                ..ElementDiff::default()
            };
            // The row part's share of this element sets E|Δ| for the trailing roundings.
            let share = (gi * (rstd * mu_var.sqrt() + xhat[i].abs() * rho_var.sqrt())).powi(2);
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

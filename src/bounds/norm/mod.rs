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

use crate::bounds::checked::{
    checked_by_executions, checked_by_executions_tiered, each_member, Executions,
};
use crate::bounds::compare::{grouped_threshold, row_classes, Confidence, ElementDiff, Threshold};
use crate::bounds::op::model::{Gain, OpModel, OpOptions, OpSide, Operand, OperandRole};
use crate::bounds::ops::round_sides;
use crate::bounds::ops::Pricing;
use crate::error::{Error, Result};
use crate::policy::arith::Arith;
use crate::policy::Policy;
use crate::policy::Variance;
use crate::tensor::Tensor;
use crate::trace::ModuleKind;

mod row;

use row::*;

/// Which normalization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormOp {
    /// LayerNorm with the given variance algorithm.
    LayerNorm(Variance),
    /// RMSNorm.
    RmsNorm,
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
/// A probabilistic threshold is checked first by the engine's executions of both sides: where
/// their difference exceeds the model's threshold at δ_s = min(δ, 10⁻³) (the norm or one
/// element), the data carry structure the model does not capture and the guaranteed threshold
/// is returned, its `confidence` saying so (papers/bounds-reductions.md §4).
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
    norm_threshold_priced(data, reference, candidate, confidence, Pricing::Auto)
}

/// The fewest normalized elements (rows × row length) that [`Pricing::Auto`] prices with the
/// compiled all-random model first: 2¹⁶, where the walk takes about 40 ms on one thread.
pub const NORM_FAST_ELEMENTS: usize = 1 << 16;

/// The shortest rows that [`Pricing::Auto`] prices with the compiled all-random model: the
/// walk determines every rounding of shorter rows more often than not (its threshold is then
/// the executions' difference), where the all-random model is several times wider.
pub const NORM_FAST_ROW: usize = 256;

/// Rows whose variance is at most this fraction of their squared mean (|mean| ≥ 256
/// standard deviations, constant rows among them) are priced by the walk under
/// [`Pricing::Fast`] too.
const NEAR_CONSTANT: f64 = 1.0 / 65536.0;

/// [`norm_threshold`] with the sums priced as `pricing` says.
///
/// * [`Pricing::Walk`]: every side's sums by the determined-rounding walk (the tightest).
/// * [`Pricing::Fast`]: by the all-random model of each side's orders, compiled once for the
///   row length (a rounding is exact or random; a mean or variance is known only where its
///   sum is exact), a fraction of the walk's cost. A probabilistic threshold is checked by
///   the executions as [`norm_threshold`]'s is; where they do not fit it (data whose
///   roundings the walk determines: constant and near-constant rows, large means, one
///   outlier) the walk prices the tensor, and is checked in turn. A guaranteed threshold is
///   the walk's (its determined sides are exact where the compiled model prices bounds).
/// * [`Pricing::Auto`]: `Fast` for probabilistic thresholds of at least
///   [`NORM_FAST_ELEMENTS`] elements in rows of at least [`NORM_FAST_ROW`], `Walk`
///   otherwise.
///
/// Under `Fast`, rows whose |mean| is at least 256 standard deviations (constant rows among
/// them) are still priced by the walk, row by row: the roundings of their sums are
/// determined, and the walk computes them.
///
/// Sides outside the compiled model (Kahan's order, families of orders, tensor cores) are
/// priced by the walk whatever `pricing` says.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{norm_threshold_priced, Confidence, NormData, NormOp, NormSide, Pricing};
/// use ttrace::engine::{layer_norm, Variance};
/// use ttrace::{Format, Order, Overflow, Policy, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// let x = Tensor::rounded(&[8, 512], (0..4096).map(|i| (i as f64 * 0.731).sin()).collect(),
///     Format::BF16, Overflow::Saturating)?;
/// let gamma = Tensor::rounded(&[512], vec![1.0; 512], Format::BF16, Overflow::Saturating)?;
/// let beta = Tensor::zeros(&[512], Format::BF16);
/// let r: Policy = "in=bf16,acc=f32,out=f32".parse()?;
/// let c = r.clone().with_order(Order::pairwise(8));
/// let data = NormData { x: &x, weight: &gamma, bias: Some(&beta), eps: 1e-5 };
/// let side = |p| NormSide { op: NormOp::LayerNorm(Variance::TwoPass), policy: p };
/// let conf = Confidence::default_probabilistic();
/// let fast = norm_threshold_priced(&data, side(&r), side(&c), conf, Pricing::Fast)?;
/// let walk = norm_threshold_priced(&data, side(&r), side(&c), conf, Pricing::Walk)?;
/// let (yr, _) = layer_norm(&x, &gamma, &beta, 1e-5, Variance::TwoPass, &r)?;
/// let (yc, _) = layer_norm(&x, &gamma, &beta, 1e-5, Variance::TwoPass, &c)?;
/// assert!(fast.check(&yr, &yc).passed && walk.check(&yr, &yc).passed);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// As [`norm_threshold`].
pub fn norm_threshold_priced(
    data: &NormData<'_>,
    reference: NormSide<'_>,
    candidate: NormSide<'_>,
    confidence: Confidence,
    pricing: Pricing,
) -> Result<Threshold> {
    let probabilistic = matches!(confidence, Confidence::Probabilistic { .. });
    let fast = match pricing {
        Pricing::Walk => false,
        Pricing::Fast => true,
        Pricing::Auto => {
            let n = data.x.shape().last().copied().unwrap_or(0);
            probabilistic && data.x.len() >= NORM_FAST_ELEMENTS && n >= NORM_FAST_ROW
        }
    };
    let walk = |conf| norm_model(data, reference, candidate, conf, false);
    let exec = || executions(data, reference, candidate);
    if !(fast && probabilistic) {
        return checked_by_executions(confidence, &walk, &exec);
    }
    let compiled = |conf| norm_model(data, reference, candidate, conf, true);
    checked_by_executions_tiered(confidence, &[&compiled, &walk], &exec)
}

/// Both sides' normalization as the engine executes them (for every member of a family),
/// `None` where it cannot (an engine error).
pub(crate) fn executions(
    data: &NormData<'_>,
    reference: NormSide<'_>,
    candidate: NormSide<'_>,
) -> Option<Executions> {
    each_member((reference.policy, candidate.policy), |cand, p| {
        let op = if cand { candidate.op } else { reference.op };
        let variance = match op {
            NormOp::LayerNorm(v) => Some(v),
            NormOp::RmsNorm => None,
        };
        let (x, w, b, eps) = (data.x, data.weight, data.bias, data.eps);
        crate::engine::nn::norm_forward(x, w, b, eps, variance, p)
            .ok()
            .map(|(y, _)| y.into_values())
    })
}

/// [`norm_threshold`] as the model prices it (not checked by the executions), each side's
/// sums by the walk or, `fast`, by the compiled all-random model (a side outside it stays on
/// the walk).
fn norm_model(
    data: &NormData<'_>,
    reference: NormSide<'_>,
    candidate: NormSide<'_>,
    confidence: Confidence,
    fast: bool,
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
    // The exact model of one row: μ, the variance about it, rstd, x̂ and y.
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
        (mu, var, rstd, xhat, y)
    };
    let mut norm_sq = 0.0;
    let mut undefined = None;
    for r in 0..rows {
        let (_, _, rstd, _, y) = exact_row(&xi.values()[r * n..(r + 1) * n]);
        if !rstd.is_finite() && undefined.is_none() {
            undefined = Some(r);
        }
        norm_sq += y.iter().map(|v| v * v).sum::<f64>();
    }
    if identical {
        return Ok(Threshold::identical(confidence, norm_sq.sqrt(), rows * n));
    }
    // A row whose exact variance + ε is 0 (a constant row with ε = 0): the exact
    // normalization is 0/0, and no threshold around it exists — the sides' outputs are NaN,
    // or finite values of their rounding errors alone (a one-pass variance that rounds away
    // from 0), which a threshold would wave through (it was priced NaN).
    if let Some(r) = undefined {
        return Err(Error::NoFiniteBound {
            what: format!("{ref_op:?} against {cand_op:?}, row {r} of {rows}"),
            reason: format!(
                "its exact variance + eps is 0 (eps = {eps:e}): the exact normalization is \
                 0/0 and the outputs are rounding errors alone; use eps > 0"
            ),
        });
    }
    // Correlated components, priced once with their multiplicity (grouped_threshold):
    // identical rows; within a row, elements with identical (x, γ, β); and the roundings of
    // dᵢ = x − μ̂ that share a grid and a residue of x on it (integers, constants), which err
    // alike whatever μ̂ is.
    let (_, classes) = row_classes(xi.values(), n);
    // Elements with identical (x, γ, β) are one component: (γ, β) classed once for every
    // row, each row's elements then by (x, class of (γ, β)).
    let weight_class: Vec<u64> = crate::bounds::keyed::class_ids_of_pairs(
        &(0..n)
            .map(|i| (w.values()[i].to_bits(), bias_at(i).to_bits()))
            .collect::<Vec<_>>(),
    )
    .into_iter()
    .map(u64::from)
    .collect();
    let (fast_r, fast_c) = if fast {
        (
            FastSums::new(ref_op, reference, n),
            FastSums::new(cand_op, candidate, n),
        )
    } else {
        (None, None)
    };
    // Each class of rows priced alone (in parallel; concatenated in order below, so that the
    // threshold does not depend on the number of threads).
    let priced = crate::parallel::map(
        &classes,
        |&(r, count)| -> Result<Vec<(ElementDiff, usize)>> {
            let mut groups: Vec<(ElementDiff, usize)> = vec![];
            let row = &xi.values()[r * n..(r + 1) * n];
            let (mean, variance, rstd, xhat, y) = exact_row(row);
            // Constant and near-constant rows (|mean| ≥ 256 standard deviations) stay on the
            // walk: their sums' roundings are the determined ones it computes (the all-random
            // model prices them 5–10× wider). The exact model's mean and variance are the
            // row's own for LayerNorm; RMSNorm's model does not centre.
            let near_constant = || {
                let (mu, var) = if centered {
                    (mean, variance)
                } else {
                    let mu = row.iter().sum::<f64>() / n as f64;
                    (
                        mu,
                        row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / n as f64,
                    )
                };
                var.is_nan() || var <= mu * mu * NEAR_CONSTANT
            };
            let (fr, fc) = if fast && !near_constant() {
                (fast_r.as_ref(), fast_c.as_ref())
            } else {
                (None, None)
            };
            let sr = side_row(row, ref_op, eps, reference, one_kernel, fr)?;
            let sc = side_row(row, cand_op, eps, candidate, cand_one_kernel, fc)?;
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
            let keys: Vec<(u64, u64)> = row
                .iter()
                .zip(&weight_class)
                .map(|(x, &c)| (x.to_bits(), c))
                .collect();
            let elements = crate::bounds::keyed::classes_of_pairs(&keys);
            for (i, (&xv, &gi)) in row.iter().zip(w.values()).enumerate() {
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
            for &(i, cnt) in &elements {
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

/// `layernorm` and `rmsnorm` in the op registry: over the last dimension of `x`, with
/// `weight` (γ) and LayerNorm's optional `bias` (β), ε from [`OpOptions::norm_eps`], each
/// side's LayerNorm variance from [`OpSide::variance`]; threshold [`norm_threshold_priced`]
/// with [`OpOptions::pricing`]; gain
/// max|γ|·max rstd in x (first order, [`norm_gain`](crate::bounds::norm_gain)), rstd of each
/// row computed in f64. Prices `norm` modules.
#[derive(Debug, Clone, Copy)]
pub struct NormModel {
    /// RMSNorm rather than LayerNorm.
    pub rms: bool,
}

impl OpModel for NormModel {
    fn operand_names(&self) -> &'static [&'static str] {
        if self.rms {
            &["x", "weight"]
        } else {
            &["x", "weight", "bias"]
        }
    }

    fn arity(&self) -> (usize, Option<usize>) {
        if self.rms {
            (2, Some(2))
        } else {
            (2, Some(3))
        }
    }

    fn operands(&self, m: usize, k: usize, _: usize) -> Vec<Operand> {
        let mut v = vec![
            Operand::new("x", &[m, k], OperandRole::Data),
            Operand::new("weight", &[k], OperandRole::NormWeight),
        ];
        if !self.rms {
            v.push(Operand::new("bias", &[k], OperandRole::NormBias));
        }
        v
    }

    fn threshold(
        &self,
        inputs: &[&Tensor],
        reference: &OpSide,
        candidate: &OpSide,
        options: &OpOptions,
        confidence: Confidence,
    ) -> Result<Threshold> {
        let side = |s: &OpSide| {
            if self.rms {
                NormOp::RmsNorm
            } else {
                NormOp::LayerNorm(s.variance)
            }
        };
        norm_threshold_priced(
            &NormData {
                x: inputs[0],
                weight: inputs[1],
                bias: inputs.get(2).copied(),
                eps: options.norm_eps,
            },
            NormSide {
                op: side(reference),
                policy: &reference.policy,
            },
            NormSide {
                op: side(candidate),
                policy: &candidate.policy,
            },
            confidence,
            options.pricing,
        )
    }

    fn gain(&self, inputs: &[&Tensor], options: &OpOptions) -> Result<Gain> {
        let x = inputs[0];
        let k = x.shape().last().copied().unwrap_or(1).max(1);
        let rstd: Vec<f64> = x
            .values()
            .chunks(k)
            .map(|row| {
                let n = row.len() as f64;
                let mean = if self.rms {
                    0.0
                } else {
                    row.iter().sum::<f64>() / n
                };
                let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
                1.0 / (var + options.norm_eps).sqrt()
            })
            .collect();
        Ok(crate::bounds::norm_gain(inputs[1], &rstd))
    }

    fn module_kinds(&self) -> &'static [ModuleKind] {
        &[ModuleKind::Norm]
    }
}

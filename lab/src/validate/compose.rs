//! End-to-end (composed) thresholds by **difference simulation**, and the paper's
//! perturbation-based estimate.
//!
//! Difference simulation (papers/sharding.md §4). A sharded run differs from the reference
//! only at the *fresh sites* ([`fresh_sites`](crate::validate::fresh::fresh_sites)), where
//! the same inputs are reduced in another order; everything downstream differs because its
//! inputs differ, through the reference's own arithmetic — including every rounding, which
//! turns a small input difference into 0 or ±1 ulp. So we sample the difference: re-run the
//! reference step (same recipe, same FP8 scales) and at every fresh site replace the output
//! y by y + D with D the site's modelled difference after the output rounding: ε ~ N(0, Eε²)
//! from the site's reduction model, then D = ulp·⌊ε/ulp⌋ or ulp·⌈ε/ulp⌉ with probability
//! given by the fractional part — the law of fl(ŷ + ε) − fl(ŷ) when the position of ŷ on the
//! output grid is uniform (the uniform-phase model of `bounds::compare`). Downstream, the
//! engine propagates the perturbed values with the reference's arithmetic, so the sample of
//! cand − ref is taken through the real rounding behaviour, not a linearization.
//!
//! From m samples Dₛ of a tensor's difference (zero-mean under the model, covariance Σ):
//! * tr Σ is estimated by mean‖Dₛ‖² and tr Σ² by the mean of ⟨D_a, D_b⟩² over pairs a ≠ b
//!   (unbiased for independent samples); r = (tr Σ)² / tr Σ² is the effective rank.
//! * Estimation: treating m·‖D‖²/tr Σ summed over samples as χ² with m·r degrees of freedom,
//!   tr Σ ≤ m·r·mean‖D‖² / χ²_{m·r}(δ_est) with probability ≥ 1 − δ_est.
//! * Tail: for Gaussian D, ‖D‖² ≤ tr Σ + 2√(tr Σ²·t) + 2‖Σ‖t with t = ln(1/δ) (Hsu, Kakade &
//!   Zhang 2012, Thm 1), and ‖Σ‖ ≤ √tr Σ² = tr Σ/√r, so
//!   ‖D‖² ≤ tr Σ·(1 + 2√(t/r) + 2t/√r).
//!
//! The threshold holds with probability ≥ 1 − δ − δ_est under the model (Gaussian site errors
//! of the modelled variance, uniform phase). A tensor with no fresh site upstream gets a zero
//! threshold: the sharded run must reproduce it bit for bit. When every sample agrees (no
//! spread: a discrete event such as a rounding flip occurred in none of them) a fresh site
//! falls back to its own analytic bound |Dᵢ| ≤ σᵢ·√(2 ln(2n/δ)) + ulpᵢ, and a tensor no
//! sample moved although an input of its module moved is allowed one ulp of its largest
//! element (a rare flip the samples could not rule out).
//!
//! Perturbation estimate (TTrace §2.2 as the notes reconstruct it): re-run the reference with
//! its first activation (the embedding output) perturbed by a relative noise of size u
//! (xᵢ(1 + u·ξᵢ), ξ standard normal, stochastically rounded back onto the grid); the
//! estimate for a tensor is the largest relative change over the samples.

use std::collections::HashMap;

use serde::Serialize;
use statrs::distribution::{ChiSquared, ContinuousCDF};

use crate::validate::fresh::FreshSites;
use ttrace::check::NORM_SHARE;
use ttrace::engine::Gpt;
use ttrace::engine::SplitMix64;
use ttrace::trace::Trace;
use ttrace::trace::{TensorId, TensorRole};
use ttrace::Tensor;
use ttrace::{Error, Result};
use ttrace::{Format, Overflow};

/// Settings of the difference simulation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SimulationConfig {
    /// Samples (≥ 2).
    pub samples: usize,
    /// Failure probability of the tail bound.
    pub delta: f64,
    /// Failure probability of the variance estimate.
    pub delta_estimate: f64,
    /// Seed of the simulated noise.
    pub seed: u64,
}

impl Default for SimulationConfig {
    /// 12 samples, δ = 10⁻⁶, δ_est = 10⁻³.
    fn default() -> Self {
        SimulationConfig {
            samples: 12,
            delta: 1e-6,
            delta_estimate: 1e-3,
            seed: 0x5eed,
        }
    }
}

/// A composed threshold for one traced tensor.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Composed {
    /// Bound on ‖cand − ref‖_F.
    pub abs: f64,
    /// Bound on ‖cand − ref‖_F / ‖ref‖_F.
    pub relative: f64,
    /// √(mean ‖Dₛ‖²) / ‖ref‖: the typical relative difference.
    pub expected_relative: f64,
    /// Effective rank r of the difference's covariance (1 … elements).
    pub effective_rank: f64,
    /// Bounds on the per-channel and per-row offsets, for tensors of two or more dimensions
    /// and rows.
    pub offsets: OffsetBounds,
}

/// The per-channel and per-row offset bounds of a tensor, each judged at
/// [`OFFSET_SHARE`]·δ taken from the norm's share.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct OffsetBounds {
    /// Bound on ‖column means of cand − ref‖ (the per-channel offset: the mean over rows of
    /// each index of the last dimension).
    pub channel: Option<f64>,
    /// Bound on ‖row means of cand − ref‖ (the per-row offset: a token's mean over the last
    /// dimension).
    pub row: Option<f64>,
}

impl OffsetBounds {
    /// The per-channel and per-row offset tests on a pair: ‖means of c − r‖ against each
    /// bound, the estimate and threshold as root mean squares over the means relative to the
    /// reference's, in units of `eps` ([`Detector::Channel`](ttrace::check::Detector),
    /// `Row`). None for a tensor that is not a matrix, an all-zero reference, or non-finite
    /// values (judged by the norm).
    pub(crate) fn findings(
        &self,
        shape: &[usize],
        r: &[f64],
        c: &[f64],
        eps: f64,
    ) -> Vec<ttrace::check::Finding> {
        let tests = [(Axis::Columns, self.channel), (Axis::Rows, self.row)];
        let Some((rows, cols)) = matrix_shape(shape) else {
            return Vec::new();
        };
        if tests.iter().all(|(_, b)| b.is_none()) || r.iter().chain(c).any(|x| !x.is_finite()) {
            return Vec::new();
        }
        let rms = norm(r) / (r.len().max(1) as f64).sqrt();
        if rms == 0.0 {
            return Vec::new();
        }
        let d: Vec<f64> = c.iter().zip(r).map(|(b, a)| b - a).collect();
        tests
            .into_iter()
            .filter_map(|(axis, bound)| {
                let bound = bound?;
                let offset = norm(&axis.means(&d, cols));
                let unit = (axis.count(rows, cols) as f64).sqrt() * rms * eps;
                let ratio = if offset == 0.0 {
                    0.0
                } else if bound > 0.0 {
                    offset / bound
                } else {
                    f64::INFINITY
                };
                Some(ttrace::check::Finding {
                    detector: axis.detector(),
                    estimate: offset / unit,
                    threshold: bound / unit,
                    ratio,
                    fired: ratio > 1.0,
                    at: None,
                    count: 0,
                })
            })
            .collect()
    }
}

/// The share of the per-tensor false-alarm budget δ each of the per-channel and per-row
/// offset tests takes from the norm's ([`NORM_SHARE`]) on tensors of two or more dimensions
/// (papers/checking.md §7).
pub const OFFSET_SHARE: f64 = 1.0 / 30.0;

/// The mean over each row (`Rows`) or over each column (`Columns`) of a matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Axis {
    /// The column means: per-channel offsets.
    Columns,
    /// The row means: per-row (per-token) offsets.
    Rows,
}

impl Axis {
    /// The means of `v` read as rows of `cols`.
    pub(crate) fn means(self, v: &[f64], cols: usize) -> Vec<f64> {
        match self {
            Axis::Columns => {
                let mut out = vec![0.0; cols];
                for row in v.chunks_exact(cols.max(1)) {
                    for (o, x) in out.iter_mut().zip(row) {
                        *o += x;
                    }
                }
                let rows = (v.len() / cols.max(1)).max(1) as f64;
                out.iter_mut().for_each(|o| *o /= rows);
                out
            }
            Axis::Rows => v
                .chunks_exact(cols.max(1))
                .map(|row| row.iter().sum::<f64>() / cols.max(1) as f64)
                .collect(),
        }
    }

    /// How many values each mean averages.
    fn averaged(self, rows: usize, cols: usize) -> usize {
        match self {
            Axis::Columns => rows,
            Axis::Rows => cols,
        }
    }

    /// How many means.
    fn count(self, rows: usize, cols: usize) -> usize {
        match self {
            Axis::Columns => cols,
            Axis::Rows => rows,
        }
    }

    fn detector(self) -> ttrace::check::Detector {
        match self {
            Axis::Columns => ttrace::check::Detector::Channel,
            Axis::Rows => ttrace::check::Detector::Row,
        }
    }
}

/// (rows, columns) of a tensor read as a matrix along its last dimension, when it has two or
/// more dimensions and rows.
pub(crate) fn matrix_shape(shape: &[usize]) -> Option<(usize, usize)> {
    let cols = *shape.last()?;
    let n: usize = shape.iter().product();
    (shape.len() >= 2 && cols > 0 && n / cols >= 2).then(|| (n / cols, cols))
}

/// A composed bound from simulated difference vectors (see [`composed_thresholds`]).
struct Spread {
    /// The bound: ‖mean‖ + the spread's tail, never below the largest sample's norm.
    abs: f64,
    mean_norm: f64,
    /// tr of the samples' covariance (0: no spread).
    trc: f64,
    /// Its effective rank.
    rank: f64,
}

/// The mean of the sample vectors (common to every sample: roundings of fixed reference values
/// near a rounding boundary) plus a Hsu–Kakade–Zhang tail of their spread at exp(−`t`), the
/// spread's trace inflated by its χ² confidence bound at `delta_estimate` and its effective
/// rank estimated from independent pair differences.
fn spread_bound(vectors: &[&[f64]], t: f64, delta_estimate: f64) -> Spread {
    let m = vectors.len() as f64;
    let len = vectors.first().map_or(0, |v| v.len());
    let n = len.max(1) as f64;
    let mut mean = vec![0.0; len];
    for v in vectors {
        for (a, b) in mean.iter_mut().zip(v.iter()) {
            *a += b / m;
        }
    }
    let mean_norm = norm(&mean);
    let trc = vectors
        .iter()
        .map(|v| {
            v.iter()
                .zip(&mean)
                .map(|(x, mu)| (x - mu) * (x - mu))
                .sum::<f64>()
        })
        .sum::<f64>()
        / (m - 1.0);
    // tr Σ² from independent zero-mean vectors E_j = (D_2j − D_2j+1)/√2.
    let diffs: Vec<Vec<f64>> = (0..vectors.len() / 2)
        .map(|j| {
            vectors[2 * j]
                .iter()
                .zip(vectors[2 * j + 1].iter())
                .map(|(a, b)| (a - b) / std::f64::consts::SQRT_2)
                .collect()
        })
        .collect();
    let mut pairs = 0.0;
    let mut tr2 = 0.0;
    for a in 0..diffs.len() {
        for b in a + 1..diffs.len() {
            let dot: f64 = diffs[a].iter().zip(&diffs[b]).map(|(x, y)| x * y).sum();
            tr2 += dot * dot;
            pairs += 1.0;
        }
    }
    let rank = if pairs > 0.0 && tr2 > 0.0 && trc > 0.0 {
        (trc * trc / (tr2 / pairs)).clamp(1.0, n)
    } else {
        1.0
    };
    let nu = (m - 1.0) * rank;
    let q = chi_squared_lower_quantile(nu, delta_estimate);
    let est = if q > 0.0 { nu / q } else { f64::INFINITY };
    let hkz = 1.0 + 2.0 * (t / rank).sqrt() + 2.0 * t / rank.sqrt();
    let spread = (trc * est * hkz).sqrt();
    // Never below the largest simulated difference: every sample is a possible outcome
    // (this matters for mixtures, e.g. a rare rounding flip seen in one sample).
    let largest = vectors.iter().map(|v| norm(v)).fold(0.0, f64::max);
    Spread {
        abs: (mean_norm + spread * (1.0 + 1.0 / m).sqrt()).max(largest),
        mean_norm,
        trc,
        rank,
    }
}

/// Stochastic rounding of a difference `e` onto the grid of `fmt` at value `v`: the law of
/// fl(v + e) − v for v on the grid with a uniform phase; returns the new value.
pub fn perturb_on_grid(fmt: Format, v: f64, e: f64, rng: &mut SplitMix64) -> f64 {
    let ulp = fmt.ulp(v).unwrap_or(0.0);
    if ulp == 0.0 || e == 0.0 {
        return v;
    }
    let k = e / ulp;
    let f = k.floor();
    let step = if rng.uniform() < k - f { f + 1.0 } else { f };
    fmt.round(v + step * ulp, Overflow::NonSaturating)
}

fn ids_of(trace: &Trace) -> Vec<String> {
    trace.ids().map(str::to_string).collect()
}

/// Differences of `sample` from `reference`, per id.
fn differences(reference: &Trace, sample: &Trace) -> Result<Vec<Vec<f64>>> {
    ids_of(reference)
        .iter()
        .map(|id| {
            let r = reference.require(id)?;
            let s = sample.require(id)?;
            Ok(s.values()
                .iter()
                .zip(r.values())
                .map(|(a, b)| a - b)
                .collect())
        })
        .collect()
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// Whether a tensor the module producing `id` reads (its forward inputs; for gradients also
/// the arriving output gradient) differs from the reference in some sample.
fn upstream_moved(
    reference: &Trace,
    samples: &[Vec<Vec<f64>>],
    index: &HashMap<&str, usize>,
    id: &str,
) -> bool {
    let Some(t) = TensorId::parse(id) else {
        return false;
    };
    let module = t.module.as_str();
    let mut inputs: Vec<String> = reference
        .ids()
        .filter(|i| {
            TensorId::parse(i)
                .is_some_and(|x| x.module == module && matches!(x.role, TensorRole::FwdInput(_)))
        })
        .map(str::to_string)
        .collect();
    if t.role != TensorRole::FwdOutput(0) {
        inputs.push(TensorId::grad_output(module, 0).to_string());
    }
    inputs.iter().any(|i| {
        index
            .get(i.as_str())
            .is_some_and(|&k| samples.iter().any(|s| s[k].iter().any(|&x| x != 0.0)))
    })
}

/// A lower bound q of the `p`-quantile of χ²_ν (P(χ²_ν ≤ q) ≤ p), as close as the
/// distribution function allows: statrs' inverse where it is one (it returns NaN beyond
/// ν ≈ 2.5·10⁵, where a vacuous threshold followed), else bisection on the distribution
/// function from Laurent and Massart's bound P(χ²_ν ≤ ν − 2√(νx)) ≤ e^(−x) (Ann. Statist.
/// 28(5), 2000, Lemma 1; a Gamma variable of any real shape has the same lower tail), which is
/// the answer where even the distribution function fails. 0 when no positive bound exists.
pub(crate) fn chi_squared_lower_quantile(nu: f64, p: f64) -> f64 {
    let Ok(c) = ChiSquared::new(nu) else {
        return 0.0;
    };
    let below = |q: f64| {
        let f = c.cdf(q);
        f.is_finite() && f <= p
    };
    let q = c.inverse_cdf(p);
    // The inverse is accepted when it is within a part in 10⁹ of the true quantile's lower
    // side (its own tolerance), so that the bound stays a bound.
    if q.is_finite() && q > 0.0 {
        let q = q * (1.0 - 1e-9);
        if below(q) {
            return q;
        }
    }
    let lm = (nu - 2.0 * (nu * (1.0 / p).ln()).sqrt()).max(0.0);
    // The distribution function must bracket p between the bound and ν; where it does not
    // (it failed, or p is not small), the bound is the answer.
    if !below(lm) || below(nu) {
        return lm;
    }
    // cdf(lo) ≤ p < cdf(hi).
    let (mut lo, mut hi) = (lm, nu);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        if below(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Composed thresholds for every traced tensor of `reference`, the last step of a model whose
/// state before that step is `before`.
///
/// # Errors
/// [`Error::InvalidParameter`] for fewer than 2 samples or a probability outside (0, 1);
/// [`Error::NoFiniteBound`] when a tensor's threshold would be infinite (never a vacuous
/// threshold); errors of the simulated steps.
pub fn composed_thresholds(
    before: &Gpt,
    reference: &Trace,
    sites: &FreshSites,
    config: SimulationConfig,
) -> Result<HashMap<String, Composed>> {
    if config.samples < 2 {
        return Err(Error::InvalidParameter {
            name: "samples",
            reason: format!(
                "difference simulation needs at least 2 samples (got {})",
                config.samples
            ),
        });
    }
    for (name, d) in [
        ("delta", config.delta),
        ("delta_estimate", config.delta_estimate),
    ] {
        if !(d > 0.0 && d < 1.0) {
            return Err(Error::InvalidParameter {
                name,
                reason: format!("a probability strictly between 0 and 1 is required (got {d})"),
            });
        }
    }
    let mut samples = Vec::with_capacity(config.samples);
    for s in 0..config.samples {
        let mut model = before.clone();
        let seed = config.seed ^ (s as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut hook = |id: &str, t: &mut Tensor| -> Result<()> {
            let Some(var) = sites.get(id) else {
                return Ok(());
            };
            let mut rng = SplitMix64::for_name(id, seed);
            let fmt = t.format();
            let vals: Vec<f64> = t
                .values()
                .iter()
                .zip(var)
                .map(|(&v, &e2)| {
                    let e = e2.sqrt() * rng.normal();
                    perturb_on_grid(fmt, v, e, &mut rng)
                })
                .collect();
            *t = Tensor::from_parts_unchecked(t.shape(), vals, fmt);
            Ok(())
        };
        let trace = model.step_with(&mut hook)?.trace;
        samples.push(differences(reference, &trace)?);
    }
    let m = config.samples as f64;
    let index: HashMap<&str, usize> = reference.ids().enumerate().map(|(k, id)| (id, k)).collect();
    // The norm test spends NORM_SHARE of the per-tensor false-alarm budget (papers/checking.md
    // §7); on a matrix it leaves OFFSET_SHARE of it to each of the per-channel and per-row
    // offsets.
    let t_norm = (1.0 / (config.delta * NORM_SHARE)).ln();
    let t_split = (1.0 / (config.delta * (NORM_SHARE - 2.0 * OFFSET_SHARE))).ln();
    let t_offset = (1.0 / (config.delta * OFFSET_SHARE)).ln();
    let mut out = HashMap::new();
    for (k, id) in reference.ids().enumerate() {
        let r = reference.require(id)?;
        let n = r.len().max(1) as f64;
        let rnorm = norm(r.values());
        let sq: Vec<f64> = samples
            .iter()
            .map(|s| s[k].iter().map(|x| x * x).sum())
            .collect();
        let tr = sq.iter().sum::<f64>() / m;
        // The site's own analytic bound (a fresh site's difference before anything
        // propagates): |Dᵢ| ≤ |εᵢ| + ulpᵢ with |εᵢ| ≤ σᵢ·√(2 ln(2n/δ)) for all i at once.
        let channels = matrix_shape(r.shape());
        let share = if channels.is_some() {
            NORM_SHARE - 2.0 * OFFSET_SHARE
        } else {
            NORM_SHARE
        };
        let local = sites.get(id).map(|var| {
            let z = (2.0 * (2.0 * n / (config.delta * share)).ln()).sqrt();
            let fmt = r.format();
            var.iter()
                .zip(r.values())
                .map(|(&e2, &v)| {
                    if e2 > 0.0 {
                        (e2.sqrt() * z + fmt.ulp(v).unwrap_or(0.0)).powi(2)
                    } else {
                        0.0
                    }
                })
                .sum::<f64>()
                .sqrt()
        });
        if tr == 0.0 && local.unwrap_or(0.0) == 0.0 {
            // No sample moved this tensor. If an input of its module moved in some sample, a
            // rounding flip of one element is still possible (the samples only say it is
            // not frequent): allow one ulp of its largest element. Otherwise nothing that
            // differs reaches it: it must be bit-identical.
            let abs = if upstream_moved(reference, &samples, &index, id) {
                let fmt = r.format();
                r.values()
                    .iter()
                    .map(|&v| fmt.ulp(v).unwrap_or(0.0))
                    .fold(0.0, f64::max)
            } else {
                0.0
            };
            out.insert(
                id.to_string(),
                Composed {
                    abs,
                    relative: if abs == 0.0 {
                        0.0
                    } else if rnorm > 0.0 {
                        abs / rnorm
                    } else {
                        f64::INFINITY
                    },
                    expected_relative: 0.0,
                    effective_rank: n,
                    offsets: OffsetBounds {
                        channel: channels.map(|(rows, _)| abs / (rows as f64).sqrt()),
                        row: channels.map(|(_, cols)| abs / (cols as f64).sqrt()),
                    },
                },
            );
            continue;
        }
        let vectors: Vec<&[f64]> = samples.iter().map(|smp| smp[k].as_slice()).collect();
        let t = if channels.is_some() { t_split } else { t_norm };
        let b = spread_bound(&vectors, t, config.delta_estimate);
        let (mean_norm, trc, rank) = (b.mean_norm, b.trc, b.rank);
        let mut abs = b.abs;
        if trc == 0.0 {
            // No spread in the samples (a rare discrete event did not occur in any of them):
            // fall back to the site's analytic bound.
            abs = mean_norm + local.unwrap_or(0.0);
        }
        // The per-channel and per-row offsets: the samples' column (row) means, bounded the
        // same way at OFFSET_SHARE·δ each; never looser than what the norm's bound implies
        // (‖column means‖ ≤ ‖D‖/√rows, ‖row means‖ ≤ ‖D‖/√columns), which is also the answer
        // without spread.
        let offset = |axis: Axis| {
            channels.map(|(rows, cols)| {
                let means: Vec<Vec<f64>> = vectors.iter().map(|v| axis.means(v, cols)).collect();
                let views: Vec<&[f64]> = means.iter().map(Vec::as_slice).collect();
                let c = spread_bound(&views, t_offset, config.delta_estimate);
                let implied = abs / (axis.averaged(rows, cols) as f64).sqrt();
                if c.trc > 0.0 {
                    c.abs.min(implied)
                } else {
                    implied
                }
            })
        };
        let offsets = OffsetBounds {
            channel: offset(Axis::Columns),
            row: offset(Axis::Rows),
        };
        if !abs.is_finite() {
            // A threshold of ∞ would pass anything: say so instead.
            return Err(Error::NoFiniteBound {
                what: format!("the composed threshold of {id}"),
                reason: format!(
                    "the difference simulation gave mean ‖D‖ = {mean_norm:e}, spread² = \
                     {trc:e}, effective rank {rank}"
                ),
            });
        }
        out.insert(
            id.to_string(),
            Composed {
                abs,
                relative: if rnorm > 0.0 {
                    abs / rnorm
                } else {
                    f64::INFINITY
                },
                expected_relative: if rnorm > 0.0 {
                    tr.sqrt() / rnorm
                } else {
                    f64::INFINITY
                },
                effective_rank: rank,
                offsets,
            },
        );
    }
    Ok(out)
}

/// The perturbation estimate: the largest relative change of each traced tensor over
/// `samples` runs with the embedding output perturbed by relative noise of size u of its
/// format.
pub fn perturbation_estimate(
    before: &Gpt,
    reference: &Trace,
    samples: usize,
    seed: u64,
) -> Result<HashMap<String, f64>> {
    let mut out: HashMap<String, f64> = HashMap::new();
    for s in 0..samples {
        let mut model = before.clone();
        let mut hook = |id: &str, t: &mut Tensor| -> Result<()> {
            if id != "embedding|fwd.output.0" {
                return Ok(());
            }
            let mut rng = SplitMix64::for_name(id, seed ^ (s as u64 + 1));
            let fmt = t.format();
            let u = fmt.unit_roundoff();
            let vals: Vec<f64> = t
                .values()
                .iter()
                .map(|&v| {
                    let e = v * u * rng.normal();
                    perturb_on_grid(fmt, v, e, &mut rng)
                })
                .collect();
            *t = Tensor::from_parts_unchecked(t.shape(), vals, fmt);
            Ok(())
        };
        let trace = model.step_with(&mut hook)?.trace;
        for (id, d) in ids_of(reference)
            .iter()
            .zip(differences(reference, &trace)?)
        {
            let rn = norm(reference.require(id)?.values());
            let rel = if rn > 0.0 { norm(&d) / rn } else { 0.0 };
            let e = out.entry(id.clone()).or_insert(0.0);
            *e = e.max(rel);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ttrace::engine::GptConfig;
    use ttrace::Recipe;

    #[test]
    fn column_means_and_the_bound_the_norm_implies() {
        assert_eq!(matrix_shape(&[4, 3]), Some((4, 3)));
        assert_eq!(matrix_shape(&[2, 5, 3]), Some((10, 3)));
        assert_eq!(matrix_shape(&[12]), None); // a vector
        assert_eq!(matrix_shape(&[1, 12]), None); // one row
        assert_eq!(
            Axis::Columns.means(&[1.0, 2.0, 3.0, 5.0], 2),
            vec![2.0, 3.5]
        );
        // ‖column means‖ ≤ ‖D‖/√rows (Cauchy–Schwarz), the bound used without spread.
        let mut g = SplitMix64::for_name("columns", 3);
        for (rows, cols) in [(2, 1), (7, 5), (64, 32)] {
            let d: Vec<f64> = (0..rows * cols).map(|_| g.normal() + 0.3).collect();
            let lhs = norm(&Axis::Columns.means(&d, cols));
            assert!(lhs <= norm(&d) / (rows as f64).sqrt() * (1.0 + 1e-12));
        }
        // The finding: an offset of 2 per column on rows of rms 1 is 2 in rms over the rms.
        let r: Vec<f64> = (0..64)
            .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        let c: Vec<f64> = r.iter().map(|x| x + 2.0).collect();
        let both = OffsetBounds {
            channel: Some(1.0),
            row: Some(4.0),
        };
        let f = both.findings(&[16, 4], &r, &c, 1.0);
        assert_eq!(f.len(), 2);
        assert!(f[0].detector == ttrace::check::Detector::Channel);
        assert!((f[0].estimate - 2.0).abs() < 1e-12 && f[0].fired);
        assert!((f[0].ratio - 4.0).abs() < 1e-12);
        assert!(both.findings(&[64], &r, &c, 1.0).is_empty());
        // Rows: the same offset is 2 per row; 16 rows: ‖row means‖ = 8.
        assert!(f[1].detector == ttrace::check::Detector::Row);
        assert!((f[1].estimate - 2.0).abs() < 1e-12 && f[1].fired);
        assert!((f[1].ratio - 2.0).abs() < 1e-12);
        assert_eq!(Axis::Rows.means(&[1.0, 3.0, 5.0, 7.0], 2), vec![2.0, 6.0]);
        // ‖row means‖ ≤ ‖D‖/√columns likewise.
        for (rows, cols) in [(2, 1), (7, 5), (64, 32)] {
            let d: Vec<f64> = (0..rows * cols).map(|_| g.normal() + 0.3).collect();
            let lhs = norm(&Axis::Rows.means(&d, cols));
            assert!(lhs <= norm(&d) / (cols as f64).sqrt() * (1.0 + 1e-12));
        }
    }

    #[test]
    fn the_chi_squared_quantile_holds_for_every_degree_of_freedom() {
        // Tabulated lower 0.001-quantiles (Abramowitz & Stegun, Table 26.8).
        for (nu, table) in [(11.0, 1.834), (100.0, 61.918)] {
            let q = chi_squared_lower_quantile(nu, 1e-3);
            assert!((q / table - 1.0).abs() < 1e-3, "ν = {nu}: {q}");
        }
        // Beyond ν ≈ 2.5·10⁵ statrs' inverse is NaN (the threshold was infinite): against
        // Wilson–Hilferty, whose relative error is about 10⁻⁷ there, and above Laurent and
        // Massart's bound.
        for nu in [25_708.78f64, 282_796.6, 323_729.77, 1e6, 1e7] {
            let z = 3.090_232_306_167_813_f64; // Φ⁻¹(0.999)
            let a = 2.0 / (9.0 * nu);
            let wh = nu * (1.0 - a - z * a.sqrt()).powi(3);
            let q = chi_squared_lower_quantile(nu, 1e-3);
            assert!(
                q.is_finite() && (q / wh - 1.0).abs() < 1e-6,
                "ν = {nu}: {q} vs {wh}"
            );
            assert!(q > nu - 2.0 * (nu * 1e3f64.ln()).sqrt(), "ν = {nu}");
        }
        assert_eq!(chi_squared_lower_quantile(0.0, 1e-3), 0.0);
    }

    #[test]
    fn stochastic_rounding_onto_the_grid_is_unbiased_and_on_the_grid() {
        let mut rng = SplitMix64::for_name("sr", 1);
        let v = Format::BF16.round(1.3, Overflow::NonSaturating);
        let ulp = Format::BF16.ulp(v).unwrap();
        for frac in [0.1, 0.37, 1.6, -0.8] {
            let e = frac * ulp;
            let n = 200_000;
            let mut mean = 0.0;
            for _ in 0..n {
                let w = perturb_on_grid(Format::BF16, v, e, &mut rng);
                assert_eq!(Format::BF16.round(w, Overflow::NonSaturating), w);
                let k = (w - v) / ulp;
                assert!(k == frac.floor() || k == frac.floor() + 1.0);
                mean += (w - v) / n as f64;
            }
            // Standard error ≤ ulp/(2√n) ≈ 1.1e-3 ulp: 5 standard errors.
            assert!(
                (mean - e).abs() < 6e-3 * ulp,
                "frac {frac}: mean {} vs {e}",
                mean
            );
        }
    }

    #[test]
    fn no_fresh_site_means_zero_thresholds_and_hooks_change_nothing_else() {
        let cfg = GptConfig {
            layers: 1,
            hidden: 16,
            heads: 2,
            seq: 8,
            batch: 2,
            vocab: 16,
            ..GptConfig::default()
        };
        let model = Gpt::new(cfg, Recipe::bf16()).unwrap();
        let reference = model.clone().step().unwrap().trace;
        let th = composed_thresholds(
            &model,
            &reference,
            &FreshSites::new(),
            SimulationConfig::default(),
        )
        .unwrap();
        assert_eq!(th.len(), reference.len());
        assert!(th.values().all(|c| c.abs == 0.0 && c.relative == 0.0));
        let bad = SimulationConfig {
            samples: 1,
            ..SimulationConfig::default()
        };
        assert!(matches!(
            composed_thresholds(&model, &reference, &FreshSites::new(), bad),
            Err(ttrace::Error::InvalidParameter { .. })
        ));
        // The perturbation estimate moves every tensor downstream of the embedding.
        let p = perturbation_estimate(&model, &reference, 2, 3).unwrap();
        assert!(p["lm_head|fwd.output.0"] > 0.0);
        assert!(p["embedding.wpe|param_grad"] > 0.0);
    }
}

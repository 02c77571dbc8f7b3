//! Introduced error of one execution of a reduction (sum, dot product, one matmul element):
//! a guaranteed bound and the statistics of the probabilistic model.
//!
//! Derivation (papers/bounds-reductions.md):
//! * Every rounding j of the reduction rounds an intermediate value ŝⱼ ≈ sⱼ (the exact sum of
//!   the terms it covers, see `order::for_each_rounding`) to a format F, with absolute error
//!   ηⱼ, |ηⱼ| ≤ ulp_F(sⱼ)/2. The total error is Σⱼ ηⱼ to first order (the (1 + δ) factors
//!   multiplying earlier errors are 1 + O(u) and are absorbed in the guaranteed bound).
//! * **Guaranteed**: Higham's bound along each term's path, Σᵢ |tᵢ|·(Π_f (1 + u_f)^(dᵢ,f) − 1)
//!   (Higham 2002, Thm 2.2 and Lemma 3.1; Higham 1993 for general summation trees), plus half
//!   the smallest subnormal for each rounding of an exact product (underflow, Higham 2002 §2.1).
//! * **Probabilistic model** (Higham & Mary 2019; Connolly, Higham & Mary 2021, sharpened by
//!   a distribution): the ηⱼ are independent, zero-mean, and uniform on the grid points
//!   within ±ulpⱼ/2 of the exact value (a rounding of a value whose low-order bits are
//!   random). If the exact value lies on a grid of spacing g ≥ ulpⱼ the rounding is exact;
//!   otherwise E(ηⱼ²) = ulpⱼ²/12 + g²/6. The uniform law is strictly sub-Gaussian — its
//!   variance proxy equals its variance (Buldygin & Kozachenko 2000) — and the model takes the
//!   same for its discrete version on the grid, so E = Σ ηⱼ is sub-Gaussian with proxy Var E:
//!   P(|E| ≥ t) ≤ 2·exp(−t²/(2·Var E)). The variance uses the spacing at the actual partial
//!   sums, not u·Σ|tᵢ|, which is what makes it tight for zero-mean data whose partial sums
//!   grow like √j, and the grid of the terms, which makes it tight when many roundings are
//!   exact (BF16 products accumulated in FP32).

use serde::Serialize;

use crate::error::{Error, Result};
use crate::format::Format;
use crate::order::{for_each_rounding, Accumulation, Operand, Order, Products, RoundingSite};

/// Error statistics of one execution of one reduction, in absolute units of its result.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ReductionError {
    /// |ŝ − s| ≤ `guaranteed` for these terms, whatever the rounding errors are.
    pub guaranteed: f64,
    /// The deterministic part of ŝ − s: the sum of −t over the roundings that absorb a small
    /// operand t entirely (|t| below half the spacing of the other operand's grid).
    pub mean: f64,
    /// Var(ŝ − s) under the uniform random-rounding model; also the sub-Gaussian variance
    /// proxy of the random part under that model.
    pub variance: f64,
    /// Σ ulp/2 over the ties: an exact operand exactly halfway between two points of the
    /// grid the other operand lies on. Its direction follows the parity of the accumulated
    /// value, which structured data can make systematic — the squares of BF16 values in
    /// [0.5, 1) have even integer parts, so a sequential FP32 sum of squares rounds tie after
    /// tie the same way. Treated as a deterministic error of unknown sign, |·| ≤ this.
    pub tie_bound: f64,
}

impl ReductionError {
    /// Errors of two independent executions added (the statistics of their difference).
    pub fn plus(self, other: ReductionError) -> ReductionError {
        ReductionError {
            guaranteed: self.guaranteed + other.guaranteed,
            mean: self.mean + other.mean,
            variance: self.variance + other.variance,
            tie_bound: self.tie_bound + other.tie_bound,
        }
    }
}

/// Whether the rounding of a term into the accumulator (the first load) is a real rounding.
fn load_rounds(acc: &Accumulation, is_dot: bool) -> bool {
    match (is_dot, acc.products) {
        (false, _) => !acc.input.is_subset_of(acc.accumulator),
        (true, Products::Exact) => true,
        (true, Products::Rounded(f)) => !f.is_subset_of(acc.accumulator),
    }
}

fn check_supported(order: &Order) -> Result<()> {
    match order {
        Order::Kahan => Err(Error::InvalidParameter {
            name: "order",
            reason: "no bound is implemented for compensated (Kahan) summation: its rigorous \
                     second-order constant is not derived here"
                .into(),
        }),
        Order::SplitK { inner, .. } => check_supported(inner),
        _ => Ok(()),
    }
}

/// The error of one execution of a reduction of the exact `terms` (the values for a sum, the
/// exact products aᵢbᵢ for a dot product) under `acc`. `is_dot` says whether the terms are
/// products (then `acc.products` applies).
///
/// Cost: O(n + number of roundings) = O(n) for every order.
pub fn reduction_error(terms: &[f64], acc: &Accumulation, is_dot: bool) -> Result<ReductionError> {
    acc.validate()?;
    check_supported(&acc.order)?;
    let n = terms.len();
    // Prefix sums of the exact terms: the value a rounding rounds is a range sum.
    let mut prefix = Vec::with_capacity(n + 1);
    prefix.push(0.0f64);
    let mut run = 0.0;
    for &t in terms {
        run += t;
        prefix.push(run);
    }
    let range_sum = |r: &std::ops::Range<usize>| {
        if r.is_empty() {
            0.0
        } else {
            prefix[r.end] - prefix[r.start]
        }
    };
    // The grid an operand lies on: a term's own last bit, or the spacing of the format an
    // earlier rounding put its value in.
    let quantum = |op: &Operand| -> f64 {
        match op {
            Operand::None => f64::INFINITY,
            Operand::Term(i) => lowest_bit(terms[*i]),
            Operand::Value {
                first,
                second,
                format,
            } => {
                let v = range_sum(first) + range_sum(second);
                if v == 0.0 {
                    format.min_subnormal()
                } else {
                    format.ulp(v).unwrap_or(0.0)
                }
            }
        }
    };
    let mut variance = 0.0;
    let mut mean = 0.0;
    let mut tie_bound = 0.0;
    // A rounding to spacing `ulp` of an exact value on the grid of spacing g: exact when
    // g ≥ ulp; otherwise the error takes the values k·g, |k·g| ≤ ulp/2, uniformly, with
    // E(η²) = ulp²/12 + g²/6 and |η| ≤ ulp/2.
    let site_variance = |f: Format, value: f64, g: f64| -> f64 {
        let ulp = f.ulp(value).unwrap_or(0.0);
        if g >= ulp {
            0.0
        } else {
            ulp * ulp / 12.0 + g * g / 6.0
        }
    };
    // Identical additions onto the same grid make identical errors: an exact small operand t
    // added to a value on the grid of spacing U errs by RN_U(t) − t whatever that value is, so
    // k additions of the same t onto the same U add k·η, not √k·η. Low-precision data repeat
    // (the squares of a BF16 row take as many values as the row), so these sites are grouped
    // by (U, t) and a group of k contributes k²·Var(η).
    // Ordered by key, so that the variance is summed in the same order on every call (a
    // HashMap's iteration order differs between instances: the last bits would too).
    let mut repeats: std::collections::BTreeMap<(u64, u64), (f64, f64)> =
        std::collections::BTreeMap::new();
    // Products rounded to a product format: one rounding per exact product.
    if is_dot {
        if let Products::Rounded(pf) = acc.products {
            for &t in terms {
                variance += site_variance(pf, t, 0.0);
            }
        }
    }
    let value_of = |op: &Operand| -> f64 {
        match op {
            Operand::None => 0.0,
            Operand::Term(i) => terms[*i],
            Operand::Value { first, second, .. } => range_sum(first) + range_sum(second),
        }
    };
    let lr = load_rounds(acc, is_dot);
    for_each_rounding(
        &acc.order,
        n,
        acc.accumulator,
        lr,
        &mut |s: RoundingSite| {
            let v = range_sum(&s.first) + range_sum(&s.second);
            let ulp = s.format.ulp(v).unwrap_or(0.0);
            // Absorption: when the larger operand lies on the result's grid and the rest is
            // smaller than half a spacing, the rounding returns the larger operand and the error
            // is exactly minus the rest — deterministic, and one-signed for positive data.
            let (a, b) = (
                value_of(&s.ops[0]),
                value_of(&s.ops[1]) + s.fused.clone().map(|i| terms[i]).sum::<f64>(),
            );
            let (big_op, small_op, small) = if a.abs() >= b.abs() {
                (&s.ops[0], &s.ops[1], b)
            } else {
                (&s.ops[1], &s.ops[0], a)
            };
            let big_on_grid = (s.fused.is_empty() || a.abs() >= b.abs()) && quantum(big_op) >= ulp;
            if big_on_grid && small != 0.0 && small.abs() < ulp / 2.0 {
                mean -= small;
                return;
            }
            // A tie: an exact small operand exactly halfway between grid points.
            let small_exact = !s.fused.is_empty() || matches!(small_op, Operand::Term(_));
            if big_on_grid && small_exact && ulp > 0.0 {
                let r = small / ulp;
                if r - r.floor() == 0.5 {
                    tie_bound += ulp / 2.0;
                    return;
                }
            }
            let mut g = quantum(&s.ops[0]).min(quantum(&s.ops[1]));
            for i in s.fused.clone() {
                g = g.min(lowest_bit(terms[i]));
            }
            let var = site_variance(s.format, v, g);
            if big_on_grid && small_exact && var > 0.0 {
                let e = repeats
                    .entry((ulp.to_bits(), small.to_bits()))
                    .or_insert((0.0, var));
                e.0 += 1.0;
            } else {
                variance += var;
            }
        },
    );
    for (count, var) in repeats.values() {
        variance += count * count * var;
    }
    // Guaranteed: Higham's per-term bound from the depths.
    let depths = if is_dot {
        acc.dot_depths(n)?
    } else {
        acc.sum_depths(n)?
    };
    let mut guaranteed = 0.0;
    let mut roundings = 0u64;
    for (t, d) in terms.iter().zip(&depths) {
        guaranteed += t.abs() * d.relative_error_bound();
        roundings += d.total() as u64;
    }
    if is_dot && acc.products == Products::Exact {
        // A rounding of a sum that includes an exact product may underflow: at most half the
        // smallest subnormal of the accumulator per rounding (counted generously).
        guaranteed += roundings as f64 * acc.accumulator.min_subnormal() / 2.0;
    }
    let mut e = with_growth(guaranteed * (1.0 + 1e-12), variance, &depths);
    e.mean = mean;
    e.tie_bound = tie_bound.min(e.guaranteed);
    Ok(e)
}

/// The weight of the lowest set bit of `x` (+inf for zero): the grid an exact term lies on.
fn lowest_bit(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return f64::INFINITY;
    }
    let bits = x.abs().to_bits();
    let field = (bits >> 52) as i32;
    let frac = bits & ((1u64 << 52) - 1);
    let (m, e) = if field == 0 {
        (frac, -1074)
    } else {
        (frac | (1u64 << 52), field - 1075)
    };
    let k = e + m.trailing_zeros() as i32;
    if k >= -1022 {
        f64::from_bits(((k + 1023) as u64) << 52)
    } else {
        f64::from_bits(1u64 << (k + 1074))
    }
}

/// Summary statistics of i.i.d. terms, for planning without data.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TermStats {
    /// E(t).
    pub mean: f64,
    /// E(t²).
    pub mean_square: f64,
    /// E|t|.
    pub mean_abs: f64,
}

impl TermStats {
    /// Statistics of a product a·b of independent a and b with the given statistics.
    pub fn product(a: TermStats, b: TermStats) -> TermStats {
        TermStats {
            mean: a.mean * b.mean,
            mean_square: a.mean_square * b.mean_square,
            mean_abs: a.mean_abs * b.mean_abs,
        }
    }

    /// A normal distribution N(mean, std²).
    pub fn normal(mean: f64, std: f64) -> TermStats {
        // E|X| of a normal: std·√(2/π)·exp(−μ²/2σ²) + μ·(1 − 2Φ(−μ/σ)); with μ = 0: std·√(2/π).
        let mean_abs = if mean == 0.0 {
            std * (2.0 / std::f64::consts::PI).sqrt()
        } else {
            // Upper bound sqrt(E[X²]) (Jensen) when μ ≠ 0.
            (mean * mean + std * std).sqrt()
        };
        TermStats {
            mean,
            mean_square: mean * mean + std * std,
            mean_abs,
        }
    }
}

/// E(ulp_F(x)²) / E(x²) for x whose significand is log-uniform in its binade:
/// ∫₁² (2u/m)² dm / (m ln 2) = 4u²·(3/8)/ln 2 ≈ 2.164u².
pub(crate) fn mean_ulp_sq_ratio(f: Format) -> f64 {
    let u = f.unit_roundoff();
    4.0 * u * u * 0.375 / std::f64::consts::LN_2
}

/// The *expected* error statistics of one execution of a reduction of `n` i.i.d. terms with the
/// given statistics (planning without data). Partial sums of m terms have
/// E(s²) = m·E(t²) + m(m−1)·E(t)², and E(ulp(s)²) ≈ 2.164·u²·E(s²). The guaranteed field is
/// the bound's expectation, Σ E|tᵢ|·(growth of term i): a planning figure, not a guarantee.
pub fn planned_reduction_error(
    n: usize,
    stats: TermStats,
    acc: &Accumulation,
    is_dot: bool,
) -> Result<ReductionError> {
    acc.validate()?;
    check_planned_length(n)?;
    check_supported(&acc.order)?;
    let second_moment = |m: usize| {
        let m = m as f64;
        m * stats.mean_square + m * (m - 1.0) * stats.mean * stats.mean
    };
    let mut variance = 0.0;
    let mut add = |f: Format, m: usize| {
        // Without data the grid of the terms is unknown: every rounding is taken to be inexact.
        let e_ulp_sq = mean_ulp_sq_ratio(f) * second_moment(m);
        variance += e_ulp_sq / 12.0;
    };
    if is_dot {
        if let Products::Rounded(pf) = acc.products {
            for _ in 0..n {
                add(pf, 1);
            }
        }
    }
    let lr = load_rounds(acc, is_dot);
    for_each_rounding(
        &acc.order,
        n,
        acc.accumulator,
        lr,
        &mut |s: RoundingSite| {
            add(s.format, s.first.len() + s.second.len());
        },
    );
    let depths = if is_dot {
        acc.dot_depths(n)?
    } else {
        acc.sum_depths(n)?
    };
    let guaranteed: f64 = depths
        .iter()
        .map(|d| stats.mean_abs * d.relative_error_bound())
        .sum();
    Ok(with_growth(guaranteed, variance, &depths))
}

/// The longest reduction planning evaluates: the model walks every term's rounding sites
/// (about 28 bytes and 80 ns per term), so 2^24 terms take about 1.5 s and 0.5 GB.
pub const MAX_PLANNED_TERMS: usize = 1 << 24;

/// Planning needs 1 ≤ n ≤ [`MAX_PLANNED_TERMS`]: an empty reduction has nothing to price (its
/// result, 0, is exact in any order), and a longer one would exhaust time and memory.
pub(crate) fn check_planned_length(n: usize) -> Result<()> {
    if n == 0 {
        return Err(crate::error::Error::InvalidParameter {
            name: "k",
            reason: "the reduction length must be at least 1 (an empty sum is exactly 0 in any \
                     order: there is nothing to price)"
                .into(),
        });
    }
    if n > MAX_PLANNED_TERMS {
        return Err(crate::error::Error::InvalidParameter {
            name: "k",
            reason: format!(
                "a reduction of {n} terms exceeds the {MAX_PLANNED_TERMS} that planning \
                 evaluates term by term; price a shorter reduction (errors grow like √k) or \
                 split it (blocked order)"
            ),
        });
    }
    Ok(())
}

/// Largest growth factor (Π(1 + u)^d − 1) over the terms above which the first-order random
/// model is not used: when accumulated errors reach 10% of the values (long sums in BF16 or
/// FP8 accumulators), rounding errors stop being independent (stagnation) and only the
/// guaranteed bound is trustworthy.
pub const FIRST_ORDER_LIMIT: f64 = 0.1;

/// Apply the second-order factor: errors made early are multiplied by later (1 + δ) factors,
/// at most (1 + growth); beyond [`FIRST_ORDER_LIMIT`] the statistics fall back to the
/// guaranteed bound (variance = G²).
fn with_growth(
    guaranteed: f64,
    variance: f64,
    depths: &[crate::order::TermDepth],
) -> ReductionError {
    let growth = depths
        .iter()
        .map(|d| d.relative_error_bound())
        .fold(0.0, f64::max);
    if growth > FIRST_ORDER_LIMIT {
        return ReductionError {
            guaranteed,
            mean: 0.0,
            variance: guaranteed * guaranteed,
            tie_bound: 0.0,
        };
    }
    ReductionError {
        guaranteed,
        mean: 0.0,
        variance: variance * (1.0 + growth) * (1.0 + growth),
        tie_bound: 0.0,
    }
}

//! The families of inputs and their generator.

use super::*;

/// A family of inputs. `generate` fills a [rows, k] block (rows are reduced along k).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Family {
    Gaussian,
    /// N(μ, 1) with μ = this ratio mean/std.
    Mean(f64),
    UniformPositive,
    SortedAscending,
    SortedDescending,
    /// One value drawn per trial, repeated everywhere.
    Constant,
    /// Integers in [−64, 64].
    Integers,
    /// Dyadic rationals k/8, |k| ≤ 64.
    Dyadic,
    /// The first row repeated in every row.
    RepeatedRows,
    /// Rank-2 data u·vᵀ + w·zᵀ.
    LowRank,
    /// Gaussian with every 16th column multiplied by 1000.
    Outliers,
    /// Student-t with 2 degrees of freedom.
    HeavyTail,
    /// A leading 2^e − small term, then terms that keep the partial sums next to 2^e.
    NearPowerOfTwo,
    /// A large term, then terms at 3/4 (or ½ ± one grid step) of the running sum's spacing,
    /// so that every addition rounds the same way.
    Residues,
    /// Gaussian scaled into the subnormal range of the input format.
    Subnormal,
    /// Gaussian scaled so that sums come near the largest finite value.
    NearOverflow,
    /// A large constant (250 to 32,000) with one element in eight raised by a small integer:
    /// every update of a running mean rounds at the constant's spacing.
    NearConstant,
    /// Uniform on [−1, 1) with one element 10⁶ per row: the squares of x − μ̂ all round the
    /// same way onto the outlier's.
    SingleOutlier,
    /// Positive values below 2⁻¹⁰: a long sum in a narrow accumulator stalls (each term under
    /// half the running sum's spacing). Matmuls take B from the same family.
    Stall,
    /// Nine elements in ten zero, the rest Gaussian.
    Sparse,
    /// Pairs g, −g: many orders sum a row to exactly zero.
    CancellingPairs,
    /// Random signs, magnitudes falling by 16 binades along the row.
    GeometricDecay,
    /// 1, 2, 3, … with one sign per row: integer partial sums past the accumulator's grid.
    Ramp,
    /// Gaussian, half of the elements (at random) scaled by 2⁻¹².
    Bimodal,
    /// (−1)^j (1 + small): partial sums that cancel to near zero every other step.
    Alternating,
}

pub const FAMILIES: [Family; 28] = [
    Family::Gaussian,
    Family::Mean(0.5),
    Family::Mean(1.0),
    Family::Mean(30.0),
    Family::Mean(1000.0),
    Family::UniformPositive,
    Family::SortedAscending,
    Family::SortedDescending,
    Family::Constant,
    Family::Integers,
    Family::Dyadic,
    Family::RepeatedRows,
    Family::LowRank,
    Family::Outliers,
    Family::HeavyTail,
    Family::NearPowerOfTwo,
    Family::Residues,
    Family::Subnormal,
    Family::NearOverflow,
    Family::NearConstant,
    Family::SingleOutlier,
    Family::Stall,
    Family::Sparse,
    Family::CancellingPairs,
    Family::GeometricDecay,
    Family::Ramp,
    Family::Bimodal,
    Family::Alternating,
];

impl Family {
    pub fn name(self) -> String {
        match self {
            Family::Gaussian => "gaussian".into(),
            Family::Mean(r) => format!("mean/std {r}"),
            Family::UniformPositive => "uniform [0,1)".into(),
            Family::SortedAscending => "sorted up".into(),
            Family::SortedDescending => "sorted down".into(),
            Family::Constant => "constant".into(),
            Family::Integers => "integers".into(),
            Family::Dyadic => "dyadic k/8".into(),
            Family::RepeatedRows => "repeated rows".into(),
            Family::LowRank => "low rank".into(),
            Family::Outliers => "outlier cols x1000".into(),
            Family::HeavyTail => "student-t(2)".into(),
            Family::NearPowerOfTwo => "sums near 2^e".into(),
            Family::Residues => "residue pattern".into(),
            Family::Subnormal => "subnormal".into(),
            Family::NearOverflow => "near overflow".into(),
            Family::NearConstant => "near-constant large".into(),
            Family::SingleOutlier => "one outlier 1e6".into(),
            Family::Stall => "stall (< 2^-10)".into(),
            Family::Sparse => "sparse 90% zeros".into(),
            Family::CancellingPairs => "cancelling pairs".into(),
            Family::GeometricDecay => "geometric decay".into(),
            Family::Ramp => "ramp 1..k".into(),
            Family::Bimodal => "bimodal 1 / 2^-12".into(),
            Family::Alternating => "alternating +-1".into(),
        }
    }
}

/// Rows × k values of `family`, rounded to `format` (saturating), for trial `seed`.
/// `acc` is the accumulator the data will meet (for the residue and near-power patterns).
pub fn generate(
    family: Family,
    rows: usize,
    k: usize,
    seed: u64,
    format: Format,
    acc: Format,
) -> Vec<f64> {
    let mut g = SplitMix64::for_name(&format!("zoo-{}", family.name()), seed);
    let r = |x: f64| format.round(x, Overflow::Saturating);
    let n = rows * k;
    let gauss = |g: &mut SplitMix64| g.normal();
    let mut v: Vec<f64> = match family {
        Family::Gaussian => (0..n).map(|_| gauss(&mut g)).collect(),
        Family::Mean(m) => (0..n).map(|_| m + gauss(&mut g)).collect(),
        Family::UniformPositive => (0..n).map(|_| g.uniform()).collect(),
        Family::SortedAscending | Family::SortedDescending => {
            let mut v: Vec<f64> = (0..n).map(|_| g.uniform()).collect();
            for row in v.chunks_mut(k) {
                row.sort_by(|a, b| a.total_cmp(b));
                if family == Family::SortedDescending {
                    row.reverse();
                }
            }
            v
        }
        Family::Constant => {
            let c = 0.5 + g.uniform() * 1.5;
            vec![c; n]
        }
        Family::Integers => (0..n)
            .map(|_| (g.uniform() * 129.0).floor() - 64.0)
            .collect(),
        Family::Dyadic => (0..n)
            .map(|_| ((g.uniform() * 129.0).floor() - 64.0) / 8.0)
            .collect(),
        Family::RepeatedRows => {
            let row: Vec<f64> = (0..k).map(|_| gauss(&mut g)).collect();
            (0..n).map(|i| row[i % k]).collect()
        }
        Family::LowRank => {
            let (u, w): (Vec<f64>, Vec<f64>) =
                (0..rows).map(|_| (gauss(&mut g), gauss(&mut g))).unzip();
            let (a, b): (Vec<f64>, Vec<f64>) =
                (0..k).map(|_| (gauss(&mut g), gauss(&mut g))).unzip();
            (0..n)
                .map(|i| u[i / k] * a[i % k] + w[i / k] * b[i % k])
                .collect()
        }
        Family::Outliers => (0..n)
            .map(|i| gauss(&mut g) * if i % k % 16 == 3 { 1000.0 } else { 1.0 })
            .collect(),
        Family::HeavyTail => (0..n)
            .map(|_| gauss(&mut g) / (-(1.0 - g.uniform()).ln()).max(1e-300).sqrt())
            .collect(),
        Family::NearPowerOfTwo => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..rows {
                let e = (g.uniform() * 8.0).floor() as i32;
                let p = 2f64.powi(e);
                let step = p * acc.unit_roundoff() * (1.0 + 4.0 * g.uniform());
                v.push(p - step);
                for j in 1..k {
                    let s = if j % 2 == 1 { 1.0 } else { -1.0 };
                    v.push(s * step * (1.0 + g.uniform()));
                }
            }
            v
        }
        Family::Residues => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..rows {
                let e = 4 + (g.uniform() * 12.0).floor() as i32;
                let big = 2f64.powi(e);
                v.push(big);
                // The spacing at the running sum: the big term's, doubled when k terms push it
                // into the next binade.
                let ulp = acc.ulp(big).unwrap_or(1.0);
                let frac = [0.75, 0.5 + 1.0 / 64.0, 0.25, 0.5][(g.next_u64() % 4) as usize];
                let sign = if g.uniform() < 0.5 { -1.0 } else { 1.0 };
                for _ in 1..k {
                    v.push(sign * frac * ulp);
                }
            }
            v
        }
        Family::Subnormal => {
            let scale = format.min_normal() * 4.0;
            (0..n).map(|_| gauss(&mut g) * scale).collect()
        }
        Family::NearOverflow => {
            let scale = acc.max_finite().min(format.max_finite()) / (k as f64).max(4.0) / 2.0;
            (0..n).map(|_| g.uniform() * scale).collect()
        }
        Family::NearConstant => {
            let c = [250.0, 1000.0, 3e4][(g.next_u64() % 3) as usize] * (1.0 + g.uniform());
            let c = r(c);
            (0..n)
                .map(|_| {
                    if g.next_u64() % 8 == 0 {
                        c + (1 + g.next_u64() % 4) as f64
                    } else {
                        c
                    }
                })
                .collect()
        }
        Family::SingleOutlier => {
            let mut v: Vec<f64> = (0..n).map(|_| 2.0 * g.uniform() - 1.0).collect();
            for row in v.chunks_mut(k) {
                let j = (g.next_u64() % k as u64) as usize;
                row[j] = 1e6 * (1.0 + g.uniform());
            }
            v
        }
        Family::Stall => (0..n).map(|_| g.uniform() * 2f64.powi(-10)).collect(),
        Family::Sparse => (0..n)
            .map(|_| {
                let keep = g.uniform() < 0.1;
                let v = gauss(&mut g);
                if keep {
                    v
                } else {
                    0.0
                }
            })
            .collect(),
        Family::CancellingPairs => {
            let mut v = Vec::with_capacity(n + 1);
            while v.len() < n {
                let x = r(gauss(&mut g));
                v.push(x);
                v.push(-x);
            }
            v.truncate(n);
            v
        }
        Family::GeometricDecay => (0..n)
            .map(|i| {
                let s = if g.uniform() < 0.5 { -1.0 } else { 1.0 };
                let j = (i % k) as f64;
                s * 2f64.powf(-16.0 * j / k as f64) * (1.0 + 0.1 * g.uniform())
            })
            .collect(),
        Family::Ramp => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..rows {
                let s = if g.uniform() < 0.5 { -1.0 } else { 1.0 };
                v.extend((0..k).map(|j| s * (j + 1) as f64));
            }
            v
        }
        Family::Bimodal => (0..n)
            .map(|_| {
                let small = g.uniform() < 0.5;
                gauss(&mut g) * if small { 2f64.powi(-12) } else { 1.0 }
            })
            .collect(),
        Family::Alternating => (0..n)
            .map(|i| {
                let s = if i % k % 2 == 0 { 1.0 } else { -1.0 };
                s * (1.0 + g.uniform() * 2f64.powi(-7))
            })
            .collect(),
    };
    for x in &mut v {
        *x = r(*x);
    }
    v
}

//! Comparison of a reference and a candidate execution: the difference D = cand − ref of each
//! element, and thresholds on it — per element and for the tensor as a whole.
//!
//! Derivation (papers/bounds-reductions.md, §3–4). Each element's difference is modelled as
//! D = o + X + R:
//! * o, a deterministic offset (the two sides' exact values differ, e.g. different FP8
//!   scales or input formats);
//! * X, the difference of the two executions' rounding errors: independent where the orders
//!   differ and identical where they share roundings (which only lowers the variance), so X
//!   is strictly sub-Gaussian with proxy h ≤ Var E_r + Var E_c under the uniform rounding
//!   model (see `reduction`);
//! * R, what the trailing roundings of nearly equal values add: zero-mean, bounded.
//!
//! Trailing roundings (both sides round their nearly equal values to the same format F):
//! with the values' position on F's grid uniform ("uniform phase"), R = fl(x_c) − fl(x_r) − Δ
//! has E(R | Δ) = 0 and E(R²) = ulp²·E(φ(1 − φ)) ≤ ulp·min(E|Δ|, ulp/4) (φ the fractional
//! part of Δ/ulp), so a BF16 output of two FP32 accumulations that differ by Δ ≪ ulp agrees
//! exactly with probability 1 − |Δ|/ulp. When only one side rounds onto the grid the other
//! side's value already lies on ("snap"), D becomes Δ rounded to a multiple of ulp: zero
//! while |Δ| < ulp/2, with E(D²) ≤ Σₖ k²·ulp²·P(|Δ| ≥ (k − ½)·ulp) and |D| ≤ |Δ| + ulp/2.
//!
//! Tensor level, with probability ≥ 1 − δ (δ/5 for each of five events):
//! ‖D‖_F ≤ ‖o + X‖ + ‖X_s‖ + ‖R‖ with ‖o + X‖² = ‖o‖² + 2⟨o, X⟩ + ‖X‖² (oᵢ at |oᵢ| + its tie
//! bound; X the components on their own element, X_s those spread over a row, which may align
//! with the offsets), where
//! * ‖X‖² ≤ Σhᵢ + 2√(t·Σhᵢ²) + 2t·max hᵢ, t = ln(5/δ) (Hsu, Kakade & Zhang 2012, Thm 1, for
//!   independent sub-Gaussian components), and the same for ‖X_s‖²;
//! * ⟨o, X⟩ ≤ √(2t·Σ oᵢ²hᵢ) (a linear form of independent sub-Gaussian components is
//!   sub-Gaussian with proxy Σ oᵢ²hᵢ); never looser than ‖o‖ + ‖X‖;
//! * every |Rᵢ| ≤ bᵢ, its deterministic part plus the sub-Gaussian tail of what a snap moved
//!   into it at δ/(5N);
//! * Σ Rᵢ² ≤ E + t' with Bernstein's inequality for independent summands in [0, b²]
//!   (Boucheron, Lugosi & Massart 2013, Thm 2.10): Var(Rᵢ²) ≤ b²·E(Rᵢ²),
//!   t' = bL/3 + √((bL/3)² + 2bL·E), b = max bᵢ², L = ln(5/δ).

use serde::Serialize;

use crate::bounds::reduction::ReductionError;
use crate::error::{Error, Result};
use crate::format::Format;
use crate::tensor::Tensor;
use crate::verdict::TensorVerdict;

/// Which kind of threshold.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Confidence {
    /// Holds for every input and every rounding error (worst case).
    Guaranteed,
    /// Holds with probability at least 1 − δ under the random-rounding model.
    Probabilistic {
        /// The failure probability δ, in (0, 1).
        delta: f64,
    },
}

impl Confidence {
    /// A probabilistic confidence, checking 0 < δ < 1.
    pub fn probabilistic(delta: f64) -> Result<Confidence> {
        if !(delta > 0.0 && delta < 1.0) {
            return Err(Error::InvalidParameter {
                name: "delta",
                reason: format!(
                    "the failure probability must lie strictly between 0 and 1 (got {delta})"
                ),
            });
        }
        Ok(Confidence::Probabilistic { delta })
    }

    /// The default used by `ttrace`: δ = 10⁻⁶.
    pub fn default_probabilistic() -> Confidence {
        Confidence::Probabilistic { delta: 1e-6 }
    }
}

/// Statistics of the difference D = o + X + R of one element (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ElementDiff {
    /// Deterministic offset o of the exact values (candidate − reference).
    pub offset: f64,
    /// A deterministic part of unknown sign, |·| ≤ `bias_bound` (rounding ties).
    pub bias_bound: f64,
    /// |D| ≤ `guaranteed`, whatever the rounding errors are.
    pub guaranteed: f64,
    /// Sub-Gaussian proxy (= variance under the model) of the continuous part X.
    pub proxy: f64,
    /// E(R²) of the bounded part added by trailing roundings.
    pub rounding_mean_square: f64,
    /// Deterministic part of the bound on |R|.
    pub rounding_bound: f64,
    /// Proxy of a sub-Gaussian variable whose tail also bounds |R| (after a snap).
    pub rounding_bound_proxy: f64,
    /// A component spread over many elements (the row-common part of a softmax or a norm):
    /// its direction may align with the offsets of those elements, so the tensor threshold
    /// adds it by the triangle inequality instead of as an orthogonal coordinate.
    pub spread: bool,
    /// Proxy of the spread components' share of this element (a softmax or norm row's common
    /// part): priced in the tensor norm as those components, and added here to this element's
    /// own bound ([`ElementDiff::probabilistic_bound`]), which they move too.
    pub shared_proxy: f64,
}

impl ElementDiff {
    /// The difference of two executions of a reduction whose exact results differ by `offset`.
    pub fn from_reductions(
        reference: ReductionError,
        candidate: ReductionError,
        offset: f64,
    ) -> ElementDiff {
        let sum = reference.plus(candidate);
        // The determined errors are carried as part of the offset (D = E_c − E_r), the ties of
        // unknown direction at their bound; only the undetermined roundings are random.
        let determined = offset + (candidate.mean - reference.mean);
        ElementDiff {
            offset: determined,
            bias_bound: sum.tie_bound,
            guaranteed: offset.abs() + sum.guaranteed,
            proxy: sum.variance,
            ..ElementDiff::default()
        }
    }

    /// E(D²) under the model.
    pub fn mean_square(&self) -> f64 {
        (self.offset.abs() + self.bias_bound).powi(2) + self.proxy + self.rounding_mean_square
    }

    /// Both values multiplied by the same exact factor.
    pub fn scale(&mut self, f: f64) {
        let a = f.abs();
        self.offset *= f;
        self.bias_bound *= a;
        self.guaranteed *= a;
        self.proxy *= f * f;
        self.rounding_mean_square *= f * f;
        self.rounding_bound *= a;
        self.rounding_bound_proxy *= f * f;
        self.shared_proxy *= f * f;
    }

    /// Both sides round their (nearly equal) values of magnitude about `magnitude` to `format`.
    pub fn round_both(&mut self, format: Format, magnitude: f64) {
        let ulp = format.ulp(magnitude).unwrap_or(f64::INFINITY);
        let ulp_hi = format
            .ulp(magnitude.abs() + self.guaranteed)
            .unwrap_or(f64::INFINITY);
        self.rounding_mean_square += ulp * self.mean_square().sqrt().min(ulp / 4.0);
        self.rounding_bound += ulp_hi;
        self.guaranteed += ulp_hi;
    }

    /// One side rounds onto the grid of `format` on which the other side's value already lies.
    pub fn round_snap(&mut self, format: Format, magnitude: f64) {
        let ulp = format
            .ulp(magnitude.abs() + self.guaranteed)
            .unwrap_or(f64::INFINITY);
        let ms = self.mean_square();
        let mut e = 4.0 * ms;
        if self.offset == 0.0
            && self.bias_bound == 0.0
            && self.rounding_mean_square == 0.0
            && self.proxy > 0.0
        {
            let mut tail = 0.0;
            for k in 1..400 {
                let t = (k as f64 - 0.5) * ulp;
                let p = (2.0 * (-t * t / (2.0 * self.proxy)).exp()).min(1.0);
                let term = (k * k) as f64 * ulp * ulp * p;
                tail += term;
                if term <= 1e-30 * ulp * ulp {
                    break;
                }
            }
            e = e.min(tail);
        }
        self.rounding_mean_square = e;
        self.rounding_bound += self.offset.abs() + self.bias_bound + ulp / 2.0;
        self.rounding_bound_proxy += self.proxy;
        self.offset = 0.0;
        self.bias_bound = 0.0;
        self.proxy = 0.0;
        self.guaranteed += ulp / 2.0;
    }

    /// Only one side rounds, and the other side's value is unrelated to that grid: an
    /// independent error, uniform on ±ulp/2 (variance ulp²/12, strictly sub-Gaussian).
    pub fn round_one(&mut self, format: Format, magnitude: f64) {
        let ulp = format
            .ulp(magnitude.abs() + self.guaranteed)
            .unwrap_or(f64::INFINITY);
        self.proxy += ulp * ulp / 12.0;
        self.guaranteed += ulp / 2.0;
    }

    /// Bound on |R| that fails with probability at most δ, given ln(2/δ).
    fn rounding_part_bound(&self, ln_2_delta: f64) -> f64 {
        self.rounding_bound + (2.0 * self.rounding_bound_proxy * ln_2_delta).sqrt()
    }

    /// |D| ≤ this with probability ≥ 1 − δ, never more than the guaranteed bound.
    pub fn probabilistic_bound(&self, delta: f64) -> f64 {
        self.probabilistic_bound_at(&Logs::at(delta))
    }

    /// [`probabilistic_bound`](Self::probabilistic_bound) with its logarithms computed.
    fn probabilistic_bound_at(&self, logs: &Logs) -> f64 {
        let x = (2.0 * (self.proxy + self.shared_proxy) * logs.four).sqrt();
        (self.offset.abs() + self.bias_bound + x + self.rounding_part_bound(logs.half))
            .min(self.guaranteed)
    }
}

/// The logarithms a per-element probabilistic bound at δ takes, computed once per tensor
/// rather than once per element.
#[derive(Debug, Clone, Copy)]
struct Logs {
    /// ln(4/δ).
    four: f64,
    /// ln(2/(δ/2)), the rounding part's at δ/2.
    half: f64,
}

impl Logs {
    fn at(delta: f64) -> Logs {
        Logs {
            four: (4.0 / delta).ln(),
            half: (2.0 / (delta / 2.0)).ln(),
        }
    }
}

/// A comparison threshold for one tensor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Threshold {
    /// Both sides do identical arithmetic: the difference is exactly zero.
    pub identical: bool,
    /// Guaranteed or probabilistic (with δ).
    pub confidence: Confidence,
    /// Bound on ‖cand − ref‖_F.
    pub abs_frobenius: f64,
    /// Bound on ‖cand − ref‖_F / ‖ref‖_F (+inf when ‖ref‖ = 0 and the bound is not 0).
    pub relative: f64,
    /// ‖ref‖_F used for `relative`.
    pub reference_norm: f64,
    /// Bound on max |candᵢ − refᵢ| over the tensor (same confidence, union over elements).
    pub per_element: f64,
    /// The model's √E‖D‖²_F / ‖ref‖_F: the typical relative difference. NaN where the
    /// threshold was priced without the model: a guaranteed threshold of a product (or sum)
    /// priced by GEMMs ([`Pricing`](crate::bounds::Pricing)), which needs only the terms'
    /// magnitudes.
    pub expected_relative: f64,
    /// The guaranteed bound on ‖cand − ref‖_F / ‖ref‖_F, for reference.
    pub guaranteed_relative: f64,
    /// Number of elements.
    pub elements: usize,
}

impl Threshold {
    /// A zero threshold for identical arithmetic.
    pub fn identical(confidence: Confidence, reference_norm: f64, elements: usize) -> Threshold {
        Threshold {
            identical: true,
            confidence,
            abs_frobenius: 0.0,
            relative: 0.0,
            reference_norm,
            per_element: 0.0,
            expected_relative: 0.0,
            guaranteed_relative: 0.0,
            elements,
        }
    }

    /// Whether an observed ‖cand − ref‖_F passes.
    pub fn accepts(&self, observed_abs_frobenius: f64) -> bool {
        observed_abs_frobenius <= self.abs_frobenius
    }

    /// Judge a candidate tensor against the reference under this threshold: the verdict holds
    /// the relative Frobenius error (also in units of ε of the reference's format), the largest
    /// absolute and ulp differences and any non-finite mismatch; it passes when ‖cand − ref‖_F
    /// is within [`abs_frobenius`](Self::abs_frobenius) and no non-finite value disagrees (a
    /// NaN where the reference is finite fails whatever the threshold). Shapes that differ
    /// fail with the reason in `problem`, and so do tensors whose element count is not the one
    /// the threshold was priced for ([`elements`](Self::elements): the op's result on the
    /// inputs it priced — a threshold of other data says nothing of these) or that hold no
    /// element at all (a verdict over nothing would pass vacuously).
    ///
    /// # Examples
    ///
    /// ```
    /// use ttrace::bounds::{matmul_threshold, Confidence};
    /// use ttrace::{Format, Order, Combine, Policy, Tensor};
    ///
    /// # fn main() -> ttrace::Result<()> {
    /// let a = Tensor::from_vec(&[2, 4], vec![1.0, 0.5, -0.25, 2.0, 1.5, -1.0, 0.75, 0.5], Format::BF16)?;
    /// let b = Tensor::from_vec(&[4, 1], vec![0.5, -1.5, 1.0, 0.25], Format::BF16)?;
    /// let reference: Policy = "in=bf16,acc=f32,out=bf16".parse()?;
    /// let candidate = reference.clone().with_order(Order::split_k(2, Format::BF16, Combine::Tree));
    /// let t = matmul_threshold(&a, &b, None, &reference, &candidate, Confidence::Guaranteed)?;
    /// // Run both (here: the engine's emulation) and judge the candidate.
    /// let r = ttrace::engine::matmul(&a, &b, &reference)?;
    /// let c = ttrace::engine::matmul(&a, &b, &candidate)?;
    /// assert!(t.check(&r, &c).passed);
    /// # Ok(())
    /// # }
    /// ```
    pub fn check(&self, reference: &Tensor, candidate: &Tensor) -> TensorVerdict {
        let n = reference.len();
        if n == 0 || n != self.elements {
            let problem = if n == 0 {
                "the tensors hold no element: nothing to compare".to_string()
            } else {
                format!(
                    "the threshold was priced for {} elements (the op's result on its inputs); \
                     the reference holds {n}",
                    self.elements
                )
            };
            return crate::verdict::failed("tensor", n, problem);
        }
        crate::verdict::compare_tensor(
            "tensor",
            reference,
            candidate,
            self.abs_frobenius,
            reference.format().machine_epsilon(),
        )
    }
}

fn relative(abs: f64, norm: f64) -> f64 {
    if abs == 0.0 {
        0.0
    } else if norm > 0.0 {
        abs / norm
    } else {
        f64::INFINITY
    }
}

/// The threshold of a tensor whose elements come in groups of identical differences:
/// `groups` holds one difference per group and how many elements share it. Elements computed
/// from identical inputs by identical arithmetic differ identically — repeated rows of a batch,
/// repeated values of a low-precision tensor — so a group of c is one component √c·D of
/// ‖D‖_F, not c independent ones. The per-element bound is the largest group's bound at
/// δ/elements (union bound over the elements). `elements` is the tensor's element count.
pub(crate) fn grouped_threshold(
    groups: &[(ElementDiff, usize)],
    reference_norm: f64,
    confidence: Confidence,
    elements: usize,
) -> Threshold {
    let mut sums = ThresholdSums::new(confidence, elements);
    for (d, c) in groups {
        sums.add_group(d, *c);
    }
    sums.threshold(reference_norm)
}

/// Clusters of the rows of a [rows, n] row-major array that agree modulo `grid` (a power of
/// two) element by element: `cluster[r]` for each row. When `grid` is at least twice the
/// largest spacing any partial sum of these rows meets, every partial sum of two such rows
/// differs by a multiple of it, so their roundings see the same residues — the same errors
/// wherever their binades agree (near-constant rows that differ by integers). Rows of generic
/// data have residues of their own and stay alone; a hash collision only joins rows, which
/// loosens the threshold.
pub(crate) fn residue_clusters(values: &[f64], n: usize, grid: f64) -> Vec<usize> {
    let rows = values.len().checked_div(n).unwrap_or(0);
    let mut seen: crate::bounds::keyed::DataMap<u64, usize> = Default::default();
    (0..rows)
        .map(|r| {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for &v in &values[r * n..(r + 1) * n] {
                let mut rem = v % grid;
                if rem < 0.0 {
                    rem += grid;
                }
                h = (h ^ rem.to_bits()).wrapping_mul(0x0000_0100_0000_01b3);
                h ^= h >> 29;
            }
            let next = seen.len();
            *seen.entry(h).or_insert(next)
        })
        .collect()
}

/// Classes of identical rows of a [rows, n] row-major array (bit for bit): each row's class
/// and, per class, its first row and its size, in order of first appearance.
///
/// Rows are bucketed by a digest of their bits and compared bit for bit within a bucket, so a
/// collision costs a comparison, never a wrong class. The digest is seeded per call from
/// std's `RandomState` (random per process), so that no input can be built to fall into one
/// bucket; SipHash over whole rows took a quarter of a fast-priced sum's time.
///
/// Identical rows agree everywhere, so a row is first digested at [`SAMPLES`] spread
/// positions only: a row whose sample no earlier row shares starts a class without being read
/// whole (rows of real data differ in their samples; the whole-row digest took a tenth of a
/// fast-priced sum). Rows that share a sample (one-hot rows, rows that differ in few places)
/// are digested whole and bucketed by that, as every row was before.
pub(crate) fn row_classes(values: &[f64], n: usize) -> (Vec<usize>, Vec<(usize, usize)>) {
    use std::hash::BuildHasher;
    let rows = values.len().checked_div(n).unwrap_or(0);
    let seed = std::collections::hash_map::RandomState::new().hash_one(0x7474_7261_6365u64);
    let step = |h: u64, v: f64| {
        let h = (h ^ v.to_bits()).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h ^ (h >> 29)
    };
    // Four independent chains (a multiply's latency each), folded at the end.
    let digest = |row: &[f64]| {
        let mut h = [seed, seed ^ 1, seed ^ 2, seed ^ 3];
        let mut quads = row.chunks_exact(4);
        for q in &mut quads {
            for l in 0..4 {
                h[l] = step(h[l], q[l]);
            }
        }
        let tail = quads.remainder().iter().fold(h[0], |a, &v| step(a, v));
        [h[1], h[2], h[3]]
            .iter()
            .fold(tail, |a, &x| step(a, f64::from_bits(x)))
    };
    // The sampled positions: every one of a short row, else `SAMPLES` spread over the row,
    // its first and last included.
    let positions: Vec<usize> = if n <= SAMPLES {
        (0..n).collect()
    } else {
        (0..SAMPLES).map(|i| i * (n - 1) / (SAMPLES - 1)).collect()
    };
    let sample = |row: &[f64]| {
        let mut h = [seed ^ 5, seed ^ 6];
        let mut pairs = positions.chunks_exact(2);
        for p in &mut pairs {
            h[0] = step(h[0], row[p[0]]);
            h[1] = step(h[1], row[p[1]]);
        }
        let tail = pairs.remainder().iter().fold(h[0], |a, &p| step(a, row[p]));
        step(tail, f64::from_bits(h[1]))
    };
    let same = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    /// What one sample's rows are bucketed by: one class so far, or the whole-row digests.
    enum Sampled {
        One(usize),
        Whole,
    }
    let mut sampled: crate::bounds::keyed::DataMap<u64, Sampled> = Default::default();
    let mut buckets: crate::bounds::keyed::DataMap<u64, Vec<usize>> = Default::default();
    let mut class = Vec::with_capacity(rows);
    let mut classes: Vec<(usize, usize)> = vec![];
    let row_of = |r: usize| &values[r * n..(r + 1) * n];
    for r in 0..rows {
        let row = row_of(r);
        let entry = sampled.entry(sample(row));
        let c = match entry {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Sampled::One(classes.len()));
                classes.push((r, 0));
                classes.len() - 1
            }
            std::collections::hash_map::Entry::Occupied(mut o) => {
                if let Sampled::One(c0) = *o.get() {
                    // A second row with this sample: the first one's class goes to the
                    // whole-row buckets.
                    buckets
                        .entry(digest(row_of(classes[c0].0)))
                        .or_default()
                        .push(c0);
                    o.insert(Sampled::Whole);
                }
                let bucket = buckets.entry(digest(row)).or_default();
                let found = bucket
                    .iter()
                    .copied()
                    .find(|&c| same(row_of(classes[c].0), row));
                found.unwrap_or_else(|| {
                    bucket.push(classes.len());
                    classes.push((r, 0));
                    classes.len() - 1
                })
            }
        };
        classes[c].1 += 1;
        class.push(c);
    }
    (class, classes)
}

/// How many positions of a row [`row_classes`] digests first.
const SAMPLES: usize = 32;

/// Combine per-element differences into a tensor threshold (see the module docs).
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{reduction_error, tensor_threshold, Confidence, ElementDiff};
/// use ttrace::{Accumulation, Combine, Format, Order};
///
/// # fn main() -> ttrace::Result<()> {
/// // Two output elements, each a 64-term FP32 sum: sequential versus split-K over 4.
/// let rows: Vec<Vec<f64>> = (0..2)
///     .map(|r| (0..64).map(|i| ((r * 64 + i) as f64).sin()).collect::<Vec<_>>())
///     .map(|v| v.into_iter().map(|x| Format::F32.round(x, ttrace::Overflow::Saturating)).collect())
///     .collect();
/// let reference = Accumulation::new(Format::F32, Format::F32, Order::Sequential);
/// let candidate = Accumulation::new(Format::F32, Format::F32, Order::split_k(4, Format::F32, Combine::Tree));
/// let diffs = rows
///     .iter()
///     .map(|t| Ok(ElementDiff::from_reductions(
///         reduction_error(t, &reference, false)?,
///         reduction_error(t, &candidate, false)?,
///         0.0,
///     )))
///     .collect::<ttrace::Result<Vec<_>>>()?;
/// let norm = rows.iter().map(|t| ttrace::exact_sum(t).powi(2)).sum::<f64>().sqrt();
/// let t = tensor_threshold(&diffs, norm, Confidence::default_probabilistic());
/// assert!(t.abs_frobenius > 0.0 && t.abs_frobenius <= t.guaranteed_relative * norm * 1.01);
/// # Ok(())
/// # }
/// ```
pub fn tensor_threshold(
    diffs: &[ElementDiff],
    reference_norm: f64,
    confidence: Confidence,
) -> Threshold {
    let weighted: Vec<(ElementDiff, usize)> = diffs.iter().map(|d| (*d, 1)).collect();
    tensor_threshold_weighted(&weighted, reference_norm, confidence)
}

/// [`tensor_threshold`] for elements given as (difference statistics, how many elements share
/// them) — planning prices a whole tensor from one representative element this way.
pub fn tensor_threshold_weighted(
    diffs: &[(ElementDiff, usize)],
    reference_norm: f64,
    confidence: Confidence,
) -> Threshold {
    let n: usize = diffs.iter().map(|(_, c)| c).sum();
    let mut sums = ThresholdSums::new(confidence, n);
    for (d, c) in diffs {
        sums.add(d, *c);
    }
    sums.threshold(reference_norm)
}

/// The sums [`tensor_threshold_weighted`] needs, gathered one element (or group) at a time,
/// so that a tensor is priced without holding every element's statistics.
#[derive(Debug, Clone)]
pub(crate) struct ThresholdSums {
    confidence: Confidence,
    /// Elements the threshold is for (the union bounds' N).
    elements: usize,
    g2: f64,
    g_max: f64,
    expected: f64,
    o2: f64,
    /// Σh, Σh², max h of the own coordinates (0) and of the spread components (1).
    h: [(f64, f64, f64); 2],
    o2h: f64,
    b: f64,
    e_r: f64,
    per: f64,
    /// ln(2/δ_b) of the rounding part's truncation at δ_b = δ/(5N), and the per-element
    /// bound's logarithms at δ/N (probabilistic only).
    ln_b: f64,
    per_logs: Logs,
    /// Whether every element came with the model's statistics (else `expected` means nothing).
    modeled: bool,
}

impl ThresholdSums {
    /// Empty sums for a tensor of `elements` elements.
    pub(crate) fn new(confidence: Confidence, elements: usize) -> ThresholdSums {
        let nf = elements.max(1) as f64;
        let delta = match confidence {
            Confidence::Probabilistic { delta } => delta,
            Confidence::Guaranteed => 1.0,
        };
        let ln_b = (2.0 / (delta / (5.0 * nf))).ln();
        let per_logs = Logs::at(delta / nf);
        ThresholdSums {
            confidence,
            elements,
            g2: 0.0,
            g_max: 0.0,
            expected: 0.0,
            o2: 0.0,
            h: [(0.0, 0.0, 0.0); 2],
            o2h: 0.0,
            b: 0.0,
            e_r: 0.0,
            per: 0.0,
            ln_b,
            per_logs,
            modeled: true,
        }
    }

    /// Add elements of which only the guaranteed bounds are known (a guaranteed threshold
    /// priced without the model), by the sum of their squares and the largest: the
    /// threshold's expected difference is then not known (NaN).
    pub(crate) fn add_guaranteed(&mut self, sum_sq: f64, max: f64) {
        debug_assert_eq!(self.confidence, Confidence::Guaranteed);
        self.g2 += sum_sq;
        self.g_max = self.g_max.max(max);
        self.modeled = false;
    }

    /// Add `count` elements that share the difference statistics `d`.
    pub(crate) fn add(&mut self, d: &ElementDiff, count: usize) {
        self.add_sums(d, count);
        if let Confidence::Probabilistic { .. } = self.confidence {
            self.per = self.per.max(d.probabilistic_bound_at(&self.per_logs));
        }
    }

    /// [`add`](Self::add) but for the per-element bound and the largest guaranteed one, which
    /// the callers that scale `d` take from the element itself.
    fn add_sums(&mut self, d: &ElementDiff, count: usize) {
        let w = count as f64;
        self.g2 += d.guaranteed * d.guaranteed * w;
        self.g_max = self.g_max.max(d.guaranteed);
        self.expected += d.mean_square() * w;
        if let Confidence::Probabilistic { .. } = self.confidence {
            // Offsets: deterministic (the tie part, of unknown sign, at its bound).
            let off = d.offset.abs() + d.bias_bound;
            self.o2 += off * off * w;
            let h = &mut self.h[usize::from(d.spread)];
            h.0 += d.proxy * w;
            h.1 += d.proxy * d.proxy * w;
            h.2 = h.2.max(d.proxy);
            if !d.spread {
                self.o2h += off * off * d.proxy * w;
            }
            self.b = self.b.max(d.rounding_part_bound(self.ln_b));
            self.e_r += d.rounding_mean_square * w;
        }
    }

    /// Fold in the sums of another part of the same tensor (the same confidence and element
    /// count): the same threshold as adding that part's elements here, up to the order of the
    /// additions.
    pub(crate) fn merge(&mut self, o: &ThresholdSums) {
        self.g2 += o.g2;
        self.g_max = self.g_max.max(o.g_max);
        self.expected += o.expected;
        self.o2 += o.o2;
        for (h, oh) in self.h.iter_mut().zip(&o.h) {
            h.0 += oh.0;
            h.1 += oh.1;
            h.2 = h.2.max(oh.2);
        }
        self.o2h += o.o2h;
        self.b = self.b.max(o.b);
        self.e_r += o.e_r;
        self.per = self.per.max(o.per);
        self.modeled &= o.modeled;
    }

    /// Add a group of `count` elements whose differences are identical (computed from
    /// identical inputs by identical arithmetic): one component √count·D of ‖D‖_F, not
    /// `count` independent ones; the per-element bounds are those of one element.
    pub(crate) fn add_group(&mut self, d: &ElementDiff, count: usize) {
        let mut w = *d;
        w.scale((count as f64).sqrt());
        let g_max = self.g_max;
        self.add_sums(&w, 1);
        self.g_max = g_max.max(d.guaranteed);
        if let Confidence::Probabilistic { .. } = self.confidence {
            self.per = self.per.max(d.probabilistic_bound_at(&self.per_logs));
        }
    }

    /// Add groups of identical elements ((statistics, count) each) whose random parts X are
    /// not independent of each other but may move together — rows whose values agree modulo
    /// a grid coarser than every spacing their sums meet, so that their roundings fall alike
    /// ([`residue_clusters`]): their X's are one component with proxy Σ countᵢ·hᵢ, and
    /// ⟨o, X⟩ over them has proxy (Σ countᵢ·|oᵢ|·√hᵢ)², as for copies of one element; the
    /// rest of each element as [`add_group`](Self::add_group) adds it.
    pub(crate) fn add_cluster(&mut self, members: &[(ElementDiff, usize)]) {
        if let [(d, count)] = members {
            return self.add_group(d, *count);
        }
        let (mut h_c, mut ox) = (0.0, 0.0);
        for (d, count) in members {
            let c = *count as f64;
            let mut own = *d;
            if !d.spread {
                h_c += d.proxy * c;
                ox += (d.offset.abs() + d.bias_bound) * d.proxy.sqrt() * c;
                own.proxy = 0.0;
            }
            own.scale(c.sqrt());
            let g_max = self.g_max;
            self.add_sums(&own, 1);
            self.g_max = g_max.max(d.guaranteed);
            if let Confidence::Probabilistic { .. } = self.confidence {
                self.per = self.per.max(d.probabilistic_bound_at(&self.per_logs));
            }
        }
        self.expected += h_c;
        if let Confidence::Probabilistic { .. } = self.confidence {
            let h = &mut self.h[0];
            h.0 += h_c;
            h.1 += h_c * h_c;
            h.2 = h.2.max(h_c);
            self.o2h += ox * ox;
        }
    }

    /// The tensor threshold (see the module docs).
    pub(crate) fn threshold(&self, reference_norm: f64) -> Threshold {
        let g_abs = self.g2.sqrt();
        let (abs, per_element) = match self.confidence {
            Confidence::Guaranteed => (g_abs, self.g_max),
            Confidence::Probabilistic { delta } => {
                // Five events at δ/5 each: the quadratic forms of X (own coordinates) and of
                // the spread components, the linear form ⟨o, X⟩, and the two of the rounding
                // part.
                let t = (5.0 / delta).ln();
                // Hsu–Kakade–Zhang for ‖X‖² over a set of independent components.
                let hkz = |(sum_h, sum_h2, max_h): (f64, f64, f64)| {
                    sum_h + 2.0 * (t * sum_h2).sqrt() + 2.0 * t * max_h
                };
                // Own coordinates: ‖o + X‖² = ‖o‖² + 2⟨o, X⟩ + ‖X‖² with the sub-Gaussian
                // linear form ⟨o, X⟩ ≤ √(2t·Σ oᵢ²hᵢ); spread components by the triangle
                // inequality.
                let ox = (self.o2 + 2.0 * (2.0 * t * self.o2h).sqrt() + hkz(self.h[0])).sqrt()
                    + hkz(self.h[1]).sqrt();
                // Rounding part: truncation at δ/(5N) per element, Bernstein at δ/5.
                let b2 = self.b * self.b;
                let l = t;
                let t_r = b2 * l / 3.0 + ((b2 * l / 3.0).powi(2) + 2.0 * b2 * l * self.e_r).sqrt();
                let r = if b2 > 0.0 {
                    (self.e_r + t_r).sqrt()
                } else {
                    0.0
                };
                ((ox + r).min(g_abs), self.per.min(self.g_max))
            }
        };
        Threshold {
            identical: false,
            confidence: self.confidence,
            abs_frobenius: abs,
            relative: relative(abs, reference_norm),
            reference_norm,
            per_element,
            expected_relative: if self.modeled {
                relative(self.expected.sqrt(), reference_norm)
            } else {
                f64::NAN
            },
            guaranteed_relative: relative(g_abs, reference_norm),
            elements: self.elements,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::row_classes;

    /// Classes as an O(rows²) scan finds them: the first earlier row with the same bits.
    fn oracle(values: &[f64], n: usize) -> Vec<usize> {
        let rows = values.len() / n;
        let bits = |r: usize| -> Vec<u64> {
            values[r * n..(r + 1) * n]
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        let mut firsts: Vec<usize> = vec![];
        (0..rows)
            .map(|r| match firsts.iter().position(|&f| bits(f) == bits(r)) {
                Some(c) => c,
                None => {
                    firsts.push(r);
                    firsts.len() - 1
                }
            })
            .collect()
    }

    /// Rows drawn from a few patterns (with −0.0 against 0.0 and NaNs, which compare by bits):
    /// the classes, their first rows and sizes are the oracle's.
    #[test]
    fn row_classes_are_identical_rows_by_bits() {
        let patterns = [
            vec![1.0, 2.0, 3.0],
            vec![1.0, 2.0, -0.0],
            vec![1.0, 2.0, 0.0],
            vec![f64::NAN, 2.0, 3.0],
            vec![3.0, 2.0, 1.0],
        ];
        let mut state = 7u64;
        for rows in [0, 1, 2, 17, 200] {
            let mut values = vec![];
            for _ in 0..rows {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                values.extend(&patterns[(state >> 33) as usize % patterns.len()]);
            }
            let (class, classes) = row_classes(&values, 3);
            assert_eq!(class, oracle(&values, 3), "{rows} rows");
            for (c, &(first, size)) in classes.iter().enumerate() {
                assert_eq!(class[first], c);
                assert!(class[..first].iter().all(|&x| x != c));
                assert_eq!(class.iter().filter(|&&x| x == c).count(), size);
            }
        }
    }

    /// Rows longer than the sample, drawn from patterns that differ only between the sampled
    /// positions, that agree at every sampled position but one, and one-hot rows: the classes
    /// are the oracle's, so a sample shared by different rows never merges them.
    #[test]
    fn rows_alike_at_the_sampled_positions_keep_their_classes() {
        for n in [33, 100, 300] {
            let base: Vec<f64> = (0..n).map(|i| (i % 7) as f64).collect();
            let mut patterns = vec![base.clone()];
            // Every position changed once: most are not sampled, some are.
            for i in 0..n {
                let mut p = base.clone();
                p[i] += 0.5;
                patterns.push(p);
            }
            // One-hot rows.
            for i in (0..n).step_by(3) {
                let mut p = vec![0.0; n];
                p[i] = 1.0;
                patterns.push(p);
            }
            let mut state = 11u64;
            let mut values = vec![];
            for _ in 0..3 * patterns.len() {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                values.extend(&patterns[(state >> 33) as usize % patterns.len()]);
            }
            let (class, classes) = row_classes(&values, n);
            assert_eq!(class, oracle(&values, n), "n = {n}");
            let sizes: usize = classes.iter().map(|c| c.1).sum();
            assert_eq!(sizes, class.len());
        }
    }
}

//! Tests beyond the norm: systematic (scale, bias) and sparse differences, each with a
//! false-alarm probability fixed in advance.
//!
//! The norm test compares ‖D‖_F, D = cand − ref, with a threshold. Round-off spreads thinly and
//! without direction over many elements; bugs often do not. Two shapes of bug hide under a
//! norm threshold:
//! * a **systematic** error (a scale 1 + ρ, a bias, a normalizer off by a constant) moves every
//!   element the same way: its projection on the reference (or on the all-ones direction)
//!   grows like √N times the noise of that projection;
//! * a **sparse** error (a few corrupted elements in a large tensor) is diluted by the norm.
//!
//! # Systematic tests: clusters and self-normalization
//!
//! A tensor is read as a matrix: rows along its last dimension (tokens for activations),
//! columns its last dimension's indices (channels). Under round-off alone D is modelled as a
//! sum of independent parts, each made of **clusters with independent symmetric signs**:
//! single elements (a rounding of its own), rows (a norm's or a softmax's denominator,
//! computed in another order, moves a whole row), and columns (through attention every later
//! token reads the same value vector, so that vector's round-off reaches every row's channel j
//! alike — strongly so under attention sinks). Symmetric signs are the random-rounding model of
//! `bounds::compare`; clustered dependence is what the difference simulation shows. For a
//! linear statistic L = Σ wᵢDᵢ (scale: wᵢ = mᵢ = (rᵢ + cᵢ)/2; bias: wᵢ = 1) the clusters' sums
//! are independent and symmetric, so conditionally on their magnitudes L is a Rademacher sum and
//! P(|L| ≥ t·√V) ≤ 2c*·P(η ≥ t), η standard normal, c* ≈ 3.178 (Bentkus & Dzindzalieta, *A
//! tight Gaussian bound for weighted sums of Rademacher random variables*, Bernoulli 21(2),
//! 2015; tighter than Hoeffding's 2e^(−t²/2) for every δ ≤ 1), with V the sum of the clusters'
//! squared sums (Efron, *Student's t-test under symmetry conditions*, JASA 64, 1969). V is
//! estimated by the two-way cluster-robust variance of Cameron, Gelbach & Miller (*Robust
//! inference with multiway clustering*, J. Bus. Econ. Stat. 29(2), 2011):
//!
//!   V̂ = Σ_rows (Σ_row wD)² + Σ_cols (Σ_col wD)² − Σ_elements (wD)²,
//!
//! unbiased for V when the parts are as above, floored at the larger of its first two terms.
//! The test fires when |L| > t·√V̂ with 2c*·P(η ≥ t) = δ_s ([`symmetric_critical`]: 5.72 at
//! δ_s = δ/30, δ = 10⁻⁶, where Hoeffding's bound gave 5.98). Because V̂ contains the signal
//! itself, a test can fire only when the pure signal's statistic (D = m for the scale, D = 1
//! for the bias) exceeds t — about √(N/(rows + columns)): with too few rows or columns (a
//! vector, a few dozen tokens) it is reported as not applicable.
//!
//! * **Scale**: the relative scale ŝ = ⟨D, m⟩/⟨m, m⟩ fires when |ŝ| > (t·√V̂ + S)/⟨m, m⟩.
//! * **Bias**: the mean of D over the reference's root mean square, likewise.
//!
//! # Deterministic round-off
//!
//! Round-off is a deterministic function of the data, and structured data make parts of it
//! systematic. A data zoo for these tests (`cargo run --release --example detect_zoo`:
//! every family of `tests/zoo` — non-zero means, sorted, constant, integer, dyadic, repeated
//! and low-rank rows, outliers, heavy tails, residue patterns, subnormal and near-overflow
//! values — through matmul, softmax, LayerNorm, RMSNorm and elementwise ops under every pair
//! of correct policies) found false alarms in 120 of 1,808 correct pairs with the model above
//! alone. Each class is handled, never by tuning on bugs:
//! * **Equal rows** in the reference (a token repeated in a batch before attention mixes
//!   positions, a constant tensor) came from equal inputs and have equal round-off: they are
//!   one cluster ([`RowSumsKeyed`]; the variance keeps the larger of merged and apart).
//! * **A row's shared factor**: a normalizer's or a denominator's rounding moves a whole row
//!   by one factor, and a sequential sum of repeated terms (BF16-gridded softmax logits) is
//!   biased — the rows' factors had a mean of half their spread on Gaussian logits, 1.4 times
//!   on dyadic ones. The threshold adds S = κ·σ_f·ΣM ([`factor_slack`], κ =
//!   [`SYSTEMATIC_SLACK`] = 2): σ_f the spread of the rows' factors beyond what their
//!   elements' own noise makes (a per-row least-squares fit D ≈ a·m + b, its residuals'
//!   sandwich variance), M a row's weight. A scale bug moves every row's factor alike and adds
//!   no spread; a tensor whose rows carry real factors pays with power (the size study's BF16
//!   activation gradients: a scale at 0.64 ε instead of 0.09 ε).
//! * **Two stored formats**: one side rounded once more, onto a grid whose rounding is biased
//!   by the data's distribution (GELU outputs in BF16 against FP32: the bias test at 2×) —
//!   no systematic test between formats.
//! * **Accumulation below FP32** stagnates one way ([`Detection::accumulated_in`]).
//! * **A norm threshold at least the reference's norm** says the values may be lost whole (a
//!   candidate whose FP16 partial sums underflowed to zero is a scale of −1): no systematic
//!   test then (`check::apply_threshold`).
//!
//! The zoo after these: no false alarm of the scale or bias test (closest 0.89 / 0.83, dyadic
//! softmax rows and subnormal matmuls). The assumption left is stated: a row's deterministic
//! factor is at most κ times the spread of the rows' factors; data built to break it (every
//! row the same multiset of a few values, summed sequentially in one order) can.
//!
//! **Why the midpoint weights.** The reference has round-off of its own, which the candidate
//! does not share: in the random-rounding model both are executions of one computation,
//! r = t + n_r and c = t + n_c with (r, c) exchangeable, and then ⟨D, r⟩ = ⟨c, r⟩ − ‖r‖² has
//! mean −E‖n_r‖² — a scale of minus half the squared relative difference (regression
//! dilution). Its noise shrinks like 1/√N, so on large noisy tensors the reference-weighted
//! test fires on correct runs: an FP8 activation gradient of 3·10⁴ elements 12 ε of BF16 off
//! did (`ttrace validate --large`), and a BF16 tensor 1 ε off would from about 2·10⁶
//! elements. ⟨D, m⟩ = (‖c‖² − ‖r‖²)/2 changes sign under the exchange, so it is symmetric
//! under the same model; a scale bug c = (1 + ρ)·t moves it by ρ‖m‖² as before.
//!
//! **Parameter gradients have no systematic test**: a weight gradient sums one rank-1 term per
//! token, so a token's round-off (a per-token scale from its norm or softmax denominator)
//! reaches every row and every column of it at once — a cluster the model above does not have,
//! and on the full validation sweep the test fired on one. (A test whose units are rows and
//! columns separately, each judged by the sign test, fired there too.)
//!
//! Per-channel (or per-row) biases are not tested here: a column cluster *is* a per-channel
//! offset, so round-off alone produces them (an attention sink's value vector), and one
//! channel's data cannot tell that from a bug. Where the difference simulation runs (`ttrace
//! validate`), it prices the column and row means ([`Detector::Channel`], [`Detector::Row`]).
//!
//! # The sparse test
//!
//! Every element against its own bound. The element's scale is sᵢ = max(|rᵢ|, rms of its row,
//! rms of its column) (the round-off of a reduction scales with its terms, for which the row's
//! and column's magnitudes stand where |rᵢ| is small by cancellation — a linear's output has
//! terms the size of its token's input and its weight column, an attention score those of its
//! query and its key, and a masked score row holds one finite element; a softmax's or an
//! elementwise function's error scales with |rᵢ|). The pools below use the first pass's
//! max(|rᵢ|, rms of its row), which is smaller: conservative both ways. One unit in the last
//! place of the coarsest standard grid both tensors lie on is always allowed (two roundings of
//! nearly equal values: |fl(x) − fl(y)| ≤ |x − y| + ulp); beyond it, eᵢ = (|Dᵢ| − ulpᵢ)⁺/sᵢ is
//! compared with the noise scale σ̂ᵢ, the largest of the root mean squares of Dⱼ/sⱼ over the
//! rest of its row, the rest of its column and the rest of the tensor (leave-one-out: a corrupted element does not raise its own bound) — for an element at
//! least its row's root mean square, also of the others that are, each measured against its
//! own magnitude (softmax rows dominated by one element share one relative error that their
//! small elements do not show: 7× on heavy-tailed logits before) — and u/√3 of the grid (one
//! rounding's standard deviation: fewer differing elements than that are no evidence of a
//! smaller noise). The tail is taken **exponential**, not Gaussian: the round-off of a sum that
//! a few products dominate (a weight gradient over few tokens, an attention backward) is
//! sub-exponential, and on the simulator's correct runs Gaussian tails came within 7% of a
//! false alarm (an attention backward). With Laplace tails of variance σ̂ᵢ², P(eᵢ > x·σ̂ᵢ) ≤ exp(−√2·x), so an element
//! fires beyond x = ln(N/δ_s)/√2 (Bonferroni over the N elements); the report gives the worst
//! element and how many exceed.
//!
//! **Nor are parameter gradients tested element by element.** Each element sums one product
//! per token of the batch, and a few dominant terms — the target token's logit gradient in an
//! output layer's weight gradient, an FP8 rounding flip of one of them — make single elements
//! differ legitimately by many times what their row, column and tensor do (on the simulator's
//! FP8 runs an output layer's weight-gradient element moved by 62% of its row's magnitude
//! against a pooled noise of 3%). Pricing that needs each element's terms, which a trace does
//! not hold; the norm and the systematic tests still judge them.
//!
//! # The false-alarm budget
//!
//! Per tensor at most δ (10⁻⁶ by default) in all, by the union bound: [`NORM_SHARE`]·δ = 0.9·δ
//! for the norm test and the rest shared by the tests here.
//!
//! # What the model does not cover
//!
//! Rounding that is biased rather than symmetric breaks the scale and bias tests: long
//! same-sign sums accumulated in a low-precision format stagnate, in one direction, by
//! amounts that depend on the order, and every later tensor carries the bias. A BF16- or
//! FP16-accumulated matmul of positive operands (1024 × 256 × 256), sequential against
//! pairwise or split in two, fires both tests at 2.4–2.5× their thresholds on correct
//! arithmetic; accumulated in FP32 (K up to 4096) the same pairs stay below 0.2. So a run
//! that accumulates any reduction below FP32 has no scale or bias test
//! ([`Detection::accumulated_in`]: the trace checker takes the narrowest of the recipe's
//! accumulators and the modules' declared `accumulate` formats, the simulator its recipe's).
//! ttrace's default recipes and the real engines it was measured on accumulate in FP32. Differences correlated
//! along structures other than rows and columns (a scalar computed once and applied to the whole
//! tensor in another order) break the independence of clusters; a tensor that is one row (a
//! bias, a norm's weight) has no systematic test for that reason.

use serde::Serialize;

use crate::format::Format;

/// The share of the per-tensor false-alarm budget δ spent on the norm test; the tests here
/// share the rest.
pub const NORM_SHARE: f64 = 0.9;

/// The per-tensor false-alarm probability of all tests together, by default.
pub const DEFAULT_DELTA: f64 = 1e-6;

/// Tests sharing (1 − [`NORM_SHARE`])·δ.
const SHARED_BY: f64 = 3.0;

/// Rows the sparse test keeps a record of (40 bytes each: 160 MiB at most).
const MAX_ROW_RECORDS: usize = 1 << 22;

/// The smallest two-way variance a systematic test is judged on: every term lost to underflow
/// is below 2⁻¹⁰⁷⁵, so for fewer than 2⁴⁰ elements the lost part is below 2⁻³⁵ of it.
const MIN_SOUND_VARIANCE: f64 = 1.0e-271; // ≈ 2⁻⁹⁰⁰

/// Longest row: rows longer than this are cut into pieces of it (and have no columns). 2¹⁸
/// holds a 256k vocabulary's logits; the row buffers then stay within 4 MiB per comparison.
const MAX_ROW: usize = 1 << 18;

/// A test on a pair of tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Detector {
    /// ‖cand − ref‖_F against the tensor's threshold.
    Norm,
    /// The relative scale ⟨D, m⟩/⟨m, m⟩, m = (ref + cand)/2.
    Scale,
    /// The mean difference relative to the reference's root mean square.
    Bias,
    /// The per-channel offset: the column means of D (each index of the last dimension,
    /// averaged over rows) against a bound from the difference simulation — `ttrace
    /// validate` only, where that simulation runs (`validate::OffsetBounds::channel`).
    Channel,
    /// The per-row offset: the row means of D (a token's mean over the last dimension)
    /// against a bound from the difference simulation — `ttrace validate` only
    /// (`validate::OffsetBounds::row`).
    Row,
    /// Single elements beyond their own bound.
    Sparse,
}

impl Detector {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Detector::Norm => "norm",
            Detector::Scale => "scale",
            Detector::Bias => "bias",
            Detector::Channel => "channel",
            Detector::Row => "row",
            Detector::Sparse => "sparse",
        }
    }
}

/// What one test found on one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Finding {
    /// The test.
    pub detector: Detector,
    /// Its estimate in units of ε: the relative scale (scale), the mean difference over the
    /// reference's root mean square (bias), the root mean square of the column means over
    /// the reference's (channel), the worst element's difference beyond one ulp over its
    /// scale sᵢ (sparse).
    pub estimate: f64,
    /// The threshold on |estimate|, in the same unit.
    pub threshold: f64,
    /// |estimate| / threshold: the test fires above 1.
    pub ratio: f64,
    /// It fired.
    pub fired: bool,
    /// The flat index of the worst element (sparse).
    pub at: Option<usize>,
    /// Elements beyond their bound (sparse).
    pub count: usize,
}

/// The settings of the tests beyond the norm.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Detection {
    /// The per-tensor false-alarm probability δ of all tests together (the norm's included).
    pub delta: f64,
    /// Run the scale, bias and sparse tests (else only the norm).
    pub enabled: bool,
    /// Run the sparse test (the comparison of a tensor by id turns it off for parameter
    /// gradients: see the module docs).
    pub sparse: bool,
    /// Run the scale and bias tests (likewise off for parameter gradients).
    pub systematic: bool,
}

impl Default for Detection {
    fn default() -> Self {
        Detection {
            delta: DEFAULT_DELTA,
            enabled: true,
            sparse: true,
            systematic: true,
        }
    }
}

impl Detection {
    /// The false-alarm probability of each test here.
    pub fn each(&self) -> f64 {
        self.delta * (1.0 - NORM_SHARE) / SHARED_BY
    }

    /// These settings for a run whose narrowest accumulation format is `acc`: below FP32
    /// precision the scale and bias tests are off (see "What the model does not cover" in the
    /// module docs: a long same-sign sum in BF16 or FP16 stagnates, rounding one way, and the
    /// bias it leaves is carried into every later tensor, so no tensor of such a run has
    /// symmetric differences). The norm and sparse tests stay.
    ///
    /// # Examples
    ///
    /// ```
    /// use ttrace::check::Detection;
    /// use ttrace::Format;
    /// assert!(Detection::default().accumulated_in(Format::F32).systematic);
    /// assert!(!Detection::default().accumulated_in(Format::BF16).systematic);
    /// ```
    pub fn accumulated_in(self, acc: Format) -> Detection {
        Detection {
            systematic: self.systematic && acc.precision() >= Format::F32.precision(),
            ..self
        }
    }
}

/// Bentkus and Dzindzalieta's optimal constant c* = 1/(4·P(η ≥ √2)) ≈ 3.178, η standard
/// normal: P(Σ aᵢεᵢ ≥ x) ≤ c*·P(η ≥ x) for independent Rademacher εᵢ and Σ aᵢ² ≤ 1, every x
/// (*A tight Gaussian bound for weighted sums of Rademacher random variables*, Bernoulli
/// 21(2), 2015).
fn rademacher_constant() -> f64 {
    1.0 / (4.0 * normal_upper_tail(std::f64::consts::SQRT_2))
}

/// P(η ≥ x) for η standard normal.
fn normal_upper_tail(x: f64) -> f64 {
    0.5 * statrs::function::erf::erfc(x / std::f64::consts::SQRT_2)
}

/// The two-sided critical value t of a Rademacher sum of unit variance (a self-normalized sum
/// of independent symmetric clusters, conditionally on their magnitudes) at false-alarm
/// probability δ: the smaller of Hoeffding's √(2 ln(2/δ)) (P(|S| ≥ t) ≤ 2e^(−t²/2)) and
/// Bentkus–Dzindzalieta's Gaussian comparison, 2c*·P(η ≥ t) = δ — the latter for every δ ≤ 1
/// (5.72 against Hoeffding's 5.98 at the tests' δ/30 = 3.3·10⁻⁸).
pub fn symmetric_critical(delta: f64) -> f64 {
    use statrs::distribution::{ContinuousCDF, Normal};
    let hoeffding = (2.0 * (2.0 / delta).ln()).sqrt();
    let p = delta / (2.0 * rademacher_constant());
    // P(η ≥ t) = p: t = −Φ⁻¹(p) (the lower tail, without the cancellation of 1 − p).
    let gaussian = Normal::standard().inverse_cdf(p.min(0.5));
    hoeffding.min(-gaussian)
}

/// The critical value of the sparse test for `n` elements at false-alarm probability `delta`:
/// a Laplace variable of unit variance exceeds x in absolute value with probability
/// exp(−√2·x), so x = ln(n/δ)/√2 keeps the union over n elements at δ.
pub fn sparse_critical(n: f64, delta: f64) -> f64 {
    (n / delta).ln().max(0.0) / std::f64::consts::SQRT_2
}

/// One row's systematic sums and the key of its reference values.
///
/// Rows equal in the reference (a token repeated in a batch, before attention mixes positions;
/// a constant tensor) were computed from equal inputs, so their round-off is equal too: one
/// cluster, not independent ones. Counted apart, k equal rows make the variance k times too
/// small for their part; the row clusters are therefore the classes of equal reference rows
/// (by a 64-bit key: a collision merges two classes, which only makes the test more cautious).
#[derive(Debug, Clone, Copy)]
struct RowSumsKeyed {
    key: u64,
    /// Σ wD for the scale (w = m) and the bias (w = 1), Σ m², the finite pairs, Σ D², and
    /// Σ m, Σ (Dm)², Σ m⁴, Σ m²D, Σ m³, Σ m³D.
    x: f64,
    y: f64,
    mm: f64,
    n: f64,
    dd: f64,
    ms: f64,
    dada: f64,
    a4: f64,
    m2d: f64,
    m3: f64,
    m3d: f64,
}

impl RowSumsKeyed {
    /// The row's own structure: D fitted by least squares as a·m + b — a relative factor and
    /// an offset shared by the row, as a normalizer's or a denominator's rounding moves a
    /// whole row. `None` for a row too short or degenerate to fit.
    fn fit(&self) -> Option<(f64, f64)> {
        let n = self.n;
        let det = n * self.mm - self.ms * self.ms;
        (n >= 3.0 && det > 1e-9 * n * self.mm).then(|| {
            let a = (n * self.x - self.ms * self.y) / det;
            let b = (self.mm * self.y - self.ms * self.x) / det;
            (a, b)
        })
    }

    /// The variance the elements' own noise gives the row's sums Σ mD and Σ D: the sandwich
    /// (heteroscedasticity-consistent) estimates Σ m²e² and Σ e² of the residuals
    /// e = D − a·m − b, times n/(n − 2). Zero for a row the fit explains — whose sum is one
    /// event, not many.
    fn noise(&self) -> (f64, f64) {
        let Some((a, b)) = self.fit() else {
            return (0.0, 0.0);
        };
        let k = self.n / (self.n - 2.0);
        // Σ m²(D − am − b)² and Σ (D − am − b)², expanded in the row's sums.
        let scale = self.dada - 2.0 * a * self.m3d - 2.0 * b * self.m2d
            + a * a * self.a4
            + 2.0 * a * b * self.m3
            + b * b * self.mm;
        let bias = self.dd - 2.0 * a * self.x - 2.0 * b * self.y
            + a * a * self.mm
            + 2.0 * a * b * self.ms
            + b * b * self.n;
        (scale.max(0.0) * k, bias.max(0.0) * k)
    }
}

/// The deterministic part the row clusters may give L = Σ s_c: κ·σ_f·ΣM_c, where s_c = f_c·M_c
/// (M_c the cluster's weight Σw·m — Σm² for the scale, its pairs for the bias — and f_c its
/// own factor) and σ_f the spread of the factors beyond what the elements' own noise v_c
/// makes: σ_f² = (Σ(f_c − f̄)² − Σv_c/M_c² − 3·√(2Σ(v_c/M_c²)²))⁺/(n − 1). A pure scale has
/// equal factors (σ_f = 0); a normalizer's rounding, one factor per row, spreads them.
fn factor_slack(s: &[f64], weight: &[f64], noise: &[f64]) -> f64 {
    let (mut f, mut vf) = (Vec::with_capacity(s.len()), Vec::with_capacity(s.len()));
    for ((&sc, &m), &v) in s.iter().zip(weight).zip(noise) {
        if m > 0.0 {
            f.push(sc / m);
            vf.push(v / (m * m));
        }
    }
    let n = f.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let mean = f.iter().sum::<f64>() / n;
    let ss = f.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>();
    let v = vf.iter().sum::<f64>();
    let sd = (2.0 * vf.iter().map(|x| x * x).sum::<f64>()).sqrt();
    let var = (ss - v - 3.0 * sd).max(0.0) / (n - 1.0);
    SYSTEMATIC_SLACK * var.sqrt() * weight.iter().sum::<f64>()
}

/// The key of a row's reference values (their bits, in four interleaved streams).
fn row_key(r: &[f64]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h = [1u64, 2, 3, 4];
    let chunks = r.chunks_exact(4);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..4 {
            h[l] = (h[l] ^ c[l].to_bits()).wrapping_mul(K).rotate_left(29);
        }
    }
    for (l, x) in tail.iter().enumerate() {
        h[l] = (h[l] ^ x.to_bits()).wrapping_mul(K).rotate_left(29);
    }
    h.iter().fold(r.len() as u64, |a, &b| {
        (a ^ b).wrapping_mul(K).rotate_left(31)
    })
}

/// κ: the deterministic part round-off may give the systematic tests' statistic, as a mean
/// row factor of up to κ times the factors' spread ([`factor_slack`]; module docs,
/// "Deterministic round-off").
pub const SYSTEMATIC_SLACK: f64 = 2.0;

/// Sums of one linear statistic L = Σ wᵢDᵢ by clusters.
#[derive(Debug, Clone, Copy, Default)]
struct Clustered {
    /// L.
    sum: f64,
    /// Σ over rows of the row's sum, squared.
    rows: f64,
    /// The deterministic part its row clusters may hold ([`factor_slack`]).
    slack: f64,
    /// Σ over elements of (wᵢDᵢ)².
    elements: f64,
}

impl Clustered {
    /// The two-way cluster-robust variance given Σ over columns of the column's sum squared:
    /// V̂ = rows + columns − elements, floored at the larger of the first two.
    fn variance(&self, cols: f64) -> f64 {
        (self.rows + cols - self.elements).max(self.rows.max(cols))
    }
}

/// A reader of a pair's values `start..end` again, in pieces: `again(start, end, f)`.
pub(crate) type ReadAgain<'a> = dyn FnMut(usize, usize, &mut dyn FnMut(&[f64], &[f64])) + 'a;

/// Per-row record of the first pass, for the sparse test's second.
#[derive(Debug, Clone, Copy, Default)]
struct RowRecord {
    /// Σ (Dⱼ/sⱼ)² over the row (raw Σ Dⱼ² for a row whose reference is all zero).
    q: f64,
    /// Largest single term of `q`.
    qmax: f64,
    /// Largest eⱼ with the finest allowance (an upper bound of the exact one).
    emax: f64,
    /// Finite pairs.
    n: usize,
    /// The reference is zero on the whole row (sⱼ is then the tensor's root mean square).
    zero: bool,
}

/// The per-column sums a row of a matrix adds to (see [`Detect`]).
struct Columns<'a> {
    dr: &'a mut [f64],
    d: &'a mut [f64],
    r2: &'a mut [f64],
    m2: &'a mut [f64],
    n: &'a mut [usize],
    q: &'a mut [f64],
}

impl Columns<'_> {
    /// Adds element `j` (reference `a`, terms `e`) to its column; its squared term only where
    /// `with_q` (a row whose reference is not zero).
    fn add(&mut self, j: usize, a: f64, e: &Element, with_q: bool) {
        self.dr[j] += e.da;
        self.d[j] += e.d;
        self.r2[j] += a * a;
        self.m2[j] += e.mm;
        self.n[j] += 1;
        if with_q {
            self.q[j] += e.q;
        }
    }
}

/// One row's sums of the first pass (see [`Detect::row_pass_plain`]).
struct RowSums {
    rr: f64,
    mm: f64,
    zero: bool,
    x: f64,
    y: f64,
    dada: f64,
    dd: f64,
    a4: f64,
    q: f64,
    qmax: f64,
    emax: f64,
    /// Σ (D/|r|)² and their count over the elements at least their row's root mean square
    /// (those measured against their own magnitude).
    lq: f64,
    ln: f64,
    /// Σ m, Σ m²D, Σ m³, Σ m³D (the rows' residual noise, [`RowSumsKeyed`]).
    ms: f64,
    m2d: f64,
    m3: f64,
    m3d: f64,
}

/// The first pass's per-element work on a row of finite pairs, in lanes. One unit in the last
/// place of the stored format at m = max(|a|, |b|) is 2^⌊log₂ m⌋ (m's exponent bits), at least
/// `min_ulp` = 2^emin, times `frac` = 2^(1−p): exact, subnormal results included.
#[derive(Clone, Copy)]
struct Kernel {
    min_ulp: f64,
    frac: f64,
}

/// Lanes of the row kernel's sums.
const LANES: usize = 4;

impl Kernel {
    fn dispatch(self, r: &[f64], c: &[f64], cols: Option<Columns<'_>>) -> Option<RowSums> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { self.row_avx2(r, c, cols) };
        }
        self.row(r, c, cols)
    }

    /// [`Kernel::row`] in AVX2 intrinsics: the same IEEE operations in the same order per
    /// lane, so the same bits (`max_pd(m, x)` is `if m > x { m } else { x }`, as in
    /// [`Kernel::element`]); the tail of fewer than [`LANES`] elements goes through
    /// [`Kernel::element`].
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn row_avx2(self, r: &[f64], c: &[f64], cols: Option<Columns<'_>>) -> Option<RowSums> {
        use std::arch::x86_64::*;
        let n = r.len().min(c.len());
        let (r, c) = (&r[..n], &c[..n]);
        let tail = n - n % LANES;
        let (rp, cp) = (r.as_ptr(), c.as_ptr());
        let zero = _mm256_setzero_pd();
        let (mut rr, mut nan) = (zero, zero);
        for i in (0..tail).step_by(LANES) {
            // SAFETY: i + LANES ≤ tail ≤ the length of both slices.
            let (a, b) = unsafe { (_mm256_loadu_pd(rp.add(i)), _mm256_loadu_pd(cp.add(i))) };
            rr = _mm256_add_pd(rr, _mm256_mul_pd(a, a));
            nan = _mm256_add_pd(
                nan,
                _mm256_add_pd(_mm256_mul_pd(a, zero), _mm256_mul_pd(b, zero)),
            );
        }
        let lanes = |v: __m256d| {
            let mut out = [0.0f64; LANES];
            // SAFETY: stores 4 f64 into an array of 4.
            unsafe { _mm256_storeu_pd(out.as_mut_ptr(), v) };
            out
        };
        let rest = r[tail..]
            .iter()
            .zip(&c[tail..])
            .fold(0.0, |s, (a, b)| s + a * 0.0 + b * 0.0);
        if lanes(nan).iter().sum::<f64>() + rest != 0.0 {
            return None;
        }
        let rr = lanes(rr).iter().sum::<f64>() + r[tail..].iter().map(|a| a * a).sum::<f64>();
        let rms = if n > 0 { (rr / n as f64).sqrt() } else { 0.0 };
        let zero_row = rms == 0.0;
        let (floor, own) = if zero_row { (1.0, 0.0) } else { (rms, 1.0) };
        let abs = _mm256_castsi256_pd(_mm256_set1_epi64x(i64::MAX));
        let exp = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7ff0_0000_0000_0000));
        let (min_ulp, frac) = (_mm256_set1_pd(self.min_ulp), _mm256_set1_pd(self.frac));
        let (floor_v, own_v, one) = (
            _mm256_set1_pd(floor),
            _mm256_set1_pd(own),
            _mm256_set1_pd(1.0),
        );
        let [mut x, mut y, mut dada, mut dd, mut a4, mut qs, mut qmax, mut emax] = [zero; 8];
        let (mut lq, mut ln, mut ms) = (zero, zero, zero);
        let (mut m2d, mut m3, mut m3d) = (zero, zero, zero);
        let mut mms = zero;
        let half = _mm256_set1_pd(0.5);
        // Columns: Σ dr, Σ d, Σ r², pairs, Σ q (q masked to zero on a row of zero reference).
        let q_mask = _mm256_castsi256_pd(_mm256_set1_epi64x(if zero_row { 0 } else { -1 }));
        let mut cols = cols;
        let ones = _mm256_set1_epi64x(1);
        for i in (0..tail).step_by(LANES) {
            // SAFETY: i + LANES ≤ tail ≤ the length of both slices.
            let (a, b) = unsafe { (_mm256_loadu_pd(rp.add(i)), _mm256_loadu_pd(cp.add(i))) };
            let d = _mm256_sub_pd(b, a);
            let mid = _mm256_mul_pd(_mm256_add_pd(a, b), half);
            let da = _mm256_mul_pd(d, mid);
            let mm = _mm256_mul_pd(mid, mid);
            let aa = _mm256_and_pd(a, abs);
            let m = _mm256_max_pd(aa, _mm256_and_pd(b, abs));
            let allowance = _mm256_mul_pd(_mm256_max_pd(_mm256_and_pd(m, exp), min_ulp), frac);
            let scale = _mm256_max_pd(_mm256_mul_pd(own_v, aa), floor_v);
            let inv = _mm256_div_pd(one, scale);
            let e = _mm256_mul_pd(d, inv);
            let q = _mm256_mul_pd(e, e);
            let a2 = _mm256_mul_pd(a, a);
            x = _mm256_add_pd(x, da);
            mms = _mm256_add_pd(mms, mm);
            ms = _mm256_add_pd(ms, mid);
            m2d = _mm256_add_pd(m2d, _mm256_mul_pd(mid, da));
            m3 = _mm256_add_pd(m3, _mm256_mul_pd(mid, mm));
            m3d = _mm256_add_pd(m3d, _mm256_mul_pd(mm, da));
            y = _mm256_add_pd(y, d);
            dada = _mm256_add_pd(dada, _mm256_mul_pd(da, da));
            dd = _mm256_add_pd(dd, _mm256_mul_pd(d, d));
            a4 = _mm256_add_pd(a4, _mm256_mul_pd(mm, mm));
            qs = _mm256_add_pd(qs, q);
            qmax = _mm256_max_pd(qmax, q);
            // Elements measured against their own magnitude: own·|a| ≥ floor.
            let big = _mm256_cmp_pd::<_CMP_GE_OQ>(_mm256_mul_pd(own_v, aa), floor_v);
            lq = _mm256_add_pd(lq, _mm256_and_pd(q, big));
            ln = _mm256_add_pd(ln, _mm256_and_pd(one, big));
            let over = _mm256_max_pd(_mm256_sub_pd(_mm256_and_pd(d, abs), allowance), zero);
            emax = _mm256_max_pd(emax, _mm256_div_pd(over, scale));
            if let Some(k) = cols.as_mut() {
                // SAFETY: the column slices are as long as the row (a full row of a matrix).
                unsafe {
                    let add = |p: *mut f64, v: __m256d| {
                        _mm256_storeu_pd(p, _mm256_add_pd(_mm256_loadu_pd(p), v));
                    };
                    add(k.dr.as_mut_ptr().add(i), da);
                    add(k.d.as_mut_ptr().add(i), d);
                    add(k.r2.as_mut_ptr().add(i), a2);
                    add(k.m2.as_mut_ptr().add(i), mm);
                    add(k.q.as_mut_ptr().add(i), _mm256_and_pd(q, q_mask));
                    let np = k.n.as_mut_ptr().add(i).cast::<__m256i>();
                    _mm256_storeu_si256(np, _mm256_add_epi64(_mm256_loadu_si256(np), ones));
                }
            }
        }
        let mut acc = Acc {
            x: lanes(x),
            mm: lanes(mms),
            y: lanes(y),
            dada: lanes(dada),
            dd: lanes(dd),
            a4: lanes(a4),
            q: lanes(qs),
            qmax: lanes(qmax),
            emax: lanes(emax),
            lq: lanes(lq),
            ln: lanes(ln),
            ms: lanes(ms),
            m2d: lanes(m2d),
            m3: lanes(m3),
            m3d: lanes(m3d),
        };
        for j in tail..n {
            let e = self.element(&mut acc, 0, r[j], c[j], floor, own);
            if let Some(k) = cols.as_mut() {
                k.add(j, r[j], &e, !zero_row);
            }
        }
        Some(acc.sums(rr, zero_row))
    }

    /// The row's sums, or `None` (nothing added to `cols`) if a pair is not finite.
    #[inline(always)]
    fn row(self, r: &[f64], c: &[f64], cols: Option<Columns<'_>>) -> Option<RowSums> {
        let n = r.len().min(c.len());
        let (r, c) = (&r[..n], &c[..n]);
        // Σr², and Σ (a·0 + b·0), which is NaN unless every pair is finite.
        let (mut rr, mut nan) = ([0.0f64; LANES], [0.0f64; LANES]);
        for (a, b) in r.chunks_exact(LANES).zip(c.chunks_exact(LANES)) {
            for l in 0..LANES {
                rr[l] += a[l] * a[l];
                nan[l] += a[l] * 0.0 + b[l] * 0.0;
            }
        }
        let tail = n - n % LANES;
        let rest = r[tail..]
            .iter()
            .zip(&c[tail..])
            .fold(0.0, |s, (a, b)| s + a * 0.0 + b * 0.0);
        if nan.iter().sum::<f64>() + rest != 0.0 {
            return None;
        }
        let rr = rr.iter().sum::<f64>() + r[tail..].iter().map(|a| a * a).sum::<f64>();
        let rms = if n > 0 { (rr / n as f64).sqrt() } else { 0.0 };
        let zero = rms == 0.0;
        // The first pass's scale max(|rⱼ|, row rms), or 1 on a row whose reference is zero.
        let (floor, own) = if zero { (1.0, 0.0) } else { (rms, 1.0) };
        let mut acc = Acc::default();
        match cols {
            Some(mut cols) => {
                let with_q = !zero;
                let chunks = r
                    .chunks_exact(LANES)
                    .zip(c.chunks_exact(LANES))
                    .zip(cols.dr.chunks_exact_mut(LANES))
                    .zip(cols.d.chunks_exact_mut(LANES))
                    .zip(cols.r2.chunks_exact_mut(LANES))
                    .zip(cols.m2.chunks_exact_mut(LANES))
                    .zip(cols.n.chunks_exact_mut(LANES))
                    .zip(cols.q.chunks_exact_mut(LANES));
                for (((((((a, b), dr), d), r2), m2), cn), q) in chunks {
                    for l in 0..LANES {
                        let e = self.element(&mut acc, l, a[l], b[l], floor, own);
                        dr[l] += e.da;
                        d[l] += e.d;
                        r2[l] += a[l] * a[l];
                        m2[l] += e.mm;
                        cn[l] += 1;
                        q[l] += if with_q { e.q } else { 0.0 };
                    }
                }
                for j in tail..n {
                    let e = self.element(&mut acc, 0, r[j], c[j], floor, own);
                    cols.add(j, r[j], &e, with_q);
                }
            }
            None => {
                for (a, b) in r.chunks_exact(LANES).zip(c.chunks_exact(LANES)) {
                    for l in 0..LANES {
                        self.element(&mut acc, l, a[l], b[l], floor, own);
                    }
                }
                for j in tail..n {
                    self.element(&mut acc, 0, r[j], c[j], floor, own);
                }
            }
        }
        Some(acc.sums(rr, zero))
    }

    #[inline(always)]
    fn element(self, acc: &mut Acc, l: usize, a: f64, b: f64, floor: f64, own: f64) -> Element {
        const EXP: u64 = 0x7ff0_0000_0000_0000;
        let d = b - a;
        let mid = (a + b) * 0.5;
        let da = d * mid;
        let mm = mid * mid;
        let max = |m: f64, x: f64| if m > x { m } else { x };
        let m = max(a.abs(), b.abs());
        let allowance = max(f64::from_bits(m.to_bits() & EXP), self.min_ulp) * self.frac;
        let scale = max(own * a.abs(), floor);
        let inv = 1.0 / scale;
        let e = d * inv;
        let q = e * e;
        acc.x[l] += da;
        acc.mm[l] += mm;
        acc.ms[l] += mid;
        acc.m2d[l] += mid * da;
        acc.m3[l] += mid * mm;
        acc.m3d[l] += mm * da;
        acc.y[l] += d;
        acc.dada[l] += da * da;
        acc.dd[l] += d * d;
        acc.a4[l] += mm * mm;
        acc.q[l] += q;
        let max = |m: f64, x: f64| if m > x { m } else { x };
        acc.qmax[l] = max(acc.qmax[l], q);
        let big = if own * a.abs() >= floor { 1.0 } else { 0.0 };
        acc.lq[l] += q * big;
        acc.ln[l] += big;
        acc.emax[l] = max(acc.emax[l], max(d.abs() - allowance, 0.0) / scale);
        Element { d, da, mm, q }
    }
}

/// The lanes of [`RowSums`]'s sums and maxima.
#[derive(Default)]
struct Acc {
    x: [f64; LANES],
    mm: [f64; LANES],
    y: [f64; LANES],
    dada: [f64; LANES],
    dd: [f64; LANES],
    a4: [f64; LANES],
    q: [f64; LANES],
    qmax: [f64; LANES],
    emax: [f64; LANES],
    lq: [f64; LANES],
    ln: [f64; LANES],
    ms: [f64; LANES],
    m2d: [f64; LANES],
    m3: [f64; LANES],
    m3d: [f64; LANES],
}

impl Acc {
    fn sums(&self, rr: f64, zero: bool) -> RowSums {
        let sum = |v: &[f64; LANES]| v.iter().sum::<f64>();
        let max = |v: &[f64; LANES]| v.iter().fold(0.0f64, |m, &x| m.max(x));
        RowSums {
            rr,
            mm: sum(&self.mm),
            zero,
            x: sum(&self.x),
            y: sum(&self.y),
            dada: sum(&self.dada),
            dd: sum(&self.dd),
            a4: sum(&self.a4),
            q: sum(&self.q),
            qmax: max(&self.qmax),
            emax: max(&self.emax),
            lq: sum(&self.lq),
            ln: sum(&self.ln),
            ms: sum(&self.ms),
            m2d: sum(&self.m2d),
            m3: sum(&self.m3),
            m3d: sum(&self.m3d),
        }
    }
}

/// One element's terms that its column adds.
struct Element {
    d: f64,
    /// D·m, m = (r + c)/2.
    da: f64,
    /// m².
    mm: f64,
    q: f64,
}

/// The standard grids, coarsest first, that a tensor's values may all lie on.
const GRIDS: [Format; 5] = [
    Format::E4M3,
    Format::E5M2,
    Format::BF16,
    Format::F16,
    Format::F32,
];

/// The tests' first pass over a pair of tensors fed in pieces (any lengths), in order.
pub(crate) struct Detect {
    cfg: Detection,
    stored: Format,
    /// Row length (the last dimension, at most [`MAX_ROW`]).
    row: usize,
    /// Columns (the last dimension; 0 for a vector or rows cut into pieces).
    cols: usize,
    /// A matrix (two or more dimensions): a vector has no systematic test.
    matrix: bool,
    buf_r: Vec<f64>,
    buf_c: Vec<f64>,
    /// Elements fed so far into finished rows.
    done: usize,
    /// Finite pairs.
    n: usize,
    /// Σ r².
    rr: f64,
    /// Σ m², m = (r + c)/2.
    mm: f64,
    /// The scale (wᵢ = mᵢ = (rᵢ + cᵢ)/2) and bias (wᵢ = 1) statistics by rows and elements.
    scale: Clustered,
    bias: Clustered,
    /// The pure scale signal's (D = r) rows and elements: Σ_rows (Σ_row r²)², Σ r⁴.
    pure_rows: f64,
    pure_elements: f64,
    col_dr: Vec<f64>,
    col_d: Vec<f64>,
    col_r2: Vec<f64>,
    /// Σ m² per column, m = (r + c)/2 (the scale test's weights).
    col_m2: Vec<f64>,
    /// Σ (Dⱼ/sⱼ)² and finite pairs per column (the sparse test's column pools).
    col_q: Vec<f64>,
    col_n: Vec<usize>,
    rows: Vec<RowRecord>,
    /// Rows seen (the records stop at [`MAX_ROW_RECORDS`]).
    row_count: usize,
    /// Each row's systematic sums under the key of its reference values: rows equal in the
    /// reference are one cluster (see [`RowSumsKeyed`]).
    keyed: Vec<RowSumsKeyed>,
    /// Σ over rows of (finite pairs in the row)².
    ones_rows: f64,
    /// Σ (D/|r|)² and the count over the elements at least their row's root mean square: the
    /// sparse test's pool for elements measured against their own magnitude.
    large_q: f64,
    large_n: f64,
    /// Which of [`GRIDS`] still hold every value.
    on_grid: [bool; 5],
    /// Some of them do.
    grid_live: bool,
}

impl Detect {
    /// A first pass over a tensor of `shape` stored in `stored` (the coarser of the two sides'
    /// formats).
    pub(crate) fn new(shape: &[usize], stored: Format, cfg: Detection) -> Detect {
        let last = shape.last().copied().unwrap_or(1).max(1);
        let row = last.min(MAX_ROW);
        let cols = if last <= MAX_ROW && shape.len() >= 2 {
            last
        } else {
            0
        };
        Detect {
            cfg,
            stored,
            row,
            cols,
            matrix: shape.len() >= 2,
            buf_r: Vec::new(),
            buf_c: Vec::new(),
            done: 0,
            n: 0,
            rr: 0.0,
            mm: 0.0,
            scale: Clustered::default(),
            bias: Clustered::default(),
            pure_rows: 0.0,
            pure_elements: 0.0,
            col_dr: vec![0.0; cols],
            col_d: vec![0.0; cols],
            col_r2: vec![0.0; cols],
            col_m2: vec![0.0; cols],
            col_q: vec![0.0; cols],
            col_n: vec![0; cols],
            rows: Vec::new(),
            row_count: 0,
            keyed: Vec::new(),
            ones_rows: 0.0,
            large_q: 0.0,
            large_n: 0.0,
            on_grid: GRIDS.map(|g| g.precision() < stored.precision()),
            grid_live: GRIDS.iter().any(|g| g.precision() < stored.precision()),
        }
    }

    /// The next pairs.
    pub(crate) fn feed(&mut self, r: &[f64], c: &[f64]) {
        if !self.cfg.enabled {
            return;
        }
        let n = r.len().min(c.len());
        let mut k = 0;
        while k < n {
            if self.buf_r.is_empty() && n - k >= self.row {
                // A whole row in the piece: no copy.
                self.row_pass(&r[k..k + self.row], &c[k..k + self.row]);
                self.done += self.row;
                k += self.row;
                continue;
            }
            let take = (self.row - self.buf_r.len()).min(n - k);
            self.buf_r.extend_from_slice(&r[k..k + take]);
            self.buf_c.extend_from_slice(&c[k..k + take]);
            k += take;
            if self.buf_r.len() == self.row {
                self.flush();
            }
        }
    }

    fn flush(&mut self) {
        if self.buf_r.is_empty() {
            return;
        }
        let (r, c) = (
            std::mem::take(&mut self.buf_r),
            std::mem::take(&mut self.buf_c),
        );
        self.row_pass(&r, &c);
        self.done += r.len();
        self.buf_r = r;
        self.buf_c = c;
        self.buf_r.clear();
        self.buf_c.clear();
    }

    fn row_pass(&mut self, r: &[f64], c: &[f64]) {
        if !self.row_pass_finite(r, c) {
            self.row_pass_plain(r, c);
        }
        // The row's keyed sums were just pushed (while the records last).
        if self.systematic() && self.keyed.len() == self.row_count {
            if let Some(k) = self.keyed.last_mut() {
                k.key = row_key(r);
            }
        }
    }

    /// The scale and bias tests can run: asked for, on a matrix with columns.
    fn systematic(&self) -> bool {
        self.cfg.systematic && self.matrix && self.cols > 0
    }

    /// [`Detect::row_pass`] on a row whose pairs are all finite: the same sums in lanes,
    /// without branches (an element that does not differ adds zeros), so that they vectorize;
    /// equal to [`Detect::row_pass_plain`] but for the order of the additions and a
    /// reciprocal for the squared terms (the row's largest excess is divided exactly, so it
    /// is the same bound). False, with nothing added, on a row with a non-finite pair.
    fn row_pass_finite(&mut self, r: &[f64], c: &[f64]) -> bool {
        let n = r.len();
        let full = self.cols > 0 && n == self.cols;
        let k = Kernel {
            min_ulp: crate::format::pow2(self.stored.emin()),
            frac: crate::format::pow2(1 - self.stored.precision() as i32),
        };
        let cols = Columns {
            dr: &mut self.col_dr,
            d: &mut self.col_d,
            r2: &mut self.col_r2,
            m2: &mut self.col_m2,
            n: &mut self.col_n,
            q: &mut self.col_q,
        };
        let Some(s) = k.dispatch(r, c, full.then_some(cols)) else {
            return false;
        };
        if self.grid_live {
            for (g, on) in GRIDS.iter().zip(self.on_grid.iter_mut()) {
                if *on
                    && (g.first_unrepresentable(r).is_some()
                        || g.first_unrepresentable(c).is_some())
                {
                    *on = false;
                }
            }
            self.grid_live = self.on_grid.iter().any(|&on| on);
        }
        self.scale.elements += s.dada;
        self.bias.elements += s.dd;
        self.large_q += s.lq;
        self.large_n += s.ln;
        self.pure_elements += s.a4;
        let rec = RowRecord {
            q: s.q,
            qmax: s.qmax,
            emax: s.emax,
            n,
            zero: s.zero,
        };
        self.end_row(
            rec,
            [
                s.x, s.y, s.rr, s.mm, s.dd, s.ms, s.dada, s.a4, s.m2d, s.m3, s.m3d,
            ],
        );
        true
    }

    /// The per-element first pass, for rows with non-finite pairs (skipped).
    fn row_pass_plain(&mut self, r: &[f64], c: &[f64]) {
        let finite = |a: f64, b: f64| a.is_finite() && b.is_finite();
        let (mut rr, mut n) = (0.0f64, 0usize);
        for (&a, &b) in r.iter().zip(c) {
            if finite(a, b) {
                rr += a * a;
                n += 1;
            }
        }
        let rms = if n > 0 { (rr / n as f64).sqrt() } else { 0.0 };
        let mut rec = RowRecord {
            n,
            zero: rms == 0.0,
            ..RowRecord::default()
        };
        let full = self.cols > 0 && r.len() == self.cols;
        let (mut x, mut y, mut mm, mut dd) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
        let [mut ms, mut dada, mut a4, mut m2d, mut m3, mut m3d] = [0.0f64; 6];
        for (j, (&a, &b)) in r.iter().zip(c).enumerate() {
            if !finite(a, b) {
                continue;
            }
            let d = b - a;
            let mid = (a + b) * 0.5;
            x += d * mid;
            y += d;
            mm += mid * mid;
            self.scale.elements += (d * mid) * (d * mid);
            self.bias.elements += d * d;
            dd += d * d;
            ms += mid;
            dada += (d * mid) * (d * mid);
            a4 += (mid * mid) * (mid * mid);
            m2d += mid * (d * mid);
            m3 += mid * (mid * mid);
            m3d += (mid * mid) * (d * mid);
            self.pure_elements += (mid * mid) * (mid * mid);
            if full {
                self.col_dr[j] += d * mid;
                self.col_d[j] += d;
                self.col_r2[j] += a * a;
                self.col_m2[j] += mid * mid;
                self.col_n[j] += 1;
            }
            if self.grid_live {
                for (g, on) in GRIDS.iter().zip(self.on_grid.iter_mut()) {
                    if *on && !(g.is_representable(a) && g.is_representable(b)) {
                        *on = false;
                    }
                }
                self.grid_live = self.on_grid.iter().any(|&on| on);
            }
            let large = !rec.zero && a.abs() >= rms;
            if large {
                self.large_n += 1.0;
            }
            if d == 0.0 {
                continue;
            }
            let allowance = self.stored.ulp(a.abs().max(b.abs())).unwrap_or(0.0);
            let s = if rec.zero { 1.0 } else { a.abs().max(rms) };
            let q = (d / s) * (d / s);
            if large {
                self.large_q += q;
            }
            if full && !rec.zero {
                self.col_q[j] += q;
            }
            rec.q += q;
            rec.qmax = rec.qmax.max(q);
            rec.emax = rec.emax.max((d.abs() - allowance).max(0.0) / s);
        }
        self.end_row(rec, [x, y, rr, mm, dd, ms, dada, a4, m2d, m3, m3d]);
    }

    /// Adds a finished row's sums: its scale and bias statistics `x`, `y`, Σr² `rr`, Σm² `mm`
    /// (m = (r + c)/2), ΣD² `dd`, and for the residual noise Σm, Σ(Dm)², Σm⁴, Σm²D, Σm³, Σm³D.
    fn end_row(
        &mut self,
        rec: RowRecord,
        [x, y, rr, mm, dd, ms, dada, a4, m2d, m3, m3d]: [f64; 11],
    ) {
        let n = rec.n;
        self.scale.sum += x;
        self.scale.rows += x * x;
        self.bias.sum += y;
        self.bias.rows += y * y;
        self.pure_rows += mm * mm;
        self.ones_rows += (n as f64) * (n as f64);
        self.rr += rr;
        self.mm += mm;
        self.n += n;
        self.row_count += 1;
        if self.systematic() && self.keyed.len() < MAX_ROW_RECORDS {
            self.keyed.push(RowSumsKeyed {
                key: 0,
                x,
                y,
                mm,
                n: n as f64,
                dd,
                ms,
                dada,
                a4,
                m2d,
                m3,
                m3d,
            });
        }
        // The sparse test's per-row records are bounded: a tensor of more rows than that (a
        // column vector of hundreds of millions of elements) has no sparse test.
        if self.rows.len() < MAX_ROW_RECORDS {
            self.rows.push(rec);
        }
    }

    /// The row terms of the cluster-robust variances, with rows equal in the reference merged
    /// into one cluster: Σ over clusters of (Σ_cluster x)², likewise y, m² and the pairs.
    fn cluster_rows(&mut self) {
        // Rows by key, equal keys in row order; the classes then in the order of their first
        // row, so that every sum runs in an order the values' magnitudes do not change.
        let mut order: Vec<u32> = (0..self.keyed.len() as u32).collect();
        order.sort_by_key(|&i| self.keyed[i as usize].key);
        let mut groups: Vec<&[u32]> = order
            .chunk_by(|&a, &b| self.keyed[a as usize].key == self.keyed[b as usize].key)
            .collect();
        groups.sort_by_key(|g| g[0]);
        let (mut x2, mut y2, mut mm2, mut n2) = (0.0, 0.0, 0.0, 0.0);
        let (mut xs, mut ys, mut mms, mut ns) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut x_noise, mut y_noise) = (Vec::new(), Vec::new());
        for group in groups {
            let sum = |f: &dyn Fn(&RowSumsKeyed) -> f64| {
                group
                    .iter()
                    .map(|&i| f(&self.keyed[i as usize]))
                    .sum::<f64>()
            };
            let (x, y, mm, n) = (sum(&|k| k.x), sum(&|k| k.y), sum(&|k| k.mm), sum(&|k| k.n));
            x2 += x * x;
            y2 += y * y;
            mm2 += mm * mm;
            n2 += n * n;
            xs.push(x);
            ys.push(y);
            mms.push(mm);
            ns.push(n);
            let (xv, yv) = group.iter().fold((0.0, 0.0), |(a, b), &i| {
                let (u, v) = self.keyed[i as usize].noise();
                (a + u, b + v)
            });
            x_noise.push(xv);
            y_noise.push(yv);
        }
        // Merging can only make the variance larger where equal rows differ alike; where
        // they do not (the candidate's equal rows differ unalike), the rows stay apart.
        self.scale.rows = x2.max(self.scale.rows);
        self.bias.rows = y2.max(self.bias.rows);
        self.pure_rows = mm2.max(self.pure_rows);
        self.ones_rows = n2.max(self.ones_rows);
        self.scale.slack = factor_slack(&xs, &mms, &x_noise);
        self.bias.slack = factor_slack(&ys, &ns, &y_noise);
    }

    /// The coarsest standard grid holding every finite value of both sides.
    fn grid(&self) -> Format {
        GRIDS
            .iter()
            .zip(self.on_grid)
            .find(|(_, on)| *on)
            .map_or(self.stored, |(g, _)| *g)
    }

    /// The findings: `again(start, end, f)` hands `f` the pairs `start..end` again — the
    /// sparse test reads back only the rows whose bound its first pass could not settle.
    /// `eps` is the unit of the estimates.
    pub(crate) fn finish(mut self, eps: f64, again: &mut ReadAgain<'_>) -> Vec<Finding> {
        if !self.cfg.enabled {
            return Vec::new();
        }
        self.flush();
        let mut out = Vec::new();
        if self.n == 0 || self.rr <= 0.0 {
            return out;
        }
        let n = self.n as f64;
        let sq = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>();
        // Every row's keyed sums are needed to merge equal rows: a tensor of more rows than
        // the records hold has no systematic test.
        if self.systematic() && self.keyed.len() == self.row_count {
            self.cluster_rows();
            let t = symmetric_critical(self.cfg.each());
            // Scale (weights m = (r + c)/2): the pure signal D = m has L = Σm², rows
            // Σ(Σ_row m²)², columns Σ(Σ_col m²)², elements Σm⁴; bias: D = 1 has rows
            // Σ(row length)², columns Σ(column length)², elements n.
            let pure = Clustered {
                sum: self.mm,
                rows: self.pure_rows,
                slack: 0.0,
                elements: self.pure_elements,
            };
            let ones = Clustered {
                sum: n,
                rows: self.ones_rows,
                slack: 0.0,
                elements: n,
            };
            let col_n: Vec<f64> = self.col_n.iter().map(|&k| k as f64).collect();
            let unit = n * (self.rr / n).sqrt();
            for (det, stat, cols, signal, signal_cols, per) in [
                (
                    Detector::Scale,
                    self.scale,
                    sq(&self.col_dr),
                    pure,
                    sq(&self.col_m2),
                    self.mm,
                ),
                (
                    Detector::Bias,
                    self.bias,
                    sq(&self.col_d),
                    ones,
                    sq(&col_n),
                    unit,
                ),
            ] {
                // Sums of squares of squares leave the f64 range for extreme magnitudes (an F64
                // tensor beyond about 1e±75, or differences far below its values): then a sum
                // is infinite or has lost its smallest terms to underflow, and the test is not
                // applicable rather than judged on a broken variance.
                let sound = |c: &Clustered, cols: f64| {
                    let v = c.variance(cols);
                    [c.sum, c.rows, c.elements, cols, v]
                        .iter()
                        .all(|x| x.is_finite())
                        && v >= MIN_SOUND_VARIANCE
                };
                if !sound(&signal, signal_cols) || !sound(&stat, cols) || !per.is_finite() {
                    continue;
                }
                if signal.sum / signal.variance(signal_cols).sqrt() <= t {
                    continue;
                }
                let est = stat.sum / per / eps;
                let th = (t * stat.variance(cols).sqrt() + stat.slack) / per / eps;
                let ratio = if est == 0.0 {
                    0.0
                } else if th > 0.0 {
                    est.abs() / th
                } else {
                    f64::INFINITY
                };
                out.push(Finding {
                    detector: det,
                    estimate: est,
                    threshold: th,
                    ratio,
                    fired: ratio > 1.0,
                    at: None,
                    count: 0,
                });
            }
        }
        if let Some(f) = self.sparse(eps, again) {
            out.push(f);
        }
        out
    }

    fn sparse(&self, eps: f64, again: &mut ReadAgain<'_>) -> Option<Finding> {
        if self.n < 3 || !self.cfg.sparse || self.row_count > self.rows.len() {
            return None;
        }
        let n = self.n as f64;
        let rms_all = (self.rr / n).sqrt();
        if !rms_all.is_finite() {
            // Σr² beyond the f64 range (an F64 tensor of values beyond about 1e154): the
            // rows' scales are infinite, and the test would see nothing. Not applicable.
            return None;
        }
        // Rows whose reference is zero measure against the tensor's root mean square.
        let scaled = |u: &RowRecord| {
            if u.zero {
                let s2 = rms_all * rms_all;
                (u.q / s2, u.qmax / s2, u.emax / rms_all)
            } else {
                (u.q, u.qmax, u.emax)
            }
        };
        let total: f64 = self.rows.iter().map(|u| scaled(u).0).sum();
        let grid = self.grid();
        let floor = grid.unit_roundoff() / 3f64.sqrt();
        let crit = sparse_critical(n, self.cfg.each());
        let pool = |sum: f64, own: f64, m: usize| {
            if m > 1 {
                ((sum - own).max(0.0) / (m as f64 - 1.0)).sqrt()
            } else {
                0.0
            }
        };
        // The scale of element i (its own term qᵢ left out of every pool; columns only in the
        // second pass, where they can only raise it).
        let sigma = |row_q: f64, qi: f64, m: usize| {
            pool(total, qi, self.n).max(pool(row_q, qi, m)).max(floor)
        };
        // Upper bounds of each row's largest z: its largest e over the smallest leave-one-out
        // scale (every term left out is at most the row's largest).
        let mut order: Vec<(f64, usize)> = self
            .rows
            .iter()
            .enumerate()
            .filter_map(|(k, u)| {
                let (q, qmax, emax) = scaled(u);
                (emax > 0.0).then(|| (emax / sigma(q, qmax, u.n), k))
            })
            .collect();
        order.sort_by(|a, b| b.0.total_cmp(&a.0));
        // (z, e, σ̂, flat index)
        let mut worst: Option<(f64, f64, f64, usize)> = None;
        let mut count = 0;
        for (ub, k) in order {
            if ub <= crit && worst.is_some_and(|w| ub <= w.0) {
                break;
            }
            let u = self.rows[k];
            let (row_q, _, _) = scaled(&u);
            let start = k * self.row;
            let len = self.row.min(self.done - start);
            let (mut r, mut c) = (Vec::with_capacity(len), Vec::with_capacity(len));
            again(start, start + len, &mut |a, b| {
                r.extend_from_slice(a);
                c.extend_from_slice(b);
            });
            let finite = |a: f64, b: f64| a.is_finite() && b.is_finite();
            let (mut rr, mut m) = (0.0f64, 0usize);
            for (&a, &b) in r.iter().zip(&c) {
                if finite(a, b) {
                    rr += a * a;
                    m += 1;
                }
            }
            let rms = if u.zero {
                rms_all
            } else {
                (rr / m.max(1) as f64).sqrt()
            };
            let full = self.cols > 0 && r.len() == self.cols;
            for (j, (&a, &b)) in r.iter().zip(&c).enumerate() {
                if !finite(a, b) || a == b {
                    continue;
                }
                let d = b - a;
                let s = a.abs().max(rms);
                // The column's magnitude too, where the row says little (a masked attention
                // row with one finite score, whose terms are the size of its column's):
                // measured against the larger scale the element is quieter, and its pool
                // (below, from the first pass's smaller scale) is not: conservative both ways.
                let wide = if full && self.col_n[j] > 0 {
                    s.max((self.col_r2[j] / self.col_n[j] as f64).sqrt())
                } else {
                    s
                };
                let allowance = grid.ulp(a.abs().max(b.abs())).unwrap_or(0.0);
                let e = (d.abs() - allowance).max(0.0) / wide;
                if e == 0.0 {
                    continue;
                }
                let qi = (d / s) * (d / s);
                let mut sg = sigma(row_q, qi, u.n);
                if full && !u.zero {
                    sg = sg.max(pool(self.col_q[j], qi, self.col_n[j]));
                }
                // An element measured against its own magnitude is compared with the others
                // that are: where a row's error is one relative factor (a softmax's
                // denominator), its small elements say little of its large ones'.
                if !u.zero && a.abs() >= rms {
                    sg = sg.max(pool(self.large_q, qi, self.large_n as usize));
                }
                let z = e / sg;
                if z > crit {
                    count += 1;
                }
                if worst.is_none_or(|w| z > w.0) {
                    worst = Some((z, e, sg, start + j));
                }
            }
        }
        Some(match worst {
            Some((z, e, sg, at)) => Finding {
                detector: Detector::Sparse,
                estimate: e / eps,
                threshold: crit * sg / eps,
                ratio: z / crit,
                fired: z > crit,
                at: Some(at),
                count,
            },
            None => Finding {
                detector: Detector::Sparse,
                estimate: 0.0,
                threshold: crit * floor / eps,
                ratio: 0.0,
                fired: false,
                at: None,
                count: 0,
            },
        })
    }
}

/// The tests on tensors in memory (`shape` gives the rows: its last dimension).
pub(crate) fn detect(
    shape: &[usize],
    r: &[f64],
    c: &[f64],
    stored: Format,
    eps: f64,
    cfg: Detection,
) -> Vec<Finding> {
    let mut d = Detect::new(shape, stored, cfg);
    d.feed(r, c);
    d.finish(eps, &mut |s, e, f| f(&r[s..e], &c[s..e]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::init::SplitMix64;
    use crate::format::Overflow;

    const EPS: f64 = 1.0 / 128.0;

    fn gaussian(n: usize, seed: u64) -> Vec<f64> {
        let mut g = SplitMix64::for_name("detect", seed);
        (0..n).map(|_| g.normal()).collect()
    }

    /// The tests on F64 tensors with the default settings.
    fn run(shape: &[usize], r: &[f64], c: &[f64]) -> Vec<Finding> {
        detect(shape, r, c, Format::F64, EPS, Detection::default())
    }

    fn get(f: &[Finding], d: Detector) -> Option<Finding> {
        f.iter().copied().find(|x| x.detector == d)
    }

    /// Null draws: element noise plus row clusters (a per-row scale, as a norm's denominator
    /// makes) plus column clusters (a per-column offset, as an attention sink makes), all with
    /// random signs. At a per-test δ of 5% the rate of firing must stay below it.
    #[test]
    fn clustered_round_off_keeps_the_false_alarm_rate() {
        let (rows, cols) = (48, 40);
        let cfg = Detection {
            delta: 0.05 / (1.0 - NORM_SHARE) * SHARED_BY,
            ..Detection::default()
        };
        assert!((cfg.each() - 0.05).abs() < 1e-12);
        let r = gaussian(rows * cols, 1);
        let t = symmetric_critical(cfg.each());
        let (mut fired_scale, mut fired_bias, mut naive) = (0, 0, 0);
        for k in 0..400 {
            let z = gaussian(rows * cols + rows + cols, 100 + k);
            let c: Vec<f64> = (0..rows * cols)
                .map(|i| {
                    let (t, j) = (i / cols, i % cols);
                    let row = 3.0 * z[rows * cols + t] * r[i];
                    let col = 2.0 * z[rows * cols + rows + j];
                    r[i] + 1e-4 * (z[i] + row + col)
                })
                .collect();
            let f = detect(&[rows, cols], &r, &c, Format::F64, EPS, cfg);
            fired_scale += get(&f, Detector::Scale).unwrap().fired as usize;
            fired_bias += get(&f, Detector::Bias).unwrap().fired as usize;
            // Every element its own cluster: Σ D / √(Σ D²).
            let (l, v) = r.iter().zip(&c).fold((0.0, 0.0), |(l, v), (a, b)| {
                (l + (b - a), v + (b - a) * (b - a))
            });
            naive += (l.abs() > t * f64::sqrt(v)) as usize;
        }
        // Binomial(400, 0.05): mean 20, 4 standard deviations above is 37.
        assert!(
            fired_scale <= 37 && fired_bias <= 37,
            "{fired_scale} {fired_bias}"
        );
        // Treating every element as its own cluster does not hold the rate on these data.
        assert!(naive > 100, "{naive}");
    }

    #[test]
    fn a_scale_error_well_below_the_norm_is_found_and_measured() {
        let (rows, cols) = (512, 256);
        let r = gaussian(rows * cols, 2);
        let noise = gaussian(rows * cols, 3);
        // Round-off of about 1 ε per element; a scale of 0.1 ε.
        let rho = 0.1 * EPS;
        let c: Vec<f64> = r
            .iter()
            .zip(&noise)
            .map(|(a, z)| a * (1.0 + rho) + EPS * z)
            .collect();
        let f = run(&[rows, cols], &r, &c);
        let s = get(&f, Detector::Scale).unwrap();
        assert!(s.fired, "{s:?}");
        assert!((s.estimate - 0.1).abs() < 0.02, "{s:?}");
        // Without the scale it stays quiet.
        let c0: Vec<f64> = r.iter().zip(&noise).map(|(a, z)| a + EPS * z).collect();
        let f = run(&[rows, cols], &r, &c0);
        assert!(f.iter().all(|x| !x.fired), "{f:?}");
    }

    /// Two runs of the same computation, each with round-off of its own (c = t + n_c,
    /// r = t + n_r, exchangeable): ⟨D, r⟩ = ⟨c, r⟩ − ‖r‖² has mean −E‖n_r‖², a scale of
    /// −(relative noise)² that √N times its noise makes visible on large noisy tensors (FP8
    /// gradients of 10⁴ elements, BF16 tensors of millions). Weighted by the midpoint
    /// m = (r + c)/2, ⟨D, m⟩ = (‖c‖² − ‖r‖²)/2 changes sign under the exchange.
    #[test]
    fn a_reference_with_round_off_of_its_own_does_not_look_like_a_scale() {
        let (rows, cols) = (256, 512);
        let t = gaussian(rows * cols, 20);
        let sigma = 12.0 * EPS; // FP8 gradients a few layers down: ~12 ε of BF16
                                // t·(1 + ρ)·(1 + σz), z standard normal per element.
        let noisy = |seed: u64, rho: f64| -> Vec<f64> {
            let z = gaussian(rows * cols, seed);
            t.iter()
                .zip(&z)
                .map(|(a, z)| a * (1.0 + rho) * (1.0 + sigma * z))
                .collect()
        };
        let mut fired = 0;
        let mut old_ratio = f64::INFINITY;
        for seed in 0..8 {
            let (r, c) = (noisy(100 + seed, 0.0), noisy(200 + seed, 0.0));
            let s = get(&run(&[rows, cols], &r, &c), Detector::Scale).unwrap();
            fired += usize::from(s.fired);
            // The reference-weighted estimate, its bias and its noise (the oracle):
            // −σ² against √(2·E r⁴/(E r²)²/N)·σ ≈ √(6/N)·σ.
            let (dr, rr): (f64, f64) = r
                .iter()
                .zip(&c)
                .fold((0.0, 0.0), |(x, y), (a, b)| (x + (b - a) * a, y + a * a));
            let noise = (6.0 / (rows * cols) as f64).sqrt() * sigma;
            old_ratio = old_ratio.min((dr / rr).abs() / (5.72 * noise));
            assert!(s.estimate.abs() < 4.0 * noise / EPS, "{s:?}");
        }
        // The reference weights would have fired on every draw.
        assert!(old_ratio > 1.5, "{old_ratio}");
        assert_eq!(fired, 0);
        // A scale of 1 ε on top (twice the threshold, 0.48 ε here) is still found.
        let (r, c) = (noisy(300, 0.0), noisy(301, EPS));
        let s = get(&run(&[rows, cols], &r, &c), Detector::Scale).unwrap();
        assert!(s.fired && (s.estimate - 1.0).abs() < 0.15, "{s:?}");
    }

    #[test]
    fn a_bias_is_found_and_a_vector_has_no_systematic_test() {
        let (rows, cols) = (256, 128);
        let r = gaussian(rows * cols, 4);
        let noise = gaussian(rows * cols, 5);
        let c: Vec<f64> = r
            .iter()
            .zip(&noise)
            .map(|(a, z)| a + EPS * (z + 0.05))
            .collect();
        let f = run(&[rows, cols], &r, &c);
        let b = get(&f, Detector::Bias).unwrap();
        assert!(b.fired && (b.estimate - 0.05).abs() < 0.01, "{b:?}");
        // One row: every element may share one cluster, so neither test applies.
        let f = run(&[rows * cols], &r, &c);
        assert!(get(&f, Detector::Scale).is_none() && get(&f, Detector::Bias).is_none());
    }

    #[test]
    fn single_corrupted_elements_are_found_where_they_are() {
        let (rows, cols) = (1024, 1024);
        let r = gaussian(rows * cols, 6);
        let noise = gaussian(rows * cols, 7);
        let mut c: Vec<f64> = r
            .iter()
            .zip(&noise)
            .map(|(a, z)| a + 0.01 * EPS * z * a.abs().max(1.0))
            .collect();
        let f = run(&[rows, cols], &r, &c);
        assert!(!get(&f, Detector::Sparse).unwrap().fired);
        // Four elements off by 8 ε of their own magnitude (magnitude ≥ 1 here).
        let hit = [5usize, 77_777, 500_000, 1_048_575];
        for &i in &hit {
            c[i] = r[i] + 8.0 * EPS * r[i].abs().max(1.0);
        }
        let f = run(&[rows, cols], &r, &c);
        let s = get(&f, Detector::Sparse).unwrap();
        assert!(s.fired && s.count == 4, "{s:?}");
        assert!(hit.contains(&s.at.unwrap()));
        // The norm would not see it: 4 elements of a million.
        let dn: f64 = r
            .iter()
            .zip(&c)
            .map(|(a, b)| (b - a) * (b - a))
            .sum::<f64>()
            .sqrt();
        let rn: f64 = r.iter().map(|a| a * a).sum::<f64>().sqrt();
        assert!(dn / rn < 0.1 * EPS);
    }

    #[test]
    fn one_rounding_flip_per_element_is_always_allowed() {
        // BF16 tensors differing by one ulp in a third of their elements, nothing else.
        let n = 64 * 64;
        let r: Vec<f64> = gaussian(n, 8)
            .iter()
            .map(|&x| Format::BF16.round(x, Overflow::NonSaturating))
            .collect();
        let c: Vec<f64> = r
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let ulp = Format::BF16.ulp(x).unwrap();
                if i % 3 == 0 {
                    Format::BF16.round(x + ulp, Overflow::NonSaturating)
                } else {
                    x
                }
            })
            .collect();
        let f = detect(&[64, 64], &r, &c, Format::BF16, EPS, Detection::default());
        let s = get(&f, Detector::Sparse).unwrap();
        assert!(!s.fired && s.estimate == 0.0, "{s:?}");
        // The same values stored in FP32 are judged on the BF16 grid they lie on.
        let f = detect(&[64, 64], &r, &c, Format::F32, EPS, Detection::default());
        assert!(!get(&f, Detector::Sparse).unwrap().fired);
    }

    #[test]
    fn pieces_and_a_second_read_give_the_same_findings() {
        let (rows, cols) = (37, 53);
        let r = gaussian(rows * cols, 9);
        let mut c: Vec<f64> = r.iter().map(|a| a * (1.0 + 1e-3)).collect();
        c[100] += 1.0;
        let whole = run(&[rows, cols], &r, &c);
        let mut d = Detect::new(&[rows, cols], Format::F64, Detection::default());
        for (a, b) in r.chunks(17).zip(c.chunks(17)) {
            d.feed(a, b);
        }
        let mut reads = 0;
        let pieces = d.finish(EPS, &mut |s, e, f| {
            reads += 1;
            f(&r[s..e], &c[s..e])
        });
        assert_eq!(whole, pieces);
        // Only the rows the first pass could not settle were read again.
        assert!(reads >= 1 && reads < rows, "{reads}");
    }

    /// Random rows with the cases the lanes must get right: lengths off the lane count, rows
    /// whose reference is zero, equal pairs, subnormal and huge values.
    fn awkward_rows(seed: u64, rows: usize, cols: usize, f: Format) -> (Vec<f64>, Vec<f64>) {
        let mut g = SplitMix64::for_name("lane-kernel", seed);
        let round = |x: f64| f.round(x, Overflow::Saturating);
        let mut r = Vec::with_capacity(rows * cols);
        let mut c = Vec::with_capacity(rows * cols);
        for i in 0..rows {
            let scale = [1.0, 1e-30, 1e30, 0.0, 2f64.powi(-140)][i % 5];
            for _ in 0..cols {
                let a = round(scale * (2.0 * g.uniform() - 1.0));
                let b = match g.below(4) {
                    0 => a,
                    1 => round(a * (1.0 + 1e-2 * (g.uniform() - 0.5))),
                    2 => round(a + scale * 1e-3 * (g.uniform() - 0.5)),
                    _ => round(a + 1e-3 * (g.uniform() - 0.5)),
                };
                r.push(a);
                c.push(b);
            }
        }
        (r, c)
    }

    /// The lane kernel (AVX2 where the CPU has it) adds what the per-element pass adds, up to
    /// the order of the additions and the reciprocal (relative 1e-12), with its row maxima
    /// upper bounds of the per-element ones; and its AVX2 and portable forms agree bit for bit.
    #[test]
    fn the_lane_kernel_matches_the_per_element_pass() {
        let close = |x: f64, y: f64, scale: f64| (x - y).abs() <= 1e-12 * scale.max(1e-300);
        for (seed, (rows, cols, f)) in [
            (8, 64, Format::F32),
            (5, 13, Format::BF16),
            (7, 3, Format::F16),
            (3, 1, Format::E4M3),
            (6, 37, Format::F64),
            (2, 1031, Format::BF16),
        ]
        .into_iter()
        .enumerate()
        {
            let (r, c) = awkward_rows(seed as u64, rows, cols, f);
            let mut fast = Detect::new(&[rows, cols], f, Detection::default());
            let mut plain = Detect::new(&[rows, cols], f, Detection::default());
            for (a, b) in r.chunks(cols).zip(c.chunks(cols)) {
                assert!(fast.row_pass_finite(a, b));
                plain.row_pass_plain(a, b);
                // Both forms of the kernel, on the same row, give the same bits.
                let k = Kernel {
                    min_ulp: crate::format::pow2(f.emin()),
                    frac: crate::format::pow2(1 - f.precision() as i32),
                };
                let bits = |s: RowSums| {
                    [
                        s.rr, s.mm, s.x, s.y, s.dada, s.dd, s.a4, s.q, s.qmax, s.emax, s.lq, s.ln,
                        s.ms, s.m2d, s.m3, s.m3d,
                    ]
                    .map(f64::to_bits)
                };
                let (x, y) = (k.dispatch(a, b, None).unwrap(), k.row(a, b, None).unwrap());
                assert_eq!(bits(x), bits(y));
            }
            fast.cluster_rows();
            plain.cluster_rows();
            let pairs = [
                (fast.scale.sum, plain.scale.sum, plain.scale.rows.sqrt()),
                (fast.scale.rows, plain.scale.rows, plain.scale.rows),
                (
                    fast.scale.elements,
                    plain.scale.elements,
                    plain.scale.elements,
                ),
                (fast.bias.sum, plain.bias.sum, plain.bias.rows.sqrt()),
                (fast.bias.rows, plain.bias.rows, plain.bias.rows),
                (fast.bias.elements, plain.bias.elements, plain.bias.elements),
                (fast.pure_rows, plain.pure_rows, plain.pure_rows),
                (fast.pure_elements, plain.pure_elements, plain.pure_elements),
                (fast.rr, plain.rr, plain.rr),
                (fast.mm, plain.mm, plain.mm),
            ];
            for (i, (x, y, scale)) in pairs.into_iter().enumerate() {
                assert!(close(x, y, scale), "{f:?} sum {i}: {x} against {y}");
            }
            assert_eq!((fast.n, fast.row_count), (plain.n, plain.row_count));
            assert_eq!(fast.large_n, plain.large_n);
            assert!(close(fast.large_q, plain.large_q, plain.large_q));
            assert_eq!(fast.col_n, plain.col_n);
            for j in 0..cols {
                for (x, y) in [
                    (fast.col_dr[j], plain.col_dr[j]),
                    (fast.col_d[j], plain.col_d[j]),
                    (fast.col_r2[j], plain.col_r2[j]),
                    (fast.col_m2[j], plain.col_m2[j]),
                    (fast.col_q[j], plain.col_q[j]),
                ] {
                    assert!(
                        close(x, y, x.abs().max(y.abs())),
                        "{f:?} column {j}: {x} against {y}"
                    );
                }
            }
            for (u, v) in fast.rows.iter().zip(&plain.rows) {
                assert_eq!((u.n, u.zero), (v.n, v.zero));
                assert!(close(u.q, v.q, v.q) && close(u.qmax, v.qmax, v.qmax));
                assert!(
                    u.emax >= v.emax && close(u.emax, v.emax, v.emax),
                    "{u:?} {v:?}"
                );
            }
            assert_eq!(fast.on_grid, plain.on_grid);
        }
    }

    /// The tests are homogeneous: scaling a pair by 2^k (exact) leaves every finding the same,
    /// bit for bit, while the sums stay in range; beyond it (an F64 tensor of values near
    /// 1e±160 or 1e±300) a test is reported not applicable, never fired on a broken sum.
    #[test]
    fn findings_do_not_depend_on_magnitude_and_extremes_never_fire() {
        let (rows, cols) = (128, 96);
        let r = gaussian(rows * cols, 21);
        let z = gaussian(rows * cols, 22);
        // Round-off-like noise, and a real scale on top of it.
        let noise: Vec<f64> = r.iter().zip(&z).map(|(a, w)| a + 1e-12 * w).collect();
        let scaled: Vec<f64> = noise.iter().map(|b| b * (1.0 + 1e-9)).collect();
        for (c, fires) in [(&noise, false), (&scaled, true)] {
            let base = run(&[rows, cols], &r, c);
            assert_eq!(base.iter().any(|f| f.fired), fires, "{base:?}");
            for k in [-300, -150, -60, 60, 150, 300] {
                let m = 2f64.powi(k);
                let rk: Vec<f64> = r.iter().map(|a| a * m).collect();
                let ck: Vec<f64> = c.iter().map(|b| b * m).collect();
                let got = run(&[rows, cols], &rk, &ck);
                if k.abs() <= 60 {
                    assert_eq!(got, base, "2^{k}");
                } else {
                    for f in &got {
                        let same = base.iter().find(|g| g.detector == f.detector);
                        assert!(
                            !f.fired || same.is_some_and(|g| g.fired),
                            "2^{k}: {f:?} fired where the unscaled pair gives {same:?}"
                        );
                    }
                }
            }
        }
    }

    /// A row with a non-finite pair leaves the lanes with nothing added and goes the
    /// per-element way, which skips the pair.
    #[test]
    fn a_non_finite_pair_sends_its_row_the_per_element_way() {
        let mut d = Detect::new(&[2, 5], Format::F64, Detection::default());
        let r = [1.0, 2.0, f64::NAN, 4.0, 5.0];
        let c = [1.0, 2.5, 3.0, f64::INFINITY, 5.0];
        assert!(!d.row_pass_finite(&r, &c));
        assert_eq!((d.row_count, d.n, d.col_n.iter().sum::<usize>()), (0, 0, 0));
        d.row_pass(&r, &c);
        assert_eq!((d.row_count, d.n), (1, 3));
        assert_eq!(d.col_n, vec![1, 1, 0, 0, 1]);
        assert_eq!(d.bias.sum, 0.5);
    }

    /// The real-engine matrix's case: a BF16 output scaled by 1 + 10⁻³ (0.13 ε) before its
    /// rounding. With 32 tokens no systematic test applies (a pure signal cannot reach the
    /// critical value against 32 row clusters); with 128 the scale test finds it, and nothing
    /// fires without it.
    #[test]
    fn a_scale_below_one_rounding_needs_enough_tokens() {
        let bf = |x: f64| Format::BF16.round(x, Overflow::NonSaturating);
        let r = gaussian(32 * 256, 11);
        let r: Vec<f64> = r.iter().map(|&x| bf(x)).collect();
        let c: Vec<f64> = gaussian(32 * 256, 11)
            .iter()
            .map(|&x| bf(x * (1.0 + 1e-3)))
            .collect();
        let f = detect(&[32, 256], &r, &c, Format::BF16, EPS, Detection::default());
        assert!(get(&f, Detector::Scale).is_none(), "{f:?}");
        let (rows, cols) = (128, 256);
        let y = gaussian(rows * cols, 11);
        let wiggle = gaussian(rows * cols, 12);
        let bf = |x: f64| Format::BF16.round(x, Overflow::NonSaturating);
        // Round-off of the accumulations: 10⁻³ ulp-sized differences before the rounding.
        let r: Vec<f64> = y.iter().map(|&x| bf(x)).collect();
        let pre: Vec<f64> = y
            .iter()
            .zip(&wiggle)
            .map(|(x, w)| x + 1e-3 * EPS * w * x.abs())
            .collect();
        let clean: Vec<f64> = pre.iter().map(|&x| bf(x)).collect();
        let scaled: Vec<f64> = pre.iter().map(|&x| bf(x * (1.0 + 1e-3))).collect();
        let d = Detection::default();
        let f = detect(&[rows, cols], &r, &scaled, Format::BF16, EPS, d);
        let s = get(&f, Detector::Scale).unwrap();
        assert!(s.fired, "{s:?}");
        assert!((s.estimate - 0.128).abs() < 0.05, "{s:?}");
        let f = detect(&[rows, cols], &r, &clean, Format::BF16, EPS, d);
        assert!(f.iter().all(|x| !x.fired), "{f:?}");
    }

    #[test]
    fn a_column_vector_of_too_many_rows_has_no_sparse_test_and_bounded_records() {
        let n = MAX_ROW_RECORDS + 1;
        let r = vec![1.0; n];
        let mut c = r.clone();
        c[7] = 2.0;
        let mut d = Detect::new(&[n, 1], Format::F64, Detection::default());
        d.feed(&r, &c);
        assert_eq!(d.rows.len(), MAX_ROW_RECORDS);
        let f = d.finish(EPS, &mut |s, e, f| f(&r[s..e], &c[s..e]));
        assert!(get(&f, Detector::Sparse).is_none(), "{f:?}");
    }

    #[test]
    fn critical_values() {
        // The Gaussian comparison at δ = 2c*·P(η ≥ 6), P(η ≥ 6) = 9.865876450377e-10
        // (tabulated), is 6; at δ = 0.5, 2c*·P(η ≥ √2) = 1/2 gives √2 (Hoeffding's would be
        // √(2 ln 4) = 1.67).
        let c = 1.0 / (4.0 * 0.078_649_603_525_142_2);
        let at6 = symmetric_critical(2.0 * c * 9.865_876_450_377e-10);
        assert!((at6 - 6.0).abs() < 1e-9, "{at6}");
        assert!((symmetric_critical(0.5) - std::f64::consts::SQRT_2).abs() < 1e-9);
        // At the tests' δ/30: 5.72, below Hoeffding's 5.98.
        let t = symmetric_critical(1e-6 * 0.1 / 3.0);
        assert!(t > 5.70 && t < 5.74, "{t}");
        // Laplace of unit variance: P(|X| > x) = exp(−√2 x).
        let x = sparse_critical(10.0, 1e-3);
        assert!(((-std::f64::consts::SQRT_2 * x).exp() * 10.0 - 1e-3).abs() < 1e-15);
    }
}

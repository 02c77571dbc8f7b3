//! The guaranteed threshold of a product at the cost of the product: two GEMMs, not a visit to
//! every rounding.
//!
//! # Model (papers/bounds-reductions.md §5.1)
//! The guaranteed bound the walk and the pass give an output of C = A·B is linear in its
//! terms' magnitudes: Σₚ |aᵢₚ||bₚⱼ|·wₚ + c, with wₚ the two sides' Higham weights of term p
//! (depths, growth factor) and c their underflow constants
//! ([`dot_guaranteed_weights`](crate::bounds::reduction::dot_guaranteed_weights)). Over every
//! output that is one product, (|A|·diag(w))·|B|, computed here by an `f32` GEMM
//! (`matrixmultiply::sgemm`), with its own rounding bounded whatever order it sums in
//! (Higham 2002, §3.1, for sums of nonnegative terms; u = 2⁻²⁴):
//! * |a|·wₚ is rounded to `f32` once, through `f64`: it is at most (â + 2⁻¹⁵⁰)(1 + 2⁻²³) for
//!   the stored â (2⁻¹⁵⁰: half the subnormal spacing, should it underflow), so a term is at
//!   most â|b|(1 + 2⁻²³) + 2⁻¹⁴⁹|b| (B's values are FP32 values: exact);
//! * each of the k nonnegative terms passes through at most k + 1 roundings (its product, the
//!   additions within the kernel's block, the additions of the blocks into C), each keeping at
//!   least (1 − u) of a normal value and losing at most 2⁻¹⁵⁰ of a subnormal one, 2k + 1
//!   roundings in all: Σ ≤ (Ĝ + (k + 1)·2⁻¹⁴⁹)/(1 − u)^(k+1).
//!
//! The output roundings need each output's magnitude, and the relative threshold the
//! reference's norm: A·B by a second `f32` GEMM of the operands as they are (exact in `f32`),
//! within γ_{k+1}·Σ|a||b| + (2k + 1)·2⁻¹⁵⁰ of the exact value, Σ|a||b| bounded by the smaller
//! of max|aᵢ|·Σ|b·ⱼ| and Σ|aᵢ|·max|b·ⱼ|. The rest is the pass's own: the bias or the mean's
//! division, the overflow check of the output, its rounding, the tensor's Frobenius norm and
//! largest element. The threshold is the pass's guaranteed threshold up to these margins:
//! within 10⁻⁴ of the walk's, never below it (`tests/fast_pricing.rs`).

use super::{prepared_for, Epilogue, FastSide, Right};
use crate::bounds::compare::{Confidence, Threshold, ThresholdSums};
use crate::bounds::ops::output::GuaranteedRounding;
use crate::bounds::reduction::overflow_threshold;
use crate::error::Result;
use crate::format::Format;

/// Rows of A per part of the tensor's sums (a fixed number, so that the threshold does not
/// depend on the number of threads).
const PART: usize = 64;
/// Lanes of the per-row loop's sums.
const L: usize = 8;

/// What every output's bound is computed from (see [`guaranteed_threshold`]).
struct Consts {
    /// Σ|a|w|b| ≤ Ĝ·lift + col_floor[j] (with the constants c).
    lift: f64,
    col_floor: Vec<f64>,
    /// B's columns' summed and largest magnitudes.
    col_sum: Vec<f64>,
    col_max: Vec<f64>,
    /// The bias per column (zeros), and the mean's 1/k (1).
    bias: Vec<f64>,
    inv: f64,
    /// The value's error: γ_{k+1}·Σ|a||b| + value_floor, and 2⁻⁵¹ of the result.
    gamma: f64,
    value_floor: f64,
    f64_step: f64,
    /// The trailing roundings (bias or mean in the accumulator; the output).
    first: GuaranteedRounding,
    last: GuaranteedRounding,
}

/// A row of A's or a column of B's largest magnitude and the sum of its magnitudes.
struct Line {
    max: f64,
    sum: f64,
}

/// The guaranteed threshold for C = A·B (+ bias, or / k for a mean) with the same operands on
/// both sides, or `None` where the fast path does not apply (the pass's scope: FP32
/// accumulation with every rounding in FP32, exact products of FP32 values or narrower,
/// orders the lane kernel executes), a value is not finite, or a partial sum or an output
/// could come near overflow: the caller decides there.
pub(crate) fn guaranteed_threshold(
    a: &[f64],
    b: Right,
    epilogue: Epilogue,
    (m, k, n): (usize, usize, usize),
    r: FastSide,
    c: FastSide,
) -> Result<Option<Threshold>> {
    let Some(prepared) = prepared_for((m, k, n), (r.acc, c.acc))? else {
        return Ok(None);
    };
    let w = &prepared.weights;
    let (cr, cc) = prepared.constants;
    // A's rows: the values, |a|·w, and each row's largest and summed magnitude.
    let a32: Vec<f32> = a[..m * k].iter().map(|&x| x as f32).collect();
    let mut aw = Vec::with_capacity(m * k);
    let mut rows = Vec::with_capacity(m);
    for row in a[..m * k].chunks_exact(k) {
        aw.extend(row.iter().zip(w).map(|(&x, &wp)| (x.abs() * wp) as f32));
        rows.push(Line::of(row));
    }
    // B's columns: the values and magnitudes in B's storage order, each column's largest and
    // summed magnitude.
    let (b32, babs, cols, (rsb, csb)) = columns(b, k, n);
    // Finite values whose products, and every partial sum (at most Σ|a||b| ≤ k·max|a|·max|b|),
    // stay far from FP32's overflow; else the caller decides.
    // (A sum of magnitudes is finite only when every value is.)
    let finite = |lines: &[Line]| lines.iter().all(|l| l.sum.is_finite());
    let largest = |lines: &[Line]| lines.iter().fold(0.0f64, |x, l| x.max(l.max));
    let (amax, bmax) = (largest(&rows), largest(&cols));
    if !(finite(&rows) && finite(&cols)) || (k as f64) * amax * bmax >= 2f64.powi(120) {
        return Ok(None);
    }
    let u = 2f64.powi(-24);
    // Per output: Σ|a|w|b| ≤ the GEMM's Ĝ·`lift` + `floor` + `b_floor`·max|b|, with
    // (1 − u)^-(k+1) (with room for its own evaluation) and the roundings' underflow
    // (k + 1)·2⁻¹⁴⁹, and the terms' own (1 + 2⁻²³) and underflow.
    let inflate = (-((k + 1) as f64) * (-u).ln_1p()).exp() * (1.0 + 1e-9);
    let lift = (1.0 + 2f64.powi(-23)) * inflate;
    let floor = (k + 1) as f64 * 2f64.powi(-149) * lift + cr + cc;
    // (2⁻¹⁵⁰·(1 + 2⁻²³) ≤ 2⁻¹⁴⁹ of each |b|.)
    let b_floor = k as f64 * 2f64.powi(-149);
    let (ar, ac) = (r.policy.accumulator(), c.policy.accumulator());
    let outputs = (r.policy.output, c.policy.output);
    let reduced = (r.acc.order.result_format(ar), c.acc.order.result_format(ac));
    // The bias added, or the mean divided, in the accumulator; then the output rounding.
    let (first, cur) = if matches!(epilogue, Epilogue::Bias(None)) {
        (GuaranteedRounding::None, reduced)
    } else {
        (
            GuaranteedRounding::new((Format::F64, Format::F64), (ar, ac)),
            (ar, ac),
        )
    };
    let last = GuaranteedRounding::new(cur, outputs);
    let limit = overflow_threshold(outputs.0).min(overflow_threshold(outputs.1));
    // The value's error: γ_{k+1} = (k + 1)u/(1 − (k + 1)u) with room for its evaluation (it
    // was (k + 1)u·(1 + 10⁻⁵), below γ_{k+1} from k = 167), its underflow (2k + 1 roundings
    // of at most 2⁻¹⁵⁰ each), and the bias's addition or the division in f64 (2⁻⁵¹ of the
    // result). Products too long for FP32 (k ≥ 2²³) go to the walk.
    let nu = (k + 1) as f64 * u;
    if nu >= 0.5 {
        return Ok(None);
    }
    let gamma = nu / (1.0 - nu) * (1.0 + 1e-9);
    let value_floor = (2 * k + 1) as f64 * 2f64.powi(-150);
    let f64_step = 2f64.powi(-51);
    let (bias, inv) = match epilogue {
        Epilogue::Bias(bias) => (bias, 1.0),
        Epilogue::Mean(inv) => (None, inv),
    };
    if !bias.is_none_or(|b| b[..n].iter().all(|x| x.is_finite())) {
        return Ok(None);
    }
    let consts = Consts {
        lift,
        col_floor: cols.iter().map(|c| b_floor * c.max + floor).collect(),
        col_sum: cols.iter().map(|c| c.sum).collect(),
        col_max: cols.iter().map(|c| c.max).collect(),
        bias: bias.map_or_else(|| vec![0.0; n], |b| b[..n].to_vec()),
        inv,
        gamma,
        value_floor,
        f64_step,
        first,
        last,
    };
    let rounds = !matches!(
        (first, last),
        (GuaranteedRounding::None, GuaranteedRounding::None)
    );
    // Each thread's rows by two GEMMs (an output's sums do not depend on which rows share
    // its GEMM), the tensor's sums gathered in parts of `PART` rows (a fixed partition, so
    // that the threshold does not depend on the number of threads).
    let parts_total = m.div_ceil(PART);
    let per_chunk = parts_total.div_ceil(crate::parallel::threads()).max(1);
    let chunks: Vec<usize> = (0..parts_total.div_ceil(per_chunk)).collect();
    let priced = crate::parallel::map(&chunks, |&chunk| {
        let i0 = chunk * per_chunk * PART;
        let count = (per_chunk * PART).min(m - i0);
        let mut g = vec![0.0f32; count * n];
        let mut v = vec![0.0f32; count * n];
        for (x, y, out) in [(&aw, &babs, &mut g), (&a32, &b32, &mut v)] {
            // SAFETY: rows i0..i0 + count of `x` ([m, k], row-major), `y` ([k, n] with strides
            // (rsb, csb), k·n values) and `out` ([count, n], row-major) lie inside their slices.
            unsafe {
                matrixmultiply::sgemm(
                    count,
                    k,
                    n,
                    1.0,
                    x[i0 * k..].as_ptr(),
                    k as isize,
                    1,
                    y.as_ptr(),
                    rsb,
                    csb,
                    0.0,
                    out.as_mut_ptr(),
                    n as isize,
                    1,
                );
            }
        }
        let mut parts = vec![];
        for p0 in (0..count).step_by(PART) {
            let mut lanes = [[0.0f64; L]; 4];
            for r_ in p0..(p0 + PART).min(count) {
                let o = r_ * n;
                row(
                    &consts,
                    rounds,
                    &rows[i0 + r_],
                    (&g[o..o + n], &v[o..o + n]),
                    &mut lanes,
                );
            }
            // `check_output`, its limit computed once: the walk decides beyond it.
            if lanes[3].iter().any(|&reach| reach >= limit) {
                return None;
            }
            let mut sums = ThresholdSums::new(Confidence::Guaranteed, m * n);
            let g_max = lanes[1].iter().fold(0.0f64, |a, &b| a.max(b));
            sums.add_guaranteed(lanes[0].iter().sum(), g_max);
            parts.push((sums, lanes[2].iter().sum::<f64>()));
        }
        Some(parts)
    });
    let mut total = ThresholdSums::new(Confidence::Guaranteed, m * n);
    let mut norm_sq = 0.0;
    for chunk in priced {
        let Some(parts) = chunk else {
            return Ok(None);
        };
        for (sums, sq) in parts {
            total.merge(&sums);
            norm_sq += sq;
        }
    }
    Ok(Some(total.threshold(norm_sq.sqrt())))
}

/// B's values and magnitudes in `f32` in its storage order, each column's largest and summed
/// magnitude, and the strides (rows, columns) of B [k, n] in that order.
#[allow(clippy::type_complexity)]
fn columns(b: Right, k: usize, n: usize) -> (Vec<f32>, Vec<f32>, Vec<Line>, (isize, isize)) {
    let x = match b {
        Right::Rows(x) | Right::Columns(x) => &x[..k * n],
    };
    let b32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let babs: Vec<f32> = x.iter().map(|&v| v.abs() as f32).collect();
    match b {
        Right::Columns(_) => (
            b32,
            babs,
            x.chunks_exact(k).map(Line::of).collect(),
            (1, k as isize),
        ),
        Right::Rows(_) => {
            let (mut max, mut sum) = (vec![0.0f64; n], vec![0.0f64; n]);
            for row in x.chunks_exact(n) {
                for ((&v, mx), s) in row.iter().zip(max.iter_mut()).zip(sum.iter_mut()) {
                    *mx = mx.max(v.abs());
                    *s += v.abs();
                }
            }
            let cols = max
                .into_iter()
                .zip(sum)
                .map(|(max, sum)| Line { max, sum })
                .collect();
            (b32, babs, cols, (n as isize, 1))
        }
    }
}

impl Line {
    /// The largest and summed magnitude of `values` (the sum not finite where a value is
    /// not), in eight lanes.
    fn of(values: &[f64]) -> Line {
        const L: usize = 8;
        let (mut max, mut sum) = ([0.0f64; L], [0.0f64; L]);
        let chunks = values.chunks_exact(L);
        let tail = chunks.remainder();
        for chunk in chunks {
            for l in 0..L {
                max[l] = max[l].max(chunk[l].abs());
                sum[l] += chunk[l].abs();
            }
        }
        for (l, &v) in tail.iter().enumerate() {
            max[l] = max[l].max(v.abs());
            sum[l] += v.abs();
        }
        Line {
            max: max.iter().fold(0.0, |a, &b| b.max(a)),
            sum: sum.iter().sum(),
        }
    }
}

/// Per lane: Σ g², max g, Σ v², and the largest reach (value plus bound) of a row's outputs.
type Lanes = [[f64; L]; 4];

/// One row's outputs gathered into `sums` from the two GEMMs' results (`g`, `v`), with
/// `ra` the row's magnitudes; `rounds`: whether the trailing roundings add anything. In AVX2
/// where the CPU has it (the same operations, in lanes).
fn row(x: &Consts, rounds: bool, ra: &Line, (g, v): (&[f32], &[f32]), sums: &mut Lanes) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::arch::has(crate::arch::Isa::Avx2Fma) {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2(x: &Consts, r: bool, ra: &Line, gv: (&[f32], &[f32]), s: &mut Lanes) {
                row_lanes(x, r, ra, gv, s)
            }
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            return unsafe { avx2(x, rounds, ra, (g, v), sums) };
        }
    }
    row_lanes(x, rounds, ra, (g, v), sums)
}

#[inline(always)]
fn row_lanes(x: &Consts, rounds: bool, ra: &Line, (g, v): (&[f32], &[f32]), sums: &mut Lanes) {
    let n = g.len().min(v.len());
    let full = n - n % L;
    if !rounds {
        for j0 in (0..full).step_by(L) {
            for l in 0..L {
                let j = j0 + l;
                gather(sums, l, one::<false>(x, (ra, j), g[j], v[j]));
            }
        }
    }
    let from = if rounds { 0 } else { full };
    for j in from..n {
        let o = if rounds {
            one::<true>(x, (ra, j), g[j], v[j])
        } else {
            one::<false>(x, (ra, j), g[j], v[j])
        };
        gather(sums, j % L, o);
    }
}

/// One output's (bound, value, reach) into lane `l`.
#[inline(always)]
fn gather(sums: &mut Lanes, l: usize, (g, value, reach): (f64, f64, f64)) {
    sums[0][l] += g * g;
    sums[1][l] = if g > sums[1][l] { g } else { sums[1][l] };
    sums[2][l] += value * value;
    sums[3][l] = if reach > sums[3][l] {
        reach
    } else {
        sums[3][l]
    };
}

/// One output from the two GEMMs' results: its guaranteed bound, its value, and how far the
/// value may reach (`check_output` holds it against the output formats' overflow; every input
/// is finite, so it is a number). `ROUNDS`: whether the trailing roundings add anything.
#[inline(always)]
fn one<const ROUNDS: bool>(x: &Consts, (ra, j): (&Line, usize), g: f32, v: f32) -> (f64, f64, f64) {
    let guaranteed = g as f64 * x.lift + x.col_floor[j];
    let magnitudes = (ra.max * x.col_sum[j]).min(ra.sum * x.col_max[j]);
    let value = (v as f64 + x.bias[j]) * x.inv;
    let v_err = (x.gamma * magnitudes + x.value_floor) * x.inv + value.abs() * x.f64_step;
    let g = guaranteed * x.inv;
    // |exact − either side's value| ≤ its error + |exact − value|.
    let magnitude = value.abs() + g + v_err;
    let g = if ROUNDS {
        x.first.apply(g, magnitude)
    } else {
        g
    };
    let reach = magnitude + g;
    let g = if ROUNDS {
        x.last.apply(g, magnitude)
    } else {
        g
    };
    (g, value, reach)
}

#[cfg(test)]
mod tests {
    use crate::bounds::compare::{Confidence, Threshold};
    use crate::bounds::ops::{matmul_threshold_priced, sum_threshold_priced, Pricing};
    use crate::engine::SplitMix64;
    use crate::format::{Format, Overflow};
    use crate::order::{Combine, Order};
    use crate::policy::Policy;
    use crate::tensor::Tensor;

    /// `n` values of `format`: Gaussian times `scale`, with a non-zero `mean`.
    fn data(shape: &[usize], seed: u64, (scale, mean): (f64, f64), format: Format) -> Tensor {
        let mut g = SplitMix64::for_name("guaranteed", seed);
        let n: usize = shape.iter().product();
        let v = (0..n).map(|_| (mean + g.normal()) * scale).collect();
        Tensor::rounded(shape, v, format, Overflow::Saturating).unwrap()
    }

    fn orders() -> Vec<Order> {
        vec![
            Order::blocked(16),
            Order::pairwise(8),
            Order::split_k(8, Format::F32, Combine::Tree),
            Order::split_k(3, Format::F32, Combine::Sequential),
            Order::split_k(4, Format::F32, Combine::Ring { start: 1 }),
        ]
    }

    /// The GEMM-priced bound (what `Pricing::Auto` gives a guaranteed request) against the
    /// walk's: never below it, within `tight` above it (`None`: no closer than never below),
    /// and the engine's two executions within it.
    fn against_the_walk(
        (a, b, bias): (&Tensor, &Tensor, Option<&Tensor>),
        (r, c): (&Policy, &Policy),
        tight: Option<f64>,
    ) -> Threshold {
        let g = Confidence::Guaranteed;
        let gemm = matmul_threshold_priced(a, b, bias, r, c, g, Pricing::Auto).unwrap();
        let walk = matmul_threshold_priced(a, b, bias, r, c, g, Pricing::Walk).unwrap();
        assert_eq!(gemm.confidence, Confidence::Guaranteed);
        for (x, y, what) in [
            (gemm.abs_frobenius, walk.abs_frobenius, "norm"),
            (gemm.per_element, walk.per_element, "element"),
        ] {
            assert!(x >= y, "{what}: {x:e} below the walk's {y:e} ({r} vs {c})");
            if let Some(t) = tight {
                assert!(
                    x <= y * (1.0 + t),
                    "{what}: {x:e} vs the walk's {y:e} ({r} vs {c})"
                );
            }
        }
        // With a bias: nn.Linear's y = x·Wᵀ + b, W = Bᵀ.
        let (k, n) = (b.shape()[0], b.shape()[1]);
        let w: Vec<f64> = (0..n * k)
            .map(|i| b.values()[(i % k) * n + i / k])
            .collect();
        let w = Tensor::from_vec(&[n, k], w, b.format()).unwrap();
        let run = |p: &Policy| match bias {
            Some(bias) => crate::engine::linear(a, &w, Some(bias), p).unwrap(),
            None => crate::engine::matmul(a, b, p).unwrap(),
        };
        assert!(gemm.check(&run(r), &run(c)).passed, "{r} vs {c}");
        gemm
    }

    /// On every order the pass executes, with and without a bias, outputs in FP32, BF16 and
    /// FP16, and inputs in BF16, FP16 and FP32: the walk's bound within 10⁻⁴ (10⁻³ with narrow
    /// outputs), never below it, and no expected difference claimed (the model is not run).
    #[test]
    fn the_gemm_bound_is_the_walks() {
        for (input, out) in [
            (Format::BF16, Format::F32),
            (Format::BF16, Format::BF16),
            (Format::F16, Format::F16),
            (Format::F32, Format::F32),
        ] {
            let a = data(&[6, 300], 1, (1.0, 0.0), input);
            let b = data(&[300, 20], 2, (0.5, 0.3), input);
            let bias = data(&[20], 3, (4.0, 0.0), input);
            let r = Policy::new(input, Format::F32, out);
            for order in orders() {
                let c = r.clone().with_order(order);
                for bias in [None, Some(&bias)] {
                    // A narrow output's rounding is priced at the value plus its bound (the
                    // walk: at the exact value), a spacing up where that crosses a binade.
                    let tight = if out == Format::F32 { 1e-4 } else { 1e-3 };
                    let t = against_the_walk((&a, &b, bias), (&r, &c), Some(tight));
                    assert!(t.expected_relative.is_nan());
                }
            }
        }
    }

    /// At the edges of the range: products below FP32's normal range (the GEMM's products
    /// underflow), rows mixing magnitudes 2⁸⁰ apart, zero rows and columns, and products near
    /// FP32's overflow (the GEMM path declines them): never below the walk.
    #[test]
    fn the_gemm_bound_holds_at_the_edges_of_the_range() {
        let r = Policy::new(Format::BF16, Format::F32, Format::F32);
        let c = r
            .clone()
            .with_order(Order::split_k(4, Format::F32, Combine::Tree));
        let scaled = |t: &Tensor, f: &dyn Fn(usize, f64) -> f64| {
            let v = t
                .values()
                .iter()
                .enumerate()
                .map(|(i, &x)| f(i, x))
                .collect();
            Tensor::rounded(t.shape(), v, Format::BF16, Overflow::Saturating).unwrap()
        };
        let a = data(&[5, 64], 11, (1.0, 0.0), Format::BF16);
        let b = data(&[64, 9], 12, (1.0, 0.0), Format::BF16);
        let tiny = |i: usize, x: f64| x * 2f64.powi(-70 - (i % 7) as i32);
        let mixed = |i: usize, x: f64| {
            if i % 5 == 0 {
                x * 2f64.powi(40)
            } else {
                x * 2f64.powi(-40)
            }
        };
        let zero_lines = |i: usize, x: f64| if i % 64 < 3 || i % 9 == 4 { 0.0 } else { x };
        let huge = |_: usize, x: f64| x * 2f64.powi(60);
        for (fa, fb) in [
            (
                &tiny as &dyn Fn(usize, f64) -> f64,
                &tiny as &dyn Fn(usize, f64) -> f64,
            ),
            (&mixed, &mixed),
            (&zero_lines, &zero_lines),
            (&huge, &huge),
        ] {
            let (a, b) = (scaled(&a, fa), scaled(&b, fb));
            against_the_walk((&a, &b, None), (&r, &c), None);
        }
    }

    /// Sums and means (ones · xᵀ on the same path): the walk's bound within 10⁻⁴, never below.
    #[test]
    fn gemm_priced_sums_and_means_are_the_walks() {
        let x = data(&[12, 500], 21, (1.0, 0.5), Format::BF16);
        let r = Policy::new(Format::BF16, Format::F32, Format::BF16);
        let g = Confidence::Guaranteed;
        for order in orders() {
            let c = r.clone().with_order(order);
            for mean in [false, true] {
                let gemm = sum_threshold_priced(&x, &r, &c, mean, g, Pricing::Auto).unwrap();
                let walk = sum_threshold_priced(&x, &r, &c, mean, g, Pricing::Walk).unwrap();
                let ratio = gemm.abs_frobenius / walk.abs_frobenius;
                assert!(
                    (1.0..1.0 + 1e-4).contains(&ratio),
                    "{c} mean {mean}: {ratio}"
                );
                let ratio = gemm.per_element / walk.per_element;
                assert!(
                    (1.0..1.0 + 1e-4).contains(&ratio),
                    "{c} mean {mean}: {ratio}"
                );
            }
        }
    }
}

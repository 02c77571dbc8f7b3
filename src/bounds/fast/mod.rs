//! Matmul thresholds priced at the speed of a product: the all-random rounding model's
//! statistics gathered in one vectorized pass per side, kept only where the data show no
//! structure that the determined-rounding walk would price differently.
//!
//! # Model (papers/bounds-reductions.md §2 and §5.1)
//! * **Guaranteed**: the walk's own bound, Σₚ |aᵢₚ||bₚⱼ|·(w_ref,p + w_cand,p) + c
//!   ([`dot_guaranteed_weights`](crate::bounds::reduction::dot_guaranteed_weights): Higham's depths, growth factor and underflow terms),
//!   summed in `f32` over scaled values and inflated by the sum's own rounding error
//!   ((1 + 2⁻²⁴)^(k+2)) and its underflow (2⁻¹⁴⁹ per term). A guaranteed threshold alone
//!   needs nothing else: it is priced by two GEMMs ([`guaranteed`]), without the pass.
//! * **Probabilistic**: the walk's split, on the values the two declared executions actually
//!   compute ([`kernel`]). The roundings the walk determines are determined here too, their
//!   errors summed exactly into the offset (for products exact in `f32`: inputs of at most 12
//!   significant bits, or A all zeros and powers of two, as a sum's ones): those of exact operands (every rounding behind them exact); a product
//!   added to a running value that lies on the result's grid (known from the grids the model
//!   tracks: a product's lowest bit, a rounded value's spacing, an exact sum's common grid),
//!   which errs by RN_U(t) − t whatever that value is, ties included when the value's parity
//!   is known; a running value on half the grid with its bit there known. Every other
//!   rounding — a tie on an unknown parity, two computed values added, a sum entering a
//!   coarser binade from an unknown position — is independent, zero-mean, uniform on the grid
//!   points within half a spacing: E(η²) = U²/12 + g²/6 with g the operands' common grid,
//!   U²/4 for a tie, 0 when g ≥ U. The prefix of roundings both orders perform alike (the
//!   same operations on identically computed values) makes the same errors on both sides and
//!   is left out. The walk's interval carried by monotone rounding is not carried here: where
//!   it determines more (a stall after a binade crossing), D is systematic and the structure
//!   test below sends the data to the walk.
//! * Identical rows of A and identical columns of B give identical differences: each pair of
//!   classes is one component √c·D (as the walk prices them).
//! * **Structure test** (what decides between this and the walk): the two executions are run
//!   (the kernel computes them, bit for bit the engine's), and their difference D must look
//!   like a draw of the model: every |Dᵢ| ≤ √(2hᵢ·ln(2N/δ_s)) and ‖D‖² within the
//!   Hsu–Kakade–Zhang bound of Σhᵢ at δ_s = 10⁻³ (D less the determined offset). Systematic
//!   errors among the random ones — ties on parities the model does not follow, sums that
//!   keep entering coarser binades alike — make D grow with the number of roundings rather
//!   than with its square root and fail the test; the tensor then goes to the walk, which tracks them. On data
//!   without structure the test passes with probability at least 1 − 2δ_s.
//!
//! Scope: equal operands on both sides (no FP8 rescale), exact products (fused multiply-adds) of
//! FP32 values or narrower, FP32 accumulation with every rounding in FP32, and orders made of
//! sequential runs and additions (sequential, blocked, pairwise, split-K with FP32 partials).
//! Everything else, and any non-finite or out-of-range value, stays on the walk.

mod guaranteed;
mod kernel;
mod pack;
mod prepared;
mod program;

use crate::bounds::compare::{row_classes, Confidence, ElementDiff, Threshold, ThresholdSums};
use crate::bounds::ops::output::{check_output, round_sides};
use crate::bounds::reduction::ReductionError;
use crate::error::Result;
use crate::format::Format;
use crate::order::{Accumulation, Products};
use crate::policy::Policy;
use kernel::{Determine, OUT, W};
use pack::pack;
use prepared::prepared;
#[cfg(test)]
use program::program;

/// The failure probability of the structure test.
const STRUCTURE_DELTA: f64 = 1e-3;

/// One side of a matmul as the fast path needs it.
#[derive(Clone, Copy)]
pub(crate) struct FastSide<'a> {
    /// The accumulation (its input format: the operands' common format).
    pub acc: &'a Accumulation,
    /// The side's policy (accumulator and output formats).
    pub policy: &'a Policy,
}

/// The right operand B [k, n] of a product, as it is stored.
#[derive(Clone, Copy)]
pub(crate) enum Right<'a> {
    /// Row-major [k, n].
    Rows(&'a [f64]),
    /// Its transpose, row-major [n, k]: `nn.Linear`'s weight, or the rows of a tensor whose
    /// sums are priced (a sum over the last dimension is ones(1 × k) times the tensor's
    /// transpose).
    Columns(&'a [f64]),
}

impl<'a> Right<'a> {
    /// B's column j, as `k` values from `p = 0`.
    fn column(self, j: usize, k: usize, n: usize) -> impl Iterator<Item = f64> + Clone + 'a {
        let (data, start, stride) = match self {
            Right::Rows(b) => (b, j, n),
            Right::Columns(b) => (b, j * k, 1),
        };
        (0..k).map(move |p| data[start + p * stride])
    }
}

/// What follows the reduction of each output element before its output rounding.
#[derive(Clone, Copy)]
pub(crate) enum Epilogue<'a> {
    /// A bias per output column added in the accumulator format (or nothing).
    Bias(Option<&'a [f64]>),
    /// The sum divided by its length, one rounding in the accumulator format (a mean): the
    /// reciprocal of the length.
    Mean(f64),
}

/// The threshold for C = A·B (+ bias, or / k for a mean) with the same quantized operands on
/// both sides, or `None` when the fast path does not apply or the structure test sends the
/// data to the walk. `a` is [m, k], row-major.
pub(crate) fn matmul_threshold_fast(
    a: &[f64],
    b: Right,
    epilogue: Epilogue,
    (m, k, n): (usize, usize, usize),
    r: FastSide,
    c: FastSide,
    confidence: Confidence,
) -> Result<Option<Threshold>> {
    let bias = match epilogue {
        Epilogue::Bias(bias) => bias,
        Epilogue::Mean(_) => None,
    };
    let probabilistic = matches!(confidence, Confidence::Probabilistic { .. });
    if !probabilistic {
        // A guaranteed threshold needs no execution: two GEMMs.
        if let Some(t) = guaranteed::guaranteed_threshold(a, b, epilogue, (m, k, n), r, c)? {
            return Ok(Some(t));
        }
    }
    let Some((reduced, _)) = reduce(a, b, bias, (m, k, n), (r.acc, c.acc), probabilistic)? else {
        return Ok(None);
    };
    let mut sums = ThresholdSums::new(confidence, m * n);
    let mut norm_sq = 0.0;
    let (ar, ac) = (r.policy.accumulator(), c.policy.accumulator());
    for x in reduced {
        let (v, g_out) = match epilogue {
            Epilogue::Bias(bias) => (x.value + bias.map_or(0.0, |b| b[x.column]), x.er.guaranteed),
            Epilogue::Mean(inv) => (x.value * inv, x.er.guaranteed * inv),
        };
        norm_sq += v * v * x.count as f64;
        // |exact − vr| ≤ the reference's guaranteed error ≤ g.
        let magnitude = v.abs() + g_out;
        let mut e = ElementDiff::from_reductions(x.er, x.ec, 0.0);
        let mut cur = (r.acc.order.result_format(ar), c.acc.order.result_format(ac));
        if let Epilogue::Mean(inv) = epilogue {
            e.scale(inv);
        }
        if !matches!(epilogue, Epilogue::Bias(None)) {
            // The bias added, or the mean divided, in the accumulator format.
            round_sides(&mut e, (Format::F64, Format::F64), (ar, ac), magnitude);
            cur = (ar, ac);
        }
        if check_output(&e, magnitude, (r.policy.output, c.policy.output)).is_err() {
            // The walk decides, from the exact values.
            return Ok(None);
        }
        round_sides(&mut e, cur, (r.policy.output, c.policy.output), magnitude);
        sums.add_group(&e, x.count);
    }
    Ok(Some(sums.threshold(norm_sq.sqrt())))
}

/// The sums of each row of `terms` ([rows, k], row-major) in the two accumulations' orders
/// (both FP32 with every rounding in FP32, the same terms on both sides): per row, the
/// reference's and the candidate's reduction errors as the fast model prices them — the
/// reference's carrying the guaranteed bound of the difference and the determined errors'
/// own rounding (`tie_bound`), each side its determined errors (`mean`) and the variance of
/// its independent roundings outside the prefix both orders share (so that only their sums
/// and differences mean anything). `None` when the fast path does not apply or the data fail
/// the structure test (`probabilistic`; a guaranteed bound does not rest on the model).
pub(crate) fn sum_rows(
    terms: &[f64],
    k: usize,
    (r, c): (&Accumulation, &Accumulation),
    probabilistic: bool,
) -> Result<Option<Vec<(ReductionError, ReductionError)>>> {
    let rows = terms.len().checked_div(k).unwrap_or(0);
    let exact = |acc: &Accumulation| Accumulation {
        products: Products::Exact,
        ..acc.clone()
    };
    let (r, c) = (exact(r), exact(c));
    let Some((reduced, class)) = reduce(
        &vec![1.0; k],
        Right::Columns(terms),
        None,
        (1, k, rows),
        (&r, &c),
        probabilistic,
    )?
    else {
        return Ok(None);
    };
    let mut by_class = vec![None; rows];
    for x in reduced {
        by_class[class[x.column]] = Some((x.er, x.ec));
    }
    Ok(class.iter().map(|&c| by_class[c]).collect())
}

/// One class of identical outputs of [`reduce`].
struct Reduced {
    /// A member's column (its row of A is a class's first member).
    column: usize,
    /// Outputs in the class.
    count: usize,
    /// The reference's computed value.
    value: f64,
    /// The two sides' reduction errors (see [`sum_rows`]).
    er: ReductionError,
    ec: ReductionError,
}

/// The fast model of C = A·B under two accumulations, one entry per pair of classes of
/// identical rows of A and identical columns of B (with their bias): both executions run by
/// the kernel, their statistics, and the structure test (per element and for the tensor)
/// when `probabilistic`; with each column's class. `None` when the fast path does not apply
/// or the test fails.
#[allow(clippy::needless_range_loop)]
fn reduce(
    a: &[f64],
    b: Right,
    bias: Option<&[f64]>,
    (m, k, n): (usize, usize, usize),
    (r, c): (&Accumulation, &Accumulation),
    probabilistic: bool,
) -> Result<Option<(Vec<Reduced>, Vec<usize>)>> {
    let Some(prepared) = prepared_for((m, k, n), (r, c))? else {
        return Ok(None);
    };
    let (pr, pc) = &prepared.programs;
    let (cr, cc) = prepared.constants;
    let Some((mut packed, row_exp, col_exp)) = pack(a, b, m, k, n, &prepared.weights) else {
        return Ok(None);
    };
    // Products exact in f32 (inputs of at most 12 significant bits, or every value of A
    // zero or a power of two — a sum's ones —, its products B's values scaled): roundings
    // are determined as the walk determines them. Following exact values and parities too
    // (twice the work per rounding) brings the threshold from 1.3–1.5× the walk's to about
    // 1.0× where the tail margins weigh most, with fewer than 4,096 outputs (at 4,096, 1.13×
    // without it), and on sums, whose terms times one leave nearly every rounding
    // determined (up to 5× without it; papers/bounds-reductions.md §5.1).
    // A sum: ones(1 × k) times B (B's columns summed), whichever way B is held.
    let summing = m == 1 && a[..k].iter().all(|&x| x == 1.0);
    let track = summing || m * n < 4096;
    let narrow = r.input.precision() <= 12 && c.input.precision() <= 12;
    let powers_of_two = || {
        a[..m * k]
            .iter()
            .all(|&x| x == 0.0 || crate::bounds::reduction::lowest_bit(x) == x.abs())
    };
    let det = if !narrow && !powers_of_two() {
        Determine::Nothing
    } else if track {
        Determine::Track
    } else {
        Determine::Grid
    };
    // A sum of narrow values (BF16, FP16, FP8) is often exact at every step: those outputs
    // skip the tracking pass (`kernel::run_pair`; the same outputs bit for bit).
    let shortcut = summing && narrow;
    let blocks = packed.blocks;
    let (out_r, out_c, _) = kernel::run_pair((pr, pc), &mut packed, det, shortcut);
    pack::recycle(packed.b);
    pack::recycle(packed.lb);
    // The f32 sums of non-negative terms (the guaranteed sum, the variances) err by at most
    // (1 + 2^-24)^(k+2) − 1 relative (the weights' rounding included).
    let inflate = (((k + 2) as f64) * (2f64.powi(-24)).ln_1p()).exp_m1() * (1.0 + 1e-9) + 1.0;
    let n_el = m * n;
    let (mut sum_d2, mut sum_h, mut sum_h2, mut max_h) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let t_s = (1.0 / STRUCTURE_DELTA).ln();
    let z2 = 2.0 * (2.0 * n_el as f64 / STRUCTURE_DELTA).ln();
    // Identical rows of A and identical columns of B (with their bias) give identical
    // differences: one component per pair of classes, as the walk prices them.
    let (rows, (column_class, cols)) = classes(a, b, bias, m, k, n);
    let mut reduced = Vec::with_capacity(rows.len() * cols.len());
    for &(i, count_i) in &rows {
        for &(j, count_j) in &cols {
            let weight = (count_i * count_j) as f64;
            let (jb, l) = (j / W, j % W);
            let o = (i * blocks + jb) * OUT;
            let scale = 2f64.powi(-(row_exp[i] + col_exp[j]));
            let vr = out_r[o + l] as f64 * scale;
            let vc = out_c[o + l] as f64 * scale;
            let var_unit = scale * scale * 2f64.powi(-46) * inflate;
            let (hr, hc) = (
                out_r[o + W + l] as f64 * var_unit,
                out_c[o + W + l] as f64 * var_unit,
            );
            let g = out_r[o + 2 * W + l] as f64 * inflate * scale
                + k as f64 * 2f64.powi(-149) * scale
                + cr
                + cc;
            if ![vr, vc, hr, hc, g].iter().all(|x| x.is_finite()) {
                return Ok(None);
            }
            // The structure test, per element.
            // Every partial sum is at most Σ|a||b| ≤ 4k·scale (scaled values below 2): far
            // from FP32's overflow, or the walk decides.
            if 4.0 * k as f64 * scale >= 2f64.powi(120) {
                return Ok(None);
            }
            // The determined errors (each exact; a side's f32 sum of n of them errs by at most
            // (n − 1)u·Σ|η| (Jeannerod & Rump 2013), n ≤ k + 2: tracking, the pass sums the
            // |η| (in f32, within a factor `inflate`); otherwise Σ|η| over a side's roundings
            // is within its Higham bound, to first order: Σⱼ|ηⱼ| ≤ Σⱼ u|sⱼ| ≤
            // Σᵢ|tᵢ|·u·(roundings after i)) and what the structure test sees: the rest of D.
            let det_r = out_r[o + 3 * W + l] as f64 * scale;
            let det_c = out_c[o + 3 * W + l] as f64 * scale;
            let abs_sum = if track {
                (out_r[o + 4 * W + l] as f64 + out_c[o + 4 * W + l] as f64) * scale * inflate
            } else {
                2.0 * g
            };
            let det_err = (inflate - 1.0) * abs_sum;
            let offset = det_c - det_r;
            let d = vc - vr - offset;
            let h = hr + hc;
            let d = d.abs() - det_err.min(d.abs());
            // A guaranteed threshold does not rest on the model: no structure test.
            if probabilistic && d * d > z2 * h {
                return Ok(None);
            }
            // Copies of one difference: counted as the copies they are (the test's
            // expectation), their tail as one component.
            sum_d2 += d * d * weight;
            sum_h += h * weight;
            sum_h2 += h * h * weight * weight;
            max_h = max_h.max(h * weight);
            reduced.push(Reduced {
                column: j,
                count: count_i * count_j,
                value: vr,
                er: ReductionError {
                    guaranteed: g,
                    mean: det_r,
                    variance: hr,
                    tie_bound: det_err,
                },
                ec: ReductionError {
                    mean: det_c,
                    variance: hc,
                    ..ReductionError::default()
                },
            });
        }
    }
    // The structure test, for the tensor (Hsu, Kakade & Zhang 2012, Thm 1).
    if probabilistic && sum_d2 > sum_h + 2.0 * (t_s * sum_h2).sqrt() + 2.0 * t_s * max_h {
        return Ok(None);
    }
    Ok(Some((reduced, column_class)))
}

/// The programs and weights of the two accumulations over k terms, where the fast path
/// applies: a non-empty product with k ≤ 2²⁴, FP32 accumulation of exact products of FP32
/// values or narrower, orders the lane kernel executes (every rounding in FP32).
fn prepared_for(
    (m, k, n): (usize, usize, usize),
    (r, c): (&Accumulation, &Accumulation),
) -> Result<Option<std::sync::Arc<prepared::Prepared>>> {
    if m == 0 || n == 0 || k == 0 || k > 1 << 24 {
        return Ok(None);
    }
    for acc in [r, c] {
        if acc.accumulator != Format::F32
            || acc.products != Products::Exact
            || !acc.input.is_subset_of(Format::F32)
        {
            return Ok(None);
        }
    }
    prepared(r, c, k)
}

/// Classes of identical lines: (first member, size) each.
type Classes = Vec<(usize, usize)>;

/// Classes of identical rows of A and of identical columns of B (each with its bias value):
/// (first member, size) per class, and each column's class.
fn classes(
    a: &[f64],
    b: Right,
    bias: Option<&[f64]>,
    m: usize,
    k: usize,
    n: usize,
) -> (Classes, (Vec<usize>, Classes)) {
    let (_, rows) = row_classes(&a[..m * k], k);
    if let (Right::Columns(x), None) = (b, bias) {
        // B's columns are stored as rows already.
        return (rows, row_classes(&x[..n * k], k));
    }
    let width = k + usize::from(bias.is_some());
    let mut cols_key = Vec::with_capacity(n * width);
    for j in 0..n {
        cols_key.extend(b.column(j, k, n));
        if let Some(bias) = bias {
            cols_key.push(bias[j]);
        }
    }
    (rows, row_classes(&cols_key, width))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bounds::ops::{matmul_threshold_priced, Pricing};
    use crate::order::{Combine, Order};
    use crate::tensor::Tensor;
    use crate::Overflow;

    fn bf16(shape: &[usize], seed: u64, mean: f64) -> Tensor {
        values(shape, seed, mean, Format::BF16)
    }

    fn values(shape: &[usize], seed: u64, mean: f64, f: Format) -> Tensor {
        let mut g = crate::random::SplitMix64::for_name("fast", seed);
        let n: usize = shape.iter().product();
        let v = (0..n)
            .map(|_| mean + (g.uniform() - 0.5) * 2.0 * (1.0 + 3.0 * g.uniform()))
            .collect();
        Tensor::rounded(shape, v, f, Overflow::Saturating).unwrap()
    }

    fn orders() -> Vec<Order> {
        vec![
            Order::Sequential,
            Order::blocked(16),
            Order::pairwise(8),
            Order::split_k(8, Format::F32, Combine::Tree),
            Order::split_k(3, Format::F32, Combine::Sequential),
            Order::split_k(4, Format::F32, Combine::Ring { start: 1 }),
        ]
    }

    fn policy(order: &Order) -> Policy {
        let mut p: Policy = "in=bf16,acc=f32,out=f32".parse().unwrap();
        p.accumulation.order = order.clone();
        p
    }

    /// The kernel's executions are the engine's, bit for bit (the engine executes each order
    /// from its own description, `order::exec`).
    #[test]
    #[allow(clippy::needless_range_loop)]
    fn kernel_executes_each_order_as_the_engine_does() {
        for (k, seed, f) in [
            (1usize, 1u64, Format::BF16),
            (7, 2, Format::BF16),
            (64, 3, Format::F32),
            (257, 4, Format::BF16),
            (1000, 5, Format::F32),
            (300, 6, Format::F16),
        ] {
            let (m, n) = (3, 21);
            let a = values(&[m, k], seed, 0.0, f);
            let b = values(&[k, n], seed + 100, 0.3, f);
            for order in orders() {
                let Some(prog) = program(&order, k) else {
                    assert!(k < 8, "{order} k={k}");
                    continue;
                };
                let w = vec![0.0; k];
                let (packed, re, ce) =
                    pack(a.values(), Right::Rows(b.values()), m, k, n, &w).unwrap();
                let out = kernel::run(&prog, &packed, false, Determine::Nothing);
                let mut pol = policy(&order);
                pol.accumulation.input = f;
                let engine = crate::engine::matmul(&a, &b, &pol).unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let o = (i * packed.blocks + j / W) * OUT + j % W;
                        let v = out[o] as f64 * 2f64.powi(-(re[i] + ce[j]));
                        assert_eq!(
                            v.to_bits(),
                            engine.values()[i * n + j].to_bits(),
                            "{order} k={k} ({i},{j})"
                        );
                    }
                }
            }
        }
    }

    /// B given by its columns (a tensor's rows, interleaved into panels a block at a time) is
    /// packed as the same B given by its rows, element for element and bit for bit: values,
    /// lowest bits and column scales, for partial blocks and step counts that are not a
    /// multiple of the interleave's eight.
    #[test]
    fn columns_pack_as_their_transpose_by_rows() {
        for (k, n, seed) in [
            (1usize, 1usize, 1u64),
            (9, 19, 2),
            (1000, 16, 3),
            (37, 40, 4),
        ] {
            let x = values(&[n, k], seed, 0.2, Format::BF16);
            let xt: Vec<f64> = (0..k)
                .flat_map(|p| (0..n).map(move |j| (p, j)))
                .map(|(p, j)| x.values()[j * k + p])
                .collect();
            let ones = vec![1.0; k];
            let w = vec![0.5; k];
            // Spare buffers full of NaNs: a pack that reuses one sets every value.
            pack::recycle(vec![f32::NAN; 2 * k * n + 64]);
            pack::recycle(vec![f32::NAN; 3 * k * n + 64]);
            let (c, _, ce) = pack(&ones, Right::Columns(x.values()), 1, k, n, &w).unwrap();
            pack::recycle(vec![f32::NAN; 2 * k * n + 64]);
            pack::recycle(vec![f32::NAN; 3 * k * n + 64]);
            let (r, _, re) = pack(&ones, Right::Rows(&xt), 1, k, n, &w).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(ce, re, "k={k} n={n}");
            assert_eq!(bits(&c.b), bits(&r.b), "k={k} n={n}");
            assert_eq!(bits(&c.lb), bits(&r.lb), "k={k} n={n}");
        }
    }

    /// A sum is ones(1 × k)·xᵀ: the kernel's executions over the rows of x (B's columns stored
    /// as rows) are `order::sum`'s, bit for bit.
    #[test]
    #[allow(clippy::needless_range_loop)]
    fn kernel_sums_rows_as_the_engine_does() {
        for (k, seed, f) in [
            (9usize, 1u64, Format::BF16),
            (300, 2, Format::F16),
            (1000, 3, Format::F32),
        ] {
            let rows = 19;
            let x = values(&[rows, k], seed, 0.4, f);
            for order in orders() {
                let Some(prog) = program(&order, k) else {
                    continue;
                };
                let w = vec![0.0; k];
                let (packed, re, ce) =
                    pack(&vec![1.0; k], Right::Columns(x.values()), 1, k, rows, &w).unwrap();
                let out = kernel::run(&prog, &packed, false, Determine::Nothing);
                let mut acc = policy(&order).accumulation;
                acc.input = f;
                for j in 0..rows {
                    let o = (j / W) * OUT + j % W;
                    let v = out[o] as f64 * 2f64.powi(-(re[0] + ce[j]));
                    let want = crate::order::sum(&x.values()[j * k..(j + 1) * k], &acc).unwrap();
                    assert_eq!(v.to_bits(), want.to_bits(), "{order} k={k} row {j}");
                }
            }
        }
    }

    /// The exact shortcut (`kernel::run_pair`) gives the tracking pass's outputs bit for bit —
    /// values, variances, guaranteed sums, determined errors and their magnitudes — on sums
    /// and products whose outputs are exact at every rounding in some columns and not in
    /// others (tiny values placed in a fifth of the columns), in every order against the
    /// sequential one; and the BF16 sums take it.
    #[test]
    fn exact_outputs_skip_tracking_with_the_same_outputs() {
        for (m, k, n, f, seed) in [
            (1usize, 256usize, 37usize, Format::BF16, 1u64),
            (1, 300, 16, Format::F16, 2),
            (3, 64, 21, Format::BF16, 3),
        ] {
            let mut x = values(&[n, k], seed, 0.3, f).values().to_vec();
            for j in (0..n).step_by(5) {
                x[j * k + (j * 7) % k] = f.round(3.0 * 2f64.powi(-20), Overflow::Saturating);
            }
            let a = if m == 1 {
                vec![1.0; k]
            } else {
                values(&[m, k], seed + 10, 0.0, Format::BF16)
                    .values()
                    .to_vec()
            };
            let w = vec![0.25; k];
            let (packed, _, _) = pack(&a, Right::Columns(&x), m, k, n, &w).unwrap();
            let pr = program(&Order::Sequential, k).unwrap();
            let (mut exact_columns, mut tracked_columns, mut shortcuts) = (0, 0, 0);
            for order in orders() {
                let Some(pc) = program(&order, k) else {
                    continue;
                };
                let want_r = kernel::run(&pr, &packed, true, Determine::Track);
                let want_c = kernel::run(&pc, &packed, false, Determine::Track);
                let (got_r, got_c, tracked) =
                    kernel::run_pair((&pr, &pc), &mut packed.clone(), Determine::Track, true);
                if let Some(t) = tracked {
                    shortcuts += 1;
                    assert!(t < packed.blocks * W, "{order}: {t} columns tracked");
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got_r), bits(&want_r), "{order} m={m} k={k}");
                assert_eq!(bits(&got_c), bits(&want_c), "{order} m={m} k={k}");
                // The first pass finds the exact outputs: none with a tiny value (which
                // rounds wherever it is added), and in sums some of the others.
                let (_, flags_r) = kernel::run_exact(&pr, &packed, true, packed.blocks);
                let (_, flags_c) = kernel::run_exact(&pc, &packed, false, packed.blocks);
                for i in 0..m {
                    for j in 0..n {
                        let at = i * packed.blocks * W + j;
                        let exact = flags_r[at] && flags_c[at];
                        if j % 5 == 0 {
                            assert!(!exact, "{order} m={m} k={k}: column {j} is not exact");
                        }
                        exact_columns += usize::from(exact);
                        tracked_columns += usize::from(!exact);
                    }
                }
            }
            assert!(tracked_columns > 0, "m={m} k={k}");
            if m == 1 {
                assert!(exact_columns > 0, "k={k}: no exact column");
            }
            if m == 1 && f == Format::BF16 {
                assert!(shortcuts > 0, "k={k}: the shortcut was never taken");
            }
        }
    }

    /// Row sums and means priced by the pass hold for the engine's executions and stay near
    /// the walk's threshold.
    #[test]
    fn sums_and_means_on_the_pass_hold_and_stay_near_the_walk() {
        use crate::bounds::ops::sum_threshold_priced;
        let conf = Confidence::default_probabilistic();
        for (rows, k, mean_value, f) in [(64, 512, 0.0, Format::BF16), (32, 1000, 1.0, Format::F16)]
        {
            let x = values(&[rows, k], k as u64, mean_value, f);
            for order in orders().into_iter().skip(1) {
                for mean in [false, true] {
                    let (mut rp, mut cp) = (policy(&Order::Sequential), policy(&order));
                    rp.accumulation.input = f;
                    cp.accumulation.input = f;
                    let run = |p: &Policy| {
                        let v: Vec<f64> = x
                            .values()
                            .chunks(k)
                            .map(|row| {
                                let s = crate::order::sum(row, &p.accumulation).unwrap();
                                if mean {
                                    Format::F32.round(s / k as f64, Overflow::Saturating)
                                } else {
                                    s
                                }
                            })
                            .collect();
                        Tensor::from_vec(&[rows], v, Format::F32).unwrap()
                    };
                    let fast =
                        sum_threshold_priced(&x, &rp, &cp, mean, conf, Pricing::Fast).unwrap();
                    let walk =
                        sum_threshold_priced(&x, &rp, &cp, mean, conf, Pricing::Walk).unwrap();
                    let ratio = fast.abs_frobenius / walk.abs_frobenius;
                    let (r, c) = (run(&rp), run(&cp));
                    assert!(
                        (0.8..1.5).contains(&ratio),
                        "{order} {f} mean={mean}: {ratio}"
                    );
                    assert!(fast.check(&r, &c).passed, "{order} {f} mean={mean}");
                    let guaranteed = sum_threshold_priced(
                        &x,
                        &rp,
                        &cp,
                        mean,
                        Confidence::Guaranteed,
                        Pricing::Fast,
                    )
                    .unwrap();
                    let walk_g = sum_threshold_priced(
                        &x,
                        &rp,
                        &cp,
                        mean,
                        Confidence::Guaranteed,
                        Pricing::Walk,
                    )
                    .unwrap();
                    let ratio = guaranteed.abs_frobenius / walk_g.abs_frobenius;
                    assert!(
                        (1.0..1.001).contains(&ratio),
                        "{order} {f} mean={mean}: {ratio}"
                    );
                }
            }
        }
    }

    fn both(
        a: &Tensor,
        b: &Tensor,
        r: &Policy,
        c: &Policy,
        conf: Confidence,
    ) -> (Option<Threshold>, Threshold) {
        let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
        let mut ra = r.accumulation.clone();
        ra.input = Format::BF16;
        let mut ca = c.accumulation.clone();
        ca.input = Format::BF16;
        let fast = matmul_threshold_fast(
            a.values(),
            Right::Rows(b.values()),
            Epilogue::Bias(None),
            (m, k, n),
            FastSide {
                acc: &ra,
                policy: r,
            },
            FastSide {
                acc: &ca,
                policy: c,
            },
            conf,
        )
        .unwrap();
        let walk = matmul_threshold_priced(a, b, None, r, c, conf, Pricing::Walk).unwrap();
        (fast, walk)
    }

    /// The guaranteed bound is the walk's (Higham's, from the same depths), up to the f32
    /// sum's inflation.
    #[test]
    fn guaranteed_bound_is_the_walks() {
        let a = bf16(&[8, 300], 7, 0.0);
        let b = bf16(&[300, 24], 8, 0.5);
        for order in orders().into_iter().skip(1) {
            let (fast, walk) = both(
                &a,
                &b,
                &policy(&Order::Sequential),
                &policy(&order),
                Confidence::Guaranteed,
            );
            let fast = fast.unwrap_or_else(|| panic!("{order}: no fast path"));
            let ratio = fast.abs_frobenius / walk.abs_frobenius;
            assert!((1.0..1.0 + 1e-4).contains(&ratio), "{order}: {ratio}");
            let ratio = fast.per_element / walk.per_element;
            assert!((1.0..1.0 + 1e-4).contains(&ratio), "{order}: {ratio}");
        }
    }

    /// On data without structure the model's threshold is near the walk's (which prices the
    /// determined roundings exactly), and both hold for the engine's executions.
    #[test]
    fn probabilistic_threshold_near_the_walks_on_plain_data() {
        let conf = Confidence::default_probabilistic();
        for (m, k, n, mean) in [(16, 256, 16, 0.0), (8, 1024, 16, 0.0), (4, 512, 32, 1.0)] {
            let a = bf16(&[m, k], k as u64, 0.0);
            let b = bf16(&[k, n], k as u64 + 1, mean);
            for order in orders().into_iter().skip(1) {
                let (rp, cp) = (policy(&Order::Sequential), policy(&order));
                let (fast, walk) = both(&a, &b, &rp, &cp, conf);
                let fast = fast.unwrap_or_else(|| panic!("{order} k={k}: no fast path"));
                let ratio = fast.abs_frobenius / walk.abs_frobenius;
                // Exact values and parities followed (fewer than 4,096 outputs): about the
                // walk's threshold (1.3–1.5× without).
                assert!((0.8..1.3).contains(&ratio), "{order} k={k}: {ratio}");
                let r = crate::engine::matmul(&a, &b, &rp).unwrap();
                let c = crate::engine::matmul(&a, &b, &cp).unwrap();
                assert!(fast.check(&r, &c).passed, "{order} k={k}");
            }
        }
    }

    /// From 4,096 outputs the pass follows grids only (not exact values and parities): within
    /// 1.25× of the walk on plain data, and it holds.
    #[test]
    fn grid_rule_alone_holds_on_large_tensors() {
        let (m, k, n) = (64, 256, 64);
        let a = bf16(&[m, k], 51, 0.0);
        let b = bf16(&[k, n], 52, 0.3);
        let (rp, cp) = (
            policy(&Order::Sequential),
            policy(&Order::split_k(8, Format::F32, Combine::Tree)),
        );
        let (fast, walk) = both(&a, &b, &rp, &cp, Confidence::default_probabilistic());
        let fast = fast.expect("priced by the pass");
        let ratio = fast.abs_frobenius / walk.abs_frobenius;
        assert!((1.0..1.25).contains(&ratio), "{ratio}");
        let r = crate::engine::matmul(&a, &b, &rp).unwrap();
        let c = crate::engine::matmul(&a, &b, &cp).unwrap();
        assert!(fast.check(&r, &c).passed);
    }

    /// Sixteen copies of one row of A give sixteen identical rows of D: one component 4·D of
    /// ‖D‖_F (its tail that of one variable), so the threshold is exactly 4× the one-row
    /// threshold; counted as independent elements it would be about 2.8× smaller.
    #[test]
    fn identical_rows_are_one_component() {
        let k = 512;
        let row = bf16(&[1, k], 31, 0.0);
        let copies: Vec<f64> = (0..16).flat_map(|_| row.values().to_vec()).collect();
        let a16 = Tensor::from_vec(&[16, k], copies, Format::BF16).unwrap();
        let b = bf16(&[k, 64], 32, 0.0);
        let (rp, cp) = (
            policy(&Order::Sequential),
            policy(&Order::split_k(8, Format::F32, Combine::Tree)),
        );
        let conf = Confidence::default_probabilistic();
        let one = both(&row, &b, &rp, &cp, conf).0.expect("fast path");
        let sixteen = both(&a16, &b, &rp, &cp, conf).0.expect("fast path");
        let ratio = sixteen.abs_frobenius / one.abs_frobenius;
        assert!((ratio - 4.0).abs() < 1e-9, "{ratio}");
    }

    /// Zeros (sparse activations, a zero column of B) are exact additions: priced by the pass,
    /// with finite statistics, and the threshold holds.
    #[test]
    fn zeros_stay_on_the_fast_path() {
        let (m, k, n) = (8, 512, 24);
        let a = bf16(&[m, k], 21, 0.0);
        let av: Vec<f64> = a
            .values()
            .iter()
            .enumerate()
            .map(|(i, &x)| if i % 3 == 0 { 0.0 } else { x })
            .collect();
        let a = Tensor::from_vec(&[m, k], av, Format::BF16).unwrap();
        let b = bf16(&[k, n], 22, 0.2);
        let bv: Vec<f64> = (0..k * n)
            .map(|i| if i % n == 5 { 0.0 } else { b.values()[i] })
            .collect();
        let b = Tensor::from_vec(&[k, n], bv, Format::BF16).unwrap();
        let (rp, cp) = (policy(&Order::Sequential), policy(&Order::blocked(16)));
        let conf = Confidence::default_probabilistic();
        let (fast, walk) = both(&a, &b, &rp, &cp, conf);
        let fast = fast.expect("zeros are priced by the fast path");
        assert!(fast.abs_frobenius.is_finite() && fast.abs_frobenius < 2.0 * walk.abs_frobenius);
        let r = crate::engine::matmul(&a, &b, &rp).unwrap();
        let c = crate::engine::matmul(&a, &b, &cp).unwrap();
        assert!(fast.check(&r, &c).passed);
    }

    /// Products that fall below FP32's normal range round on the subnormal grid in the
    /// engine, not on the scaled grid the kernel computes on: such data go to the walk
    /// (found by the zoo's subnormal family once determined roundings were carried exactly).
    #[test]
    fn products_below_the_normal_range_go_to_the_walk() {
        let tiny = |shape: &[usize], seed| {
            let t = values(shape, seed, 0.0, Format::BF16);
            let v = t.values().iter().map(|x| x * 2f64.powi(-70)).collect();
            Tensor::from_vec(shape, v, Format::BF16).unwrap()
        };
        let (a, b) = (tiny(&[4, 2], 41), tiny(&[2, 16], 42));
        let (rp, cp) = (
            policy(&Order::Sequential),
            policy(&Order::split_k(2, Format::F32, Combine::Tree)),
        );
        let (fast, walk) = both(&a, &b, &rp, &cp, Confidence::default_probabilistic());
        assert!(fast.is_none());
        let r = crate::engine::matmul(&a, &b, &rp).unwrap();
        let c = crate::engine::matmul(&a, &b, &cp).unwrap();
        assert!(walk.check(&r, &c).passed);
    }

    /// A row [2^20, t, t, …, t] of 1,024 BF16 values times ones, sequential vs pairwise(8):
    /// both thresholds (fast or none, walk), the two executions and |D|.
    fn big_then_constant(t: f64) -> (Option<Threshold>, Threshold, Tensor, Tensor, f64) {
        let k = 1024;
        let mut av = vec![t; k];
        av[0] = (1u64 << 20) as f64;
        let a = Tensor::from_vec(&[1, k], av, Format::BF16).unwrap();
        let b = Tensor::from_vec(&[k, 1], vec![1.0; k], Format::BF16).unwrap();
        let (rp, cp) = (policy(&Order::Sequential), policy(&Order::pairwise(8)));
        let (fast, walk) = both(&a, &b, &rp, &cp, Confidence::default_probabilistic());
        let r = crate::engine::matmul(&a, &b, &rp).unwrap();
        let c = crate::engine::matmul(&a, &b, &cp).unwrap();
        let d = (c.values()[0] - r.values()[0]).abs();
        (fast, walk, r, c, d)
    }

    /// Terms just above half a spacing of a large partial sum all round up in a sequential
    /// sum: a determined error (RN_U(t) − t whatever the running value), which the fast path
    /// carries exactly, as the walk does.
    #[test]
    fn determined_roundings_are_carried_exactly() {
        let (fast, walk, r, c, d) = big_then_constant(0.0625 * (1.0 + 1.0 / 128.0));
        let fast = fast.expect("determined roundings are priced by the fast path");
        // The systematic difference is many times what random roundings would give.
        assert!(d > 20.0, "{d}");
        assert!(fast.check(&r, &c).passed && walk.check(&r, &c).passed);
        assert!(fast.abs_frobenius < 1.2 * walk.abs_frobenius);
    }

    /// Ties resolved by parity: with the running sum on the grid U and every term 3U/2, each
    /// sum lies halfway and rounds up to the even neighbour — +U/2 at every step, a
    /// systematic error. The pass follows the parity as the walk does (the running value's
    /// bit at U is known along the chain) and carries those ties as determined.
    #[test]
    fn ties_decided_by_a_known_parity_are_carried_exactly() {
        // Running sums in [2^20, 2^21): U = 2^-3; terms 3U/2.
        let (fast, walk, r, c, d) = big_then_constant(0.1875);
        let fast = fast.expect("parity-decided ties are priced by the pass");
        assert!(d > 20.0, "{d}");
        assert!(fast.check(&r, &c).passed && walk.check(&r, &c).passed);
        assert!(fast.abs_frobenius < 1.2 * walk.abs_frobenius);
    }

    /// A term on a finer grid before the ties (its BF16 value lands the running sum on U/2):
    /// the pass follows the running value's position as the walk does, and both price the
    /// difference as the determined one it is.
    #[test]
    fn a_term_off_the_grid_before_ties_is_followed() {
        let k = 1024;
        let mut av = vec![0.1875; k];
        av[0] = (1u64 << 20) as f64;
        // A second term on a finer grid than the ties' U/2.
        av[1] = 0.1875 * (1.0 + 1.0 / 128.0) * 0.375;
        let a = Tensor::rounded(&[1, k], av, Format::BF16, Overflow::Saturating).unwrap();
        let b = Tensor::from_vec(&[k, 1], vec![1.0; k], Format::BF16).unwrap();
        let (rp, cp) = (policy(&Order::Sequential), policy(&Order::pairwise(8)));
        let (fast, walk) = both(&a, &b, &rp, &cp, Confidence::default_probabilistic());
        let r = crate::engine::matmul(&a, &b, &rp).unwrap();
        let c = crate::engine::matmul(&a, &b, &cp).unwrap();
        let fast = fast.expect("priced by the pass");
        assert!(fast.check(&r, &c).passed && walk.check(&r, &c).passed);
        assert!(fast.abs_frobenius <= 1.01 * walk.abs_frobenius);
    }
}

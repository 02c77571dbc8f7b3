//! Comparison thresholds for whole ops: matmul / linear (with FP8 quantization), sum, mean and
//! all-reduce, from the actual data (checking) or from summary statistics (planning).
//!
//! Each function prices "reference policy vs candidate policy on the same logical inputs", with
//! the exact arithmetic the engine performs (`engine::matmul`, `engine::nn`): the reduction,
//! then the trailing roundings (FP8 rescale in the accumulator format, bias addition, output
//! rounding).

use crate::bounds::compare::{
    grouped_threshold, residue_clusters, row_classes, tensor_threshold_weighted, Confidence,
    ElementDiff, Threshold, ThresholdSums,
};
use crate::bounds::fast::{Epilogue, FastSide, Right};
use crate::bounds::reduction::{
    planned_reduction_error, reduction_error, reduction_error_aligned, ReductionError, TermStats,
};
use crate::error::{Error, Result};
use crate::exact::ExactAccumulator;
use crate::format::Format;
use crate::order::{product_exponent, Accumulation, Order, Products};
use crate::policy::Policy;
use crate::policy::{quantize, Quantized};
use crate::tensor::Tensor;

fn scaled(e: ReductionError, f: f64) -> ReductionError {
    ReductionError {
        guaranteed: e.guaranteed * f.abs(),
        mean: e.mean * f,
        variance: e.variance * f * f,
        tie_bound: e.tie_bound * f.abs(),
    }
}

/// Round each side's value, currently in format `cur.*`, to `target.*` (see `ElementDiff`):
/// both sides rounding to the same format is the "nearly equal values" case; one side
/// rounding onto the grid the other side's value already lies on is the "snap" case;
/// roundings to different formats are independent errors.
pub(crate) fn round_sides(
    d: &mut ElementDiff,
    cur: (Format, Format),
    target: (Format, Format),
    magnitude: f64,
) {
    let need_r = !cur.0.is_subset_of(target.0);
    let need_c = !cur.1.is_subset_of(target.1);
    if target.0 == target.1 {
        match (need_r, need_c) {
            (true, true) => d.round_both(target.0, magnitude),
            (true, false) | (false, true) => d.round_snap(target.0, magnitude),
            (false, false) => {}
        }
    } else {
        if need_r {
            d.round_one(target.0, magnitude);
        }
        if need_c {
            d.round_one(target.1, magnitude);
        }
    }
}

/// Refuse an output rounding that may overflow either side's output format: the value `v`
/// (exact) within the difference's guaranteed bound may reach the format's overflow threshold.
pub(crate) fn check_output(d: &ElementDiff, v: f64, outputs: (Format, Format)) -> Result<()> {
    let magnitude = v.abs() + d.guaranteed;
    for f in [outputs.0, outputs.1] {
        let limit = crate::bounds::reduction::overflow_threshold(f);
        if magnitude >= limit {
            return Err(crate::bounds::reduction::overflow_error(
                f,
                magnitude,
                "an output element",
            ));
        }
    }
    Ok(())
}

struct Side {
    q_a: Quantized,
    q_b: Quantized,
    acc: Accumulation,
    factor: Option<f64>,
    policy: Policy,
}

fn side(a: &Tensor, b: &Tensor, m: usize, k: usize, n: usize, policy: &Policy) -> Side {
    let q_a = quantize(
        a.values(),
        [m, k],
        1,
        policy.input(),
        policy.scaling,
        None,
        policy.input_overflow(policy.input()),
    );
    let q_b = quantize(
        b.values(),
        [k, n],
        0,
        policy.rhs(),
        policy.scaling,
        None,
        policy.input_overflow(policy.rhs()),
    );
    let mut acc = policy.accumulation.clone();
    acc.input = if q_b.format.is_subset_of(q_a.format) {
        q_a.format
    } else if q_a.format.is_subset_of(q_b.format) {
        q_b.format
    } else {
        Format::F64
    };
    let factor = if q_a.scale_inv != 1.0 || q_b.scale_inv != 1.0 {
        Some(Format::F32.round(q_a.scale_inv * q_b.scale_inv, crate::Overflow::Saturating))
    } else {
        None
    };
    Side {
        q_a,
        q_b,
        acc,
        factor,
        policy: policy.clone(),
    }
}

/// Threshold for C = A·B (+ bias) computed under `reference` and under `candidate` from the
/// same A of shape [m, k], B of shape [k, n] (and a bias of length n), priced from the data: exact partial sums of every
/// output element, the operands as each side quantizes them, and the reference's magnitudes.
///
/// Priced by [`Pricing::Auto`]: large products by the vectorized all-random model (tens of
/// times one GEMM), small ones — and data the model's structure test rejects — by the
/// determined-rounding walk (about 250 ns per multiply-add and side);
/// [`matmul_threshold_priced`] chooses. Either way O(m·n·k), like the matmul itself. A
/// probabilistic threshold from the walk is checked by the engine's executions of both
/// declared orders (`checked_by_executions`: where they contradict the model at δ = 10⁻³, the
/// guaranteed threshold is returned, its `confidence` saying so).
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{matmul_threshold, Confidence};
/// use ttrace::{Format, Policy, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// let a = Tensor::rounded(&[4, 64], (0..256).map(|i| (i as f64 * 0.37).sin()).collect(),
///     Format::BF16, ttrace::Overflow::Saturating)?;
/// let b = Tensor::rounded(&[64, 3], (0..192).map(|i| (i as f64 * 0.11).cos()).collect(),
///     Format::BF16, ttrace::Overflow::Saturating)?;
/// let reference: Policy = "in=bf16,acc=f32,out=bf16".parse()?;
/// let blocked: Policy = "in=bf16,acc=f32,out=bf16,order=blockfma:16".parse()?;
/// let t = matmul_threshold(&a, &b, None, &reference, &blocked, Confidence::Guaranteed)?;
/// assert!(t.abs_frobenius > 0.0);
/// // The engine's two executions differ by no more.
/// let r = ttrace::engine::matmul(&a, &b, &reference)?;
/// let c = ttrace::engine::matmul(&a, &b, &blocked)?;
/// assert!(t.check(&r, &c).passed);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::ShapeMismatch`] for operands that are not [m, k] and [k, n] (or a bias that is
/// not of length n); [`Error::InvalidParameter`] for an invalid policy or confidence;
/// [`Error::NotRepresentable`] for operands that are not values of the policies' input
/// formats; [`Error::Overflow`] when a rounding may overflow its format.
pub fn matmul_threshold(
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    reference: &Policy,
    candidate: &Policy,
    confidence: Confidence,
) -> Result<Threshold> {
    matmul_threshold_priced(a, b, bias, reference, candidate, confidence, Pricing::Auto)
}

/// The most multiply-adds (over classes of identical rows of A and columns of B) that
/// [`Pricing::Auto`] and [`Pricing::Fast`] hand to the walk when the pass declines a
/// probabilistic threshold (structured data): 2²⁵, about 20 s on one thread at the walk's
/// 250 ns per multiply-add and side. Beyond it the pass's guaranteed threshold is returned
/// (`Threshold::confidence` is then [`Confidence::Guaranteed`]): an op of 4096³ would take
/// the walk about ten hours.
pub const WALK_BUDGET: u128 = 1 << 25;

/// The failure probability at which the engine's executions of the two declared orders test
/// the model behind a probabilistic threshold (`checked_by_executions`).
pub const MODEL_CHECK_DELTA: f64 = 1e-3;

/// Whether an order is a family (its executions are not one order).
fn is_family(order: &Order) -> bool {
    match order {
        Order::AnyOf(_) => true,
        Order::SplitK { inner, .. } => is_family(inner),
        _ => false,
    }
}

/// A probabilistic threshold that the engine's own executions of the two declared orders
/// (`executions`: both sides' outputs, or `None` where they cannot be run) check first. Under
/// the random-rounding model their difference stays within the model's threshold at
/// δ_s = min(δ, [`MODEL_CHECK_DELTA`]) but with probability δ_s; where it does not (the tensor
/// norm or one element), these data are structured in a way the model does not capture —
/// undetermined roundings that move together across elements, as near-constant products do —
/// and the guaranteed threshold is returned instead, marked [`Confidence::Guaranteed`]. A
/// threshold at δ therefore never falls below the difference of the declared executions, and
/// on data the model fits it is the model's (a spurious fallback has probability δ_s).
fn checked_by_executions(
    confidence: Confidence,
    build: &dyn Fn(Confidence) -> Threshold,
    executions: &dyn Fn() -> Option<(Vec<f64>, Vec<f64>)>,
) -> Threshold {
    let Confidence::Probabilistic { delta } = confidence else {
        return build(confidence);
    };
    let threshold = build(confidence);
    let Some((r, c)) = executions() else {
        return threshold;
    };
    if r.len() != c.len() || !r.iter().chain(&c).all(|v| v.is_finite()) {
        return threshold;
    }
    let (mut sq, mut max) = (0.0f64, 0.0f64);
    for (x, y) in r.iter().zip(&c) {
        let d = (y - x).abs();
        sq += d * d;
        max = max.max(d);
    }
    let check = build(Confidence::Probabilistic {
        delta: delta.min(MODEL_CHECK_DELTA),
    });
    if sq.sqrt() > check.abs_frobenius || max > check.per_element {
        build(Confidence::Guaranteed)
    } else {
        threshold
    }
}

/// How [`matmul_threshold_priced`] prices a matmul from its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pricing {
    /// [`Pricing::Fast`] for products of at least 2²² multiply-adds, or 2²⁰ with at least
    /// 4,096 outputs (for sums: summed values, rows); [`Pricing::Walk`] below, where the walk
    /// takes at most a second or two.
    #[default]
    Auto,
    /// Every rounding visited by the determined-rounding walk (papers/bounds-reductions.md
    /// §2): the tightest threshold, at about 250 ns per multiply-add and side.
    Walk,
    /// The model's statistics gathered while a vectorized pass executes both declared orders
    /// (papers/bounds-reductions.md §5.1), tens of times the cost of one GEMM (a hundred with
    /// fewer than 4,096 outputs, and for sums): the roundings the walk determines carried
    /// exactly as it carries them — with fewer than 4,096 outputs, and for sums, following
    /// exact values and parities too (about 1.0× the walk's threshold on plain data; from
    /// 4,096 outputs the grid rule alone, about 1.1×) — and the rest as random. Data whose
    /// executions differ systematically from the model, products that could round below
    /// FP32's normal range, and what the pass does not cover (FP8 rescales, rounded products,
    /// narrow accumulators, tensor-core orders, families, Kahan), are priced by the walk —
    /// structured data within [`WALK_BUDGET`], and by the pass's guaranteed threshold beyond.
    Fast,
}

impl Pricing {
    /// Whether the fast pass prices an op of `work` multiply-adds (summed values) into
    /// `outputs` elements.
    fn takes_fast(self, work: u128, outputs: usize) -> bool {
        match self {
            Pricing::Auto => work >= 1 << 22 || (work >= 1 << 20 && outputs >= 4096),
            Pricing::Walk => false,
            Pricing::Fast => true,
        }
    }
}

/// [`matmul_threshold`] with the pricing method chosen ([`Pricing`]).
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{matmul_threshold_priced, Confidence, Pricing};
/// use ttrace::{Format, Policy, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// let a = Tensor::rounded(&[8, 256], (0..2048).map(|i| (i as f64 * 0.37).sin()).collect(),
///     Format::BF16, ttrace::Overflow::Saturating)?;
/// let b = Tensor::rounded(&[256, 16], (0..4096).map(|i| (i as f64 * 0.11).cos()).collect(),
///     Format::BF16, ttrace::Overflow::Saturating)?;
/// let reference: Policy = "in=bf16,acc=f32,out=bf16".parse()?;
/// let split: Policy = "in=bf16,acc=f32,out=bf16,order=splitk:4:f32:tree".parse()?;
/// let conf = Confidence::default_probabilistic();
/// let fast = matmul_threshold_priced(&a, &b, None, &reference, &split, conf, Pricing::Fast)?;
/// let walk = matmul_threshold_priced(&a, &b, None, &reference, &split, conf, Pricing::Walk)?;
/// assert!(fast.abs_frobenius > 0.5 * walk.abs_frobenius);
/// let r = ttrace::engine::matmul(&a, &b, &reference)?;
/// let c = ttrace::engine::matmul(&a, &b, &split)?;
/// assert!(fast.check(&r, &c).passed && walk.check(&r, &c).passed);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// As [`matmul_threshold`].
pub fn matmul_threshold_priced(
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    reference: &Policy,
    candidate: &Policy,
    confidence: Confidence,
    pricing: Pricing,
) -> Result<Threshold> {
    reference.validate()?;
    candidate.validate()?;
    let sa = a.expect_rank(2, "matmul threshold: A")?;
    let sb = b.expect_rank(2, "matmul threshold: B")?;
    let (m, k, n) = (sa[0], sa[1], sb[1]);
    if sb[0] != k {
        return Err(Error::ShapeMismatch {
            what: "matmul threshold: inner dimensions of A [m, k] and B [k, n] differ".into(),
            expected: vec![k, n],
            found: sb.to_vec(),
        });
    }
    let bias_vals = match bias {
        Some(t) if t.shape() != [n] => {
            return Err(Error::ShapeMismatch {
                what: "matmul threshold: bias must have one value per output column".into(),
                expected: vec![n],
                found: t.shape().to_vec(),
            })
        }
        Some(t) => Some(t.values().to_vec()),
        None => None,
    };
    let r = side(a, b, m, k, n, reference);
    let c = side(a, b, m, k, n, candidate);
    let same_operands =
        r.q_a.values == c.q_a.values && r.q_b.values == c.q_b.values && r.factor == c.factor;
    let identical = reference.same_execution(candidate);
    let fast = pricing.takes_fast((m as u128) * (k as u128) * (n as u128), m * n);
    let in_scope = !identical && same_operands && r.factor.is_none() && c.factor.is_none();
    let pass = |confidence: Confidence| {
        crate::bounds::fast::matmul_threshold_fast(
            &r.q_a.values,
            Right::Rows(&r.q_b.values),
            Epilogue::Bias(bias_vals.as_deref()),
            (m, k, n),
            FastSide {
                acc: &r.acc,
                policy: &r.policy,
            },
            FastSide {
                acc: &c.acc,
                policy: &c.policy,
            },
            confidence,
        )
    };
    if fast && in_scope {
        if let Some(t) = pass(confidence)? {
            return Ok(t);
        }
    }
    // Identical rows of A (as both sides quantize them) and identical columns of B (with their
    // bias) give identical output differences: price each pair of classes once.
    let (_, rows) = row_classes(&side_by_side(&r.q_a.values, k, &c.q_a.values, k), 2 * k);
    let column = |q: &Quantized| -> Vec<f64> {
        (0..n)
            .flat_map(|j| (0..k).map(move |p| (j, p)))
            .map(|(j, p)| q.values[p * n + j])
            .collect()
    };
    let mut cols_key = side_by_side(&column(&r.q_b), k, &column(&c.q_b), k);
    if let Some(b) = &bias_vals {
        cols_key = side_by_side(&cols_key, 2 * k, b, 1);
    }
    let key_len = 2 * k + usize::from(bias_vals.is_some());
    let (_, cols) = row_classes(&cols_key, key_len);
    // The pass declined (structured data): the walk, within its budget; beyond it, the pass's
    // guaranteed threshold, which needs no model (and says so in its `confidence`).
    let walk_work = (rows.len() as u128) * (cols.len() as u128) * (k as u128);
    if fast && in_scope && pricing != Pricing::Walk && walk_work > WALK_BUDGET {
        if let Some(t) = pass(Confidence::Guaranteed)? {
            return Ok(t);
        }
    }
    // A tensor core aligns each product by its factors' exponents (e_x + e_y), which the
    // product's value alone does not tell.
    let aligned = (r.acc.order.has_tensor_core(), c.acc.order.has_tensor_core());
    // Each pair of classes is priced alone (in parallel; the results are folded in order, so
    // the threshold does not depend on the number of threads): its weighted square of the
    // value and its difference's model.
    let pairs: Vec<(usize, usize, usize)> = rows
        .iter()
        .flat_map(|&(i, count_i)| {
            cols.iter()
                .map(move |&(j, count_j)| (i, j, count_i * count_j))
        })
        .collect();
    let priced = crate::parallel::map(
        &pairs,
        |&(i, j, weight)| -> Result<(f64, Option<ElementDiff>)> {
            let mut tr = vec![0.0; k];
            let mut tc = vec![0.0; k];
            let mut xr = vec![None; if aligned.0 { k } else { 0 }];
            let mut xc = vec![None; if aligned.1 { k } else { 0 }];
            for p in 0..k {
                tr[p] = r.q_a.values[i * k + p] * r.q_b.values[p * n + j];
                tc[p] = c.q_a.values[i * k + p] * c.q_b.values[p * n + j];
            }
            if aligned.0 {
                for (p, e) in xr.iter_mut().enumerate() {
                    *e = product_exponent(r.q_a.values[i * k + p], r.q_b.values[p * n + j]);
                }
            }
            if aligned.1 {
                for (p, e) in xc.iter_mut().enumerate() {
                    *e = product_exponent(c.q_a.values[i * k + p], c.q_b.values[p * n + j]);
                }
            }
            // Exact values are needed only when the two sides' exact results differ; the
            // magnitude that sets the output spacing is fine from an f64 sum.
            let exact_r = if same_operands {
                tr.iter().sum::<f64>() * r.factor.unwrap_or(1.0)
            } else {
                exact_value(&r, i, j, m, k, n)
            };
            let bias_j = bias_vals.as_ref().map_or(0.0, |b| b[j]);
            let v = exact_r + bias_j;
            let v_sq = v * v * weight as f64;
            if identical {
                return Ok((v_sq, None));
            }
            let offset = if same_operands {
                0.0
            } else {
                exact_value(&c, i, j, m, k, n) - exact_r
            };
            let er = scaled(
                reduction_error_aligned(&tr, aligned.0.then_some(&xr[..]), &r.acc, true)?,
                r.factor.unwrap_or(1.0),
            );
            let ec = scaled(
                reduction_error_aligned(&tc, aligned.1.then_some(&xc[..]), &c.acc, true)?,
                c.factor.unwrap_or(1.0),
            );
            let mut d = ElementDiff::from_reductions(er, ec, offset);
            if !same_operands {
                // Both exact values were rounded to f64 before the subtraction.
                d.bias_bound += (exact_r.abs() + (exact_r + offset).abs()) * f64::EPSILON;
            }
            let (ar, ac) = (r.policy.accumulator(), c.policy.accumulator());
            // The format each side's value is in after the reduction, then after each step.
            let mut cur = (r.acc.order.result_format(ar), c.acc.order.result_format(ac));
            if r.factor.is_some() || c.factor.is_some() {
                // An FP8 rescale multiplies in the accumulator format (only on scaled sides).
                let from = |scaled: bool, f: Format| if scaled { Format::F64 } else { f };
                cur = (
                    from(r.factor.is_some(), cur.0),
                    from(c.factor.is_some(), cur.1),
                );
                round_sides(&mut d, cur, (ar, ac), exact_r);
                cur = (ar.min_with(cur.0), ac.min_with(cur.1));
            }
            if bias_vals.is_some() {
                round_sides(&mut d, (Format::F64, Format::F64), (ar, ac), v);
                cur = (ar, ac);
            }
            check_output(&d, v, (r.policy.output, c.policy.output))?;
            round_sides(&mut d, cur, (r.policy.output, c.policy.output), v);
            Ok((v_sq, Some(d)))
        },
    );
    let mut groups = Vec::with_capacity(pairs.len());
    let mut norm_sq = 0.0;
    for (item, &(_, _, weight)) in priced.into_iter().zip(&pairs) {
        let (v_sq, d) = item?;
        norm_sq += v_sq;
        groups.extend(d.map(|d| (d, weight)));
    }
    let norm = norm_sq.sqrt();
    if identical {
        return Ok(Threshold::identical(confidence, norm, m * n));
    }
    let executable =
        !is_family(&reference.accumulation.order) && !is_family(&candidate.accumulation.order);
    let run = || -> Option<(Vec<f64>, Vec<f64>)> {
        if !executable {
            return None;
        }
        let w = crate::engine::transpose(b, "b").ok()?;
        let one = |p: &Policy| crate::engine::linear(a, &w, bias, p).ok();
        Some((one(reference)?.into_values(), one(candidate)?.into_values()))
    };
    Ok(checked_by_executions(
        confidence,
        &|conf| grouped_threshold(&groups, norm, conf, m * n),
        &run,
    ))
}

/// The exact value f·Σₚ a_ip·b_pj of one side (f its FP8 rescale factor), via the long
/// accumulator.
fn exact_value(s: &Side, i: usize, j: usize, _m: usize, k: usize, n: usize) -> f64 {
    let mut acc = ExactAccumulator::new();
    for p in 0..k {
        acc.add_product(s.q_a.values[i * k + p], s.q_b.values[p * n + j]);
    }
    acc.to_f64() * s.factor.unwrap_or(1.0)
}

/// Threshold for the row sums of x [rows, n] (sum over the last dimension, as
/// `ttrace::sum` computes each under the policy's accumulation, then rounded to the output
/// format), reference vs candidate. With `mean`, each sum is divided by n (one rounding in the
/// accumulator format) before the output rounding. As for [`matmul_threshold`], a
/// probabilistic threshold is checked by the declared executions and falls back to the
/// guaranteed one where they contradict the model.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{sum_threshold, Confidence};
/// use ttrace::{Format, Policy, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// // 8 rows of 1,000 FP32 values: sequential versus pairwise summation.
/// let x = Tensor::rounded(&[8, 1000], (0..8000).map(|i| 1.0 + (i as f64).sqrt()).collect(),
///     Format::F32, ttrace::Overflow::Saturating)?;
/// let seq: Policy = "in=f32,acc=f32,out=f32".parse()?;
/// let pairwise: Policy = "in=f32,acc=f32,out=f32,order=pairwise:8".parse()?;
/// let t = sum_threshold(&x, &seq, &pairwise, false, Confidence::default_probabilistic())?;
/// assert!(t.relative < 1e-5);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// As [`matmul_threshold`]: an invalid policy or confidence, values outside the input format,
/// a rounding that may overflow.
pub fn sum_threshold(
    x: &Tensor,
    reference: &Policy,
    candidate: &Policy,
    mean: bool,
    confidence: Confidence,
) -> Result<Threshold> {
    sum_threshold_priced(x, reference, candidate, mean, confidence, Pricing::Auto)
}

/// [`sum_threshold`] with the pricing method chosen ([`Pricing`]; a sum is priced as the
/// product ones(1 × n)·xᵀ, so [`Pricing::Auto`] takes the fast pass from 2²² summed values,
/// or 2²⁰ in at least 4,096 rows).
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{sum_threshold_priced, Confidence, Pricing};
/// use ttrace::{Format, Policy, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// let x = Tensor::rounded(&[64, 512], (0..32768).map(|i| (i as f64 * 0.37).sin()).collect(),
///     Format::F32, ttrace::Overflow::Saturating)?;
/// let seq: Policy = "in=f32,acc=f32,out=f32".parse()?;
/// let pairwise: Policy = "in=f32,acc=f32,out=f32,order=pairwise:8".parse()?;
/// let conf = Confidence::default_probabilistic();
/// let fast = sum_threshold_priced(&x, &seq, &pairwise, false, conf, Pricing::Fast)?;
/// let walk = sum_threshold_priced(&x, &seq, &pairwise, false, conf, Pricing::Walk)?;
/// // Each side's row sums as the engine computes them (FP32 outputs: no output rounding).
/// let sums = |p: &Policy| -> ttrace::Result<Tensor> {
///     let mut acc = p.accumulation.clone();
///     acc.input = Format::F32;
///     let s = x.values().chunks(512).map(|row| ttrace::sum(row, &acc)).collect::<Result<_, _>>()?;
///     Tensor::from_vec(&[64], s, Format::F32)
/// };
/// let (r, c) = (sums(&seq)?, sums(&pairwise)?);
/// assert!(fast.check(&r, &c).passed && walk.check(&r, &c).passed);
/// assert!(fast.abs_frobenius > 0.0 && fast.abs_frobenius < 2.0 * walk.abs_frobenius);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// As [`sum_threshold`].
pub fn sum_threshold_priced(
    x: &Tensor,
    reference: &Policy,
    candidate: &Policy,
    mean: bool,
    confidence: Confidence,
    pricing: Pricing,
) -> Result<Threshold> {
    reference.validate()?;
    candidate.validate()?;
    let n = *x.shape().last().unwrap_or(&0);
    let rows = x.len().checked_div(n).unwrap_or(0);
    let cast = |p: &Policy| x.cast(p.input(), p.input_overflow(p.input()));
    let (xr, xc) = (cast(reference), cast(candidate));
    let mut accr = reference.accumulation.clone();
    accr.input = reference.input();
    let mut accc = candidate.accumulation.clone();
    accc.input = candidate.input();
    let identical = reference.same_execution(candidate);
    let inv_n = if n > 0 { 1.0 / n as f64 } else { 0.0 };
    let fast = pricing.takes_fast(x.len() as u128, rows);
    if fast && !identical && xr.values() == xc.values() && rows > 0 {
        // ones(1 × n) · xᵀ: exact products, the rows of x as B's columns.
        let exact_products = |acc: &Accumulation| {
            let mut acc = acc.clone();
            acc.products = Products::Exact;
            acc
        };
        let (pr, pc) = (exact_products(&accr), exact_products(&accc));
        let fast = crate::bounds::fast::matmul_threshold_fast(
            &vec![1.0; n],
            Right::Columns(xr.values()),
            if mean {
                Epilogue::Mean(inv_n)
            } else {
                Epilogue::Bias(None)
            },
            (1, n, rows),
            FastSide {
                acc: &pr,
                policy: reference,
            },
            FastSide {
                acc: &pc,
                policy: candidate,
            },
            confidence,
        )?;
        if let Some(t) = fast {
            return Ok(t);
        }
    }
    let exact = |v: &[f64]| {
        let mut e = ExactAccumulator::new();
        e.add_all(v);
        e.to_f64()
    };
    let mut norm_sq = 0.0;
    for row in 0..rows {
        let sr = exact(&xr.values()[row * n..(row + 1) * n]);
        let value = if mean { sr * inv_n } else { sr };
        norm_sq += value * value;
    }
    let norm = norm_sq.sqrt();
    if identical {
        return Ok(Threshold::identical(confidence, norm, rows));
    }
    // Identical rows (as both sides read them) differ identically: one component each.
    let both = side_by_side(xr.values(), n, xc.values(), n);
    let (_, classes) = row_classes(&both, 2 * n);
    // Rows that agree modulo twice the coarsest spacing any partial sum meets round alike:
    // their random parts are one component (near-constant rows that differ by integers).
    let (ar, ac) = (reference.accumulator(), candidate.accumulator());
    let largest = (0..rows)
        .map(|r| {
            let abs = |v: &[f64]| v[r * n..(r + 1) * n].iter().map(|x| x.abs()).sum::<f64>();
            abs(xr.values()).max(abs(xc.values()))
        })
        .fold(0.0, f64::max)
        * 2.0;
    let grid = [
        ar,
        ac,
        accr.order.result_format(ar),
        accc.order.result_format(ac),
        reference.output,
        candidate.output,
    ]
    .iter()
    .filter_map(|f| f.ulp(largest))
    .fold(0.0, f64::max)
        * 2.0;
    let cluster = if grid > 0.0 && grid.is_finite() {
        residue_clusters(&both, 2 * n, grid)
    } else {
        (0..rows).collect()
    };
    // Each class of rows priced alone (in parallel, folded in order below).
    let priced = crate::parallel::map(&classes, |&(row, _)| -> Result<ElementDiff> {
        let vr = &xr.values()[row * n..(row + 1) * n];
        let vc = &xc.values()[row * n..(row + 1) * n];
        let sr = exact(vr);
        let value = if mean { sr * inv_n } else { sr };
        let offset = if vr == vc { 0.0 } else { exact(vc) - sr };
        let mut d = ElementDiff::from_reductions(
            reduction_error(vr, &accr, false)?,
            reduction_error(vc, &accc, false)?,
            offset,
        );
        if offset != 0.0 {
            // Both exact sums were rounded to f64 before the subtraction.
            d.bias_bound += (sr.abs() + (sr + offset).abs()) * f64::EPSILON;
        }
        let (ar, ac) = (reference.accumulator(), candidate.accumulator());
        let mut cur = (accr.order.result_format(ar), accc.order.result_format(ac));
        if mean {
            d.scale(inv_n);
            round_sides(&mut d, (Format::F64, Format::F64), (ar, ac), value);
            cur = (ar, ac);
        }
        check_output(&d, value, (reference.output, candidate.output))?;
        round_sides(&mut d, cur, (reference.output, candidate.output), value);
        Ok(d)
    });
    let mut clusters: Vec<Vec<(ElementDiff, usize)>> = vec![];
    let mut slot = std::collections::HashMap::new();
    for (d, &(row, count)) in priced.into_iter().zip(&classes) {
        let d = d?;
        let next = clusters.len();
        let at = *slot.entry(cluster[row]).or_insert(next);
        if at == next {
            clusters.push(vec![]);
        }
        clusters[at].push((d, count));
    }
    let build = |conf: Confidence| {
        let mut sums = ThresholdSums::new(conf, rows);
        for c in &clusters {
            sums.add_cluster(c);
        }
        sums.threshold(norm)
    };
    let executable = !is_family(&accr.order) && !is_family(&accc.order);
    let run = || -> Option<(Vec<f64>, Vec<f64>)> {
        if !executable {
            return None;
        }
        let side = |p: &Policy, acc: &Accumulation, x: &Tensor| -> Option<Vec<f64>> {
            let ov = acc.overflow;
            x.values()
                .chunks(n.max(1))
                .map(|row| {
                    let s = crate::order::sum(row, acc).ok()?;
                    let v = if mean {
                        p.accumulator().round(s / n as f64, ov)
                    } else {
                        s
                    };
                    Some(p.output.round(v, ov))
                })
                .collect()
        };
        Some((side(reference, &accr, &xr)?, side(candidate, &accc, &xc)?))
    };
    Ok(checked_by_executions(confidence, &build, &run))
}

/// Rows of a [rows, na] and a [rows, nb] array side by side ([rows, na + nb]), so that row
/// classes cover both.
fn side_by_side(a: &[f64], na: usize, b: &[f64], nb: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    for (ra, rb) in a.chunks(na.max(1)).zip(b.chunks(nb.max(1))) {
        out.extend_from_slice(ra);
        out.extend_from_slice(rb);
    }
    out
}

/// Threshold for an all-reduce (sum) of `partials` — p tensors of one shape, one per rank —
/// done in the reference's order versus the candidate's (for example a single-device sum
/// versus a ring all-reduce in BF16): element i is the sum over ranks r of `partials[r][i]`.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{allreduce_threshold, Confidence};
/// use ttrace::{Format, Overflow, Policy, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// // Four ranks' BF16 partial results of one 256-element tensor.
/// let partials = (0..4)
///     .map(|r| Tensor::rounded(&[256], (0..256).map(|i| ((r * 256 + i) as f64).cos()).collect(),
///         Format::BF16, Overflow::Saturating))
///     .collect::<ttrace::Result<Vec<_>>>()?;
/// // Summed in FP32 on one device, against a ring all-reduce in BF16.
/// let reference: Policy = "in=bf16,acc=f32,out=bf16".parse()?;
/// let ring: Policy = "in=bf16,acc=bf16,out=bf16,order=splitk:4:bf16:ring".parse()?;
/// let t = allreduce_threshold(&partials, &reference, &ring, Confidence::default_probabilistic())?;
/// assert!(t.relative > 0.0);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidParameter`] for no partials; [`Error::ShapeMismatch`] for partials of
/// different shapes; otherwise as [`sum_threshold`].
pub fn allreduce_threshold(
    partials: &[Tensor],
    reference: &Policy,
    candidate: &Policy,
    confidence: Confidence,
) -> Result<Threshold> {
    let Some(first) = partials.first() else {
        return Err(Error::InvalidParameter {
            name: "partials",
            reason: "an all-reduce needs at least one partial tensor".into(),
        });
    };
    let len = first.len();
    for (r, p) in partials.iter().enumerate() {
        if p.shape() != first.shape() {
            return Err(Error::ShapeMismatch {
                what: format!("all-reduce: partial of rank {r} has another shape than rank 0"),
                expected: first.shape().to_vec(),
                found: p.shape().to_vec(),
            });
        }
    }
    let p = partials.len();
    let mut stacked = Vec::with_capacity(len * p);
    let mut format = first.format();
    for i in 0..len {
        for part in partials {
            stacked.push(part.values()[i]);
            if !part.format().is_subset_of(format) {
                format = part.format();
            }
        }
    }
    let t = Tensor::from_parts_unchecked(&[len, p], stacked, format);
    sum_threshold(&t, reference, candidate, false, confidence)
}

/// Planning: the threshold for an [m, n] = [m, k]·[k, n] matmul whose entries are i.i.d. with
/// the given statistics, without data. Every element is priced from the expected partial-sum
/// magnitudes; the result is the expected threshold for such data, not a guarantee for a
/// particular tensor (use [`matmul_threshold`] on the data for that). FP8 scaling is not
/// modelled here (the quantized operands depend on the data).
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{plan_matmul, Confidence, MatmulPlan, TermStats};
/// use ttrace::Policy;
///
/// # fn main() -> ttrace::Result<()> {
/// // A 4096³ BF16 GEMM with FP32 accumulation, split-K over 8 ranks all-reduced in BF16.
/// let x = TermStats::normal(0.0, 1.0);
/// let shape = MatmulPlan::new(4096, 4096, 4096, x, x)?;
/// let reference: Policy = "in=bf16,acc=f32,out=bf16".parse()?;
/// let candidate: Policy = "in=bf16,acc=f32,out=bf16,order=splitk:8:bf16:ring".parse()?;
/// let t = plan_matmul(&shape, &reference, &candidate, Confidence::default_probabilistic())?;
/// assert!(t.relative > 0.0 && t.relative < 0.1);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidParameter`](crate::Error::InvalidParameter) for an invalid plan (see
/// [`MatmulPlan::new`]), an invalid policy or confidence; the errors of pricing (a
/// reduction that may overflow its format).
pub fn plan_matmul(
    shape: &MatmulPlan,
    reference: &Policy,
    candidate: &Policy,
    confidence: Confidence,
) -> Result<Threshold> {
    let outputs = shape.outputs()?;
    plan(
        outputs,
        shape.k,
        TermStats::product(shape.a, shape.b),
        true,
        reference,
        candidate,
        confidence,
    )
}

/// An [m, k]·[k, n] matmul described for [`plan_matmul`]: its sizes and the statistics of the
/// entries of A and B.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatmulPlan {
    /// Rows of A and of the output.
    pub m: usize,
    /// The reduction length (columns of A, rows of B).
    pub k: usize,
    /// Columns of B and of the output.
    pub n: usize,
    /// Statistics of A's entries.
    pub a: TermStats,
    /// Statistics of B's entries.
    pub b: TermStats,
}

impl MatmulPlan {
    /// A checked plan.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidParameter`](crate::Error::InvalidParameter) naming `m`, `k` or `n`: a
    /// zero size, a reduction longer than
    /// [`MAX_PLANNED_TERMS`](crate::bounds::MAX_PLANNED_TERMS), or an output whose element
    /// count overflows.
    pub fn new(m: usize, k: usize, n: usize, a: TermStats, b: TermStats) -> Result<MatmulPlan> {
        let p = MatmulPlan { m, k, n, a, b };
        p.outputs()?;
        Ok(p)
    }

    /// The number of output elements, checking the plan.
    fn outputs(&self) -> Result<usize> {
        crate::bounds::reduction::check_planned_length(self.k)?;
        for (name, v) in [("m", self.m), ("n", self.n)] {
            if v == 0 {
                return Err(crate::Error::InvalidParameter {
                    name,
                    reason: "a matmul needs at least one row and one column".into(),
                });
            }
        }
        self.m
            .checked_mul(self.n)
            .ok_or(crate::Error::InvalidParameter {
                name: "n",
                reason: format!("{} x {} output elements overflow", self.m, self.n),
            })
    }
}

/// Planning: the threshold for `rows` sums of `n` i.i.d. values with the given statistics.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{plan_sum, Confidence, TermStats};
/// use ttrace::Policy;
///
/// # fn main() -> ttrace::Result<()> {
/// // 1,024 row sums of 65,536 values ~ N(1, 1): FP32 sequential against blocks of 256.
/// let x = TermStats::normal(1.0, 1.0);
/// let seq: Policy = "in=f32,acc=f32,out=f32".parse()?;
/// let blocked: Policy = "in=f32,acc=f32,out=f32,order=blocked:256".parse()?;
/// let t = plan_sum(1024, 1 << 16, x, &seq, &blocked, Confidence::default_probabilistic())?;
/// assert!(t.relative < 1e-4);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidParameter`] for `n` = 0 or above
/// [`MAX_PLANNED_TERMS`](crate::bounds::MAX_PLANNED_TERMS), an invalid policy or confidence;
/// [`Error::Overflow`] when the expected partial sums may overflow a format.
pub fn plan_sum(
    rows: usize,
    n: usize,
    x: TermStats,
    reference: &Policy,
    candidate: &Policy,
    confidence: Confidence,
) -> Result<Threshold> {
    plan(rows, n, x, false, reference, candidate, confidence)
}

fn plan(
    elements: usize,
    k: usize,
    t: TermStats,
    is_dot: bool,
    reference: &Policy,
    candidate: &Policy,
    confidence: Confidence,
) -> Result<Threshold> {
    reference.validate()?;
    candidate.validate()?;
    crate::bounds::reduction::check_planned_length(k)?;
    let c_sq = k as f64 * t.mean_square + (k as f64) * (k as f64 - 1.0) * t.mean * t.mean;
    let magnitude = c_sq.sqrt();
    let norm = (c_sq * elements as f64).sqrt();
    if reference.same_execution(candidate) {
        return Ok(Threshold::identical(confidence, norm, elements));
    }
    let er = planned_reduction_error(k, t, &reference.accumulation, is_dot)?;
    let ec = planned_reduction_error(k, t, &candidate.accumulation, is_dot)?;
    let mut d = ElementDiff::from_reductions(er, ec, 0.0);
    let (ar, ac) = (reference.accumulator(), candidate.accumulator());
    let cur = (
        reference.accumulation.order.result_format(ar),
        candidate.accumulation.order.result_format(ac),
    );
    round_sides(&mut d, cur, (reference.output, candidate.output), magnitude);
    Ok(tensor_threshold_weighted(
        &[(d, elements)],
        norm,
        confidence,
    ))
}

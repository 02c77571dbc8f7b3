//! Sum, mean and all-reduce thresholds over the last dimension.

use super::*;
use crate::bounds::op::model::{Gain, OpModel, OpOptions, OpSide, Operand, OperandRole};

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
    // A tensor already on a side's input grid is read as it is (no copy).
    let cast = |p: &Policy| {
        if x.format().is_subset_of(p.input()) {
            std::borrow::Cow::Borrowed(x)
        } else {
            std::borrow::Cow::Owned(x.cast(p.input(), p.input_overflow(p.input())))
        }
    };
    let (xr, xc) = (cast(reference), cast(candidate));
    let same_values = || {
        matches!(
            (&xr, &xc),
            (std::borrow::Cow::Borrowed(_), std::borrow::Cow::Borrowed(_))
        ) || xr.values() == xc.values()
    };
    let mut accr = reference.accumulation.clone();
    accr.input = reference.input();
    let mut accc = candidate.accumulation.clone();
    accc.input = candidate.input();
    let identical = reference.same_execution(candidate);
    let inv_n = if n > 0 { 1.0 / n as f64 } else { 0.0 };
    let fast = pricing.takes_fast(x.len() as u128, rows, confidence);
    if fast && !identical && rows > 0 && same_values() {
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
            return crate::bounds::checked::finite(t);
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
    let run = || {
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
        each_member((reference, candidate), |cand, p| {
            let (acc, x) = if cand { (&accc, &xc) } else { (&accr, &xr) };
            let mut acc = acc.clone();
            acc.order = p.accumulation.order.clone();
            side(p, &acc, x)
        })
    };
    checked_by_executions(confidence, &|conf| Ok(build(conf)), &run)
}

/// Rows of a [rows, na] and a [rows, nb] array side by side ([rows, na + nb]), so that row
/// classes cover both.
pub(super) fn side_by_side(a: &[f64], na: usize, b: &[f64], nb: usize) -> Vec<f64> {
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
    let parts: Vec<&Tensor> = partials.iter().collect();
    allreduce_threshold_of(&parts, reference, candidate, confidence)
}

/// [`allreduce_threshold`] on borrowed partials (the op registry's operands).
fn allreduce_threshold_of(
    partials: &[&Tensor],
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
        for part in partials.iter() {
            stacked.push(part.values()[i]);
            if !part.format().is_subset_of(format) {
                format = part.format();
            }
        }
    }
    let t = Tensor::from_parts_unchecked(&[len, p], stacked, format);
    sum_threshold(&t, reference, candidate, false, confidence)
}

/// `sum` and `mean` in the op registry: along the last dimension of `x`; threshold
/// [`sum_threshold_priced`]; gain √k for a sum of k elements per row (Cauchy–Schwarz:
/// |Σⱼ Δxⱼ| ≤ √k·‖Δx‖₂, row by row, exact: the op is linear) and 1/√k for a mean.
#[derive(Debug, Clone, Copy)]
pub struct SumModel {
    /// A mean rather than a sum.
    pub mean: bool,
}

/// `allreduce` in the op registry: the element-wise sum of one `partial` per rank; threshold
/// [`allreduce_threshold`]; gain 1 in any one partial (the op is a sum).
#[derive(Debug, Clone, Copy)]
pub struct AllReduceModel;

impl OpModel for SumModel {
    fn threshold(
        &self,
        inputs: &[&Tensor],
        reference: &OpSide,
        candidate: &OpSide,
        options: &OpOptions,
        confidence: Confidence,
    ) -> Result<Threshold> {
        sum_threshold_priced(
            inputs[0],
            &reference.policy,
            &candidate.policy,
            self.mean,
            confidence,
            options.pricing,
        )
    }

    fn gain(&self, inputs: &[&Tensor], _: &OpOptions) -> Result<Gain> {
        let k = inputs[0].shape().last().copied().unwrap_or(1).max(1) as f64;
        Ok(Gain {
            gain: if self.mean { 1.0 / k.sqrt() } else { k.sqrt() },
        })
    }
}

impl OpModel for AllReduceModel {
    fn operand_names(&self) -> &'static [&'static str] {
        &["partial"]
    }

    fn arity(&self) -> (usize, Option<usize>) {
        (1, None)
    }

    fn operands(&self, m: usize, k: usize, n: usize) -> Vec<Operand> {
        (0..n)
            .map(|r| Operand::new(&format!("partial.{r}"), &[m, k], OperandRole::Data))
            .collect()
    }

    fn threshold(
        &self,
        inputs: &[&Tensor],
        reference: &OpSide,
        candidate: &OpSide,
        _: &OpOptions,
        confidence: Confidence,
    ) -> Result<Threshold> {
        // The operands as they are: the all-reduce stacks them once, without a copy first.
        allreduce_threshold_of(inputs, &reference.policy, &candidate.policy, confidence)
    }

    fn gain(&self, _: &[&Tensor], _: &OpOptions) -> Result<Gain> {
        Ok(Gain { gain: 1.0 })
    }
}

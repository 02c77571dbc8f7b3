//! Thresholds planned from summary statistics of the data (no data at hand): matmuls and
//! sums.

use super::*;

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
    pub(super) fn outputs(&self) -> Result<usize> {
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

pub(super) fn plan(
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

//! Matmul (linear) thresholds, with FP8 quantization: the walk per pair of classes of rows
//! and columns, or the vectorized pass (`bounds::fast`), as [`Pricing`] says.

use super::*;
use crate::bounds::op::model::{Gain, OpModel, OpOptions, OpSide, Operand, OperandRole};
use crate::policy::{quantize_cow, QuantizedCow};
use crate::trace::ModuleKind;

struct Side<'a> {
    pub(super) q_a: QuantizedCow<'a>,
    pub(super) q_b: QuantizedCow<'a>,
    pub(super) acc: Accumulation,
    pub(super) factor: Option<f64>,
    pub(super) policy: Policy,
}

/// One side's operands as it quantizes them (borrowed where that leaves them as they are),
/// B in the layout it is held in.
fn side<'a>(
    a: &'a Tensor,
    b: RightTensor<'a>,
    (m, k, n): (usize, usize, usize),
    policy: &Policy,
) -> Side<'a> {
    let q_a = quantize_cow(a, [m, k], 1, policy.input(), policy, None);
    let q_b = match b {
        RightTensor::Rows(b) => quantize_cow(b, [k, n], 0, policy.rhs(), policy, None),
        // B's columns are the rows of its transpose: blocks still run along k.
        RightTensor::Columns(w) => quantize_cow(w, [n, k], 1, policy.rhs(), policy, None),
    };
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
/// guaranteed threshold needs no model: it is priced by two GEMMs of the operands'
/// magnitudes (a few times one GEMM; papers/bounds-reductions.md §5.1) where the fast path
/// applies, at every size. A
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
    let policies = (reference, candidate);
    priced(
        a,
        RightTensor::Rows(b),
        bias,
        policies,
        confidence,
        (pricing, false),
    )
}

/// B of a product as the caller holds it: [k, n], or its transpose [n, k] (`nn.Linear`'s
/// weight), which the fast paths read as it lies (B's columns) and the walk transposed.
#[derive(Clone, Copy)]
enum RightTensor<'a> {
    Rows(&'a Tensor),
    Columns(&'a Tensor),
}

/// [`matmul_threshold_priced`] for B held either way; `tried`: the pass has already priced
/// (and declined) this request.
fn priced(
    a: &Tensor,
    b: RightTensor,
    bias: Option<&Tensor>,
    (reference, candidate): (&Policy, &Policy),
    confidence: Confidence,
    (pricing, tried): (Pricing, bool),
) -> Result<Threshold> {
    reference.validate()?;
    candidate.validate()?;
    let sa = a.expect_rank(2, "matmul threshold: A")?;
    let (m, k) = (sa[0], sa[1]);
    let (kb, n) = match b {
        RightTensor::Rows(t) => {
            let sb = t.expect_rank(2, "matmul threshold: B")?;
            (sb[0], sb[1])
        }
        RightTensor::Columns(t) => {
            let sw = t.expect_rank(2, "linear threshold: weight")?;
            (sw[1], sw[0])
        }
    };
    if kb != k {
        return Err(Error::ShapeMismatch {
            what: "matmul threshold: inner dimensions of A [m, k] and B [k, n] differ".into(),
            expected: vec![k, n],
            found: vec![kb, n],
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
    let r = side(a, b, (m, k, n), reference);
    let c = side(a, b, (m, k, n), candidate);
    let same_operands = same_values(&r.q_a.values, &c.q_a.values)
        && same_values(&r.q_b.values, &c.q_b.values)
        && r.factor == c.factor;
    let identical = reference.same_execution(candidate);
    let fast = pricing.takes_fast((m as u128) * (k as u128) * (n as u128), m * n, confidence);
    let in_scope = !identical && same_operands && r.factor.is_none() && c.factor.is_none();
    let pass = |confidence: Confidence| {
        crate::bounds::fast::matmul_threshold_fast(
            &r.q_a.values,
            match b {
                RightTensor::Rows(_) => Right::Rows(&r.q_b.values),
                RightTensor::Columns(_) => Right::Columns(&r.q_b.values),
            },
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
    if fast && in_scope && !tried {
        if let Some(t) = pass(confidence)? {
            return crate::bounds::checked::finite(t);
        }
    }
    if let RightTensor::Columns(w) = b {
        // The walk reads B by rows.
        let transposed = crate::engine::transpose(w, "weight")?;
        let policies = (reference, candidate);
        let tried = fast && in_scope;
        return priced(
            a,
            RightTensor::Rows(&transposed),
            bias,
            policies,
            confidence,
            (pricing, tried),
        );
    }
    // Identical rows of A (as both sides quantize them) and identical columns of B (with their
    // bias) give identical output differences: price each pair of classes once.
    let (_, rows) = row_classes(&side_by_side(&r.q_a.values, k, &c.q_a.values, k), 2 * k);
    let column = |q: &QuantizedCow| -> Vec<f64> {
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
            return crate::bounds::checked::finite(t);
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
    let run = || {
        // The engine's linear takes nn.Linear's weight: Bᵀ.
        let w = match b {
            RightTensor::Rows(b) => crate::engine::transpose(b, "b").ok()?,
            RightTensor::Columns(w) => w.clone(),
        };
        each_member((reference, candidate), |_, p| {
            let y = crate::engine::linear(a, &w, bias, p);
            y.ok().map(Tensor::into_values)
        })
    };
    checked_by_executions(
        confidence,
        &|conf| Ok(grouped_threshold(&groups, norm, conf, m * n)),
        &run,
    )
}

/// `a == b` element by element (NaN equal to nothing), in lanes that vectorize.
fn same_values(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len()
        && a.chunks(16)
            .zip(b.chunks(16))
            .all(|(x, y)| x.iter().zip(y).fold(true, |eq, (p, q)| eq & (p == q)))
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

/// `matmul` and `linear` in the op registry. `matmul`: C = A·B (+ bias), operands `a`
/// (m × k), `b` (k × n), an optional `bias` (n). `linear` (`weight_rows`):
/// `torch.nn.functional.linear`, y = x·weightᵀ + bias, operands `x` (m × k), `weight` (n × k)
/// as PyTorch stores it, an optional `bias` (n) — `matmul` on the transposed weight; it prices
/// `linear` modules. Threshold [`matmul_threshold_priced`]; gain in the first operand the
/// second's Frobenius norm ([`matmul_gain`](crate::bounds::matmul_gain); ‖W‖_F = ‖Wᵀ‖_F).
#[derive(Debug, Clone, Copy)]
pub struct MatmulModel {
    /// `linear`: the second operand is the weight as PyTorch stores it, one output per row.
    pub weight_rows: bool,
}

impl OpModel for MatmulModel {
    fn operand_names(&self) -> &'static [&'static str] {
        if self.weight_rows {
            &["x", "weight", "bias"]
        } else {
            &["a", "b", "bias"]
        }
    }

    fn arity(&self) -> (usize, Option<usize>) {
        (2, Some(3))
    }

    fn operands(&self, m: usize, k: usize, n: usize) -> Vec<Operand> {
        let names = self.operand_names();
        let second = if self.weight_rows { [n, k] } else { [k, n] };
        vec![
            Operand::new(names[0], &[m, k], OperandRole::Data),
            Operand::new(names[1], &second, OperandRole::Data),
        ]
    }

    fn threshold(
        &self,
        inputs: &[&Tensor],
        reference: &OpSide,
        candidate: &OpSide,
        options: &OpOptions,
        confidence: Confidence,
    ) -> Result<Threshold> {
        // nn.Linear's weight [n, k] holds B's columns as they lie: the fast paths read it so,
        // the walk transposes it.
        let b = if self.weight_rows {
            RightTensor::Columns(inputs[1])
        } else {
            RightTensor::Rows(inputs[1])
        };
        priced(
            inputs[0],
            b,
            inputs.get(2).copied(),
            (&reference.policy, &candidate.policy),
            confidence,
            (options.pricing, false),
        )
    }

    fn gain(&self, inputs: &[&Tensor], _: &OpOptions) -> Result<Gain> {
        Ok(crate::bounds::matmul_gain(inputs[1]))
    }

    fn module_kinds(&self) -> &'static [ModuleKind] {
        if self.weight_rows {
            &[ModuleKind::Linear]
        } else {
            &[]
        }
    }
}

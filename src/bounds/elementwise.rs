//! Elementwise ops, FP8 quantization, and first-order propagation of input differences.
//!
//! * [`elementwise_threshold`]: reference vs candidate for add, scale, GELU, SiLU and exp, which
//!   the engine computes as ro(ra(v)) with v the exact (or `f64`) value of the op on the
//!   side's inputs. Identical arithmetic gives zero. Add and scale are correctly rounded
//!   operations on exact operands, so each side's result follows from the data and the
//!   difference is computed exactly (issue 16's determined roundings; the zoo found BF16 sums
//!   that tie half the time, beyond any independent-rounding model). For GELU, SiLU and exp,
//!   whose f64 evaluation may differ by an ulp between libraries, each side's chain of
//!   roundings is priced with the rules of `compare` (offsets when the sides' values differ, nearly equal
//!   roundings, snaps, independent roundings). A rounding error here is a deterministic
//!   function of the element's inputs, and low-precision inputs repeat (a BF16 tensor in
//!   [0, 1) has about a thousand distinct values): elements with identical inputs are one
//!   component of weight √count, not count independent ones.
//! * [`quantization_error`]: the error FP8 quantization introduces, per element.
//! * [`Gain`] and the `*_gain` functions: how a difference already present in the inputs is
//!   carried to the output, to first order, so thresholds compose along a network:
//!   ‖Δout‖ ≤ introduced + gain·‖Δin‖ (papers/bounds-elementwise.md).

use crate::bounds::checked::{checked_by_executions, each_member, Executions};
use serde::Serialize;

use crate::bounds::compare::{grouped_threshold, Confidence, ElementDiff, Threshold};
use crate::bounds::op::model::{Gain, OpModel, OpOptions, OpSide};
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use crate::policy::quantize;
use crate::policy::{gelu_f64, gelu_grad_f64};
use crate::policy::{Policy, Scaling};
use crate::tensor::Tensor;
use crate::trace::ModuleKind;

/// An elementwise op as the engine computes it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum Elementwise {
    /// x + y (the second operand is passed to [`elementwise_threshold`]).
    Add,
    /// c·x, with c rounded to the accumulator first.
    Scale {
        /// The constant.
        c: f64,
    },
    /// GELU, tanh form.
    Gelu,
    /// SiLU.
    Silu,
    /// exp(x).
    Exp,
}

/// The side's exact pre-rounding value of the op on element i.
fn side_value(op: Elementwise, x: f64, y: f64, policy: &Policy) -> f64 {
    match op {
        Elementwise::Add => x + y,
        Elementwise::Scale { c } => x * policy.accumulator().round(c, policy.accumulation.overflow),
        Elementwise::Gelu => gelu_f64(x),
        Elementwise::Silu => x / (1.0 + (-x).exp()),
        Elementwise::Exp => x.exp(),
    }
}

/// Threshold for an elementwise op computed under `reference` and `candidate` on the same
/// inputs `x` (and `y` for [`Elementwise::Add`], same shape).
///
/// A probabilistic threshold is checked first by the engine's executions of both sides: where
/// their difference exceeds the model's threshold at δ_s = min(δ, 10⁻³) (the norm or one
/// element), the data carry structure the model does not capture and the guaranteed threshold
/// is returned, its `confidence` saying so (papers/bounds-reductions.md §4).
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{elementwise_threshold, Confidence, Elementwise};
/// use ttrace::{Format, Policy, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// let x = Tensor::rounded(&[64], (0..64).map(|i| i as f64 / 16.0 - 2.0).collect(),
///     Format::BF16, ttrace::Overflow::Saturating)?;
/// // GELU evaluated in FP32 against GELU evaluated in BF16, both with BF16 outputs.
/// let r: Policy = "in=bf16,acc=f32,out=bf16".parse()?;
/// let c: Policy = "in=bf16,acc=bf16,out=bf16".parse()?;
/// let t = elementwise_threshold(Elementwise::Gelu, &x, None, &r, &c, Confidence::Guaranteed)?;
/// // |x| <= 2 here: a few BF16 ulps of outputs below 2 at most.
/// assert!(t.per_element > 0.0 && t.per_element < 0.1);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::ShapeMismatch`] for a `y` of another shape (or missing for `Add`);
/// [`Error::InvalidParameter`] for a scale that is not finite, an invalid policy or
/// confidence; [`Error::Overflow`] when a rounding may overflow.
pub fn elementwise_threshold(
    op: Elementwise,
    x: &Tensor,
    y: Option<&Tensor>,
    reference: &Policy,
    candidate: &Policy,
    confidence: Confidence,
) -> Result<Threshold> {
    let build = |conf| elementwise_model(op, x, y, (reference, candidate), conf);
    checked_by_executions(confidence, &build, &|| {
        executions(op, x, y, reference, candidate)
    })
}

/// Both sides' results as the engine executes them (for every member of a family), `None`
/// where it cannot (an engine error).
pub(crate) fn executions(
    op: Elementwise,
    x: &Tensor,
    y: Option<&Tensor>,
    reference: &Policy,
    candidate: &Policy,
) -> Option<Executions> {
    each_member((reference, candidate), |_, p| {
        let out = match (op, y) {
            (Elementwise::Add, Some(y)) => crate::engine::add(x, y, p),
            (Elementwise::Scale { c }, _) => crate::engine::scale(x, c, p),
            (Elementwise::Gelu, _) => crate::engine::gelu(x, p),
            (Elementwise::Silu, _) => crate::engine::silu(x, p),
            (Elementwise::Exp, _) => crate::engine::exp(x, p),
            // Add without its second operand (refused by the model before this runs).
            (Elementwise::Add, None) => return None,
        };
        out.ok().map(Tensor::into_values)
    })
}

/// [`elementwise_threshold`] as the model prices it (not checked by the executions).
fn elementwise_model(
    op: Elementwise,
    x: &Tensor,
    y: Option<&Tensor>,
    (reference, candidate): (&Policy, &Policy),
    confidence: Confidence,
) -> Result<Threshold> {
    reference.validate()?;
    candidate.validate()?;
    if let Elementwise::Scale { c } = op {
        if !c.is_finite() {
            return Err(Error::NonFinite {
                what: "scale constant".into(),
                value: c,
            });
        }
    }
    let y = match (op, y) {
        (Elementwise::Add, Some(y)) if y.shape() == x.shape() => Some(y),
        (Elementwise::Add, Some(y)) => {
            return Err(Error::ShapeMismatch {
                what: "elementwise add threshold: operand shapes differ".into(),
                expected: x.shape().to_vec(),
                found: y.shape().to_vec(),
            })
        }
        (Elementwise::Add, None) => {
            return Err(Error::InvalidParameter {
                name: "y",
                reason: "add needs a second operand".into(),
            })
        }
        _ => None,
    };
    let cast = |t: &Tensor, p: &Policy| t.cast(p.input(), p.input_overflow(p.input()));
    let (xr, xc) = (cast(x, reference), cast(x, candidate));
    let (yr, yc) = match y {
        Some(y) => (Some(cast(y, reference)), Some(cast(y, candidate))),
        None => (None, None),
    };
    let identical = reference == candidate;
    // Elements with identical inputs have identical differences: group them, so that one
    // distinct input is one independent component (weight √count in the norm).
    let mut groups: crate::bounds::keyed::DataMap<(u64, u64), (usize, usize)> = Default::default();
    let mut order = vec![];
    let mut norm_sq = 0.0;
    for i in 0..x.len() {
        let key = (
            x.values()[i].to_bits(),
            y.map_or(0, |t| t.values()[i].to_bits()),
        );
        let e = groups.entry(key).or_insert_with(|| {
            order.push(i);
            (i, 0)
        });
        e.1 += 1;
    }
    let (ar, ac) = (reference.accumulator(), candidate.accumulator());
    let mut grouped = Vec::with_capacity(order.len());
    for &i in &order {
        let count = groups[&(
            x.values()[i].to_bits(),
            y.map_or(0, |t| t.values()[i].to_bits()),
        )]
            .1;
        let yri = yr.as_ref().map_or(0.0, |t| t.values()[i]);
        let yci = yc.as_ref().map_or(0.0, |t| t.values()[i]);
        let vr = side_value(op, xr.values()[i], yri, reference);
        let vc = side_value(op, xc.values()[i], yci, candidate);
        if !vr.is_finite() || !vc.is_finite() {
            return Err(Error::NonFinite {
                what: format!("elementwise threshold: the op's value at element {i}"),
                value: if vr.is_finite() { vc } else { vr },
            });
        }
        norm_sq += vr * vr * count as f64;
        if identical {
            continue;
        }
        if matches!(op, Elementwise::Add | Elementwise::Scale { .. }) {
            // Correctly rounded operations on exact operands: each side's result is determined
            // by the data (the engine computes ro(ra(x + y)) and ro(ra(x·ra(c))) exactly), so
            // the difference is computed, not modelled — a BF16 sum of two BF16 values ties
            // half the time, which no independent-rounding model prices right.
            let result = |p: &Policy, x: f64, y: f64| {
                let ar = crate::policy::arith::Arith::new(
                    p.accumulator(),
                    p.output,
                    p.accumulation.overflow,
                );
                ar.ro(match op {
                    Elementwise::Scale { c } => ar.mul(x, ar.ra(c)),
                    _ => ar.add(x, y),
                })
            };
            let rr = result(reference, xr.values()[i], yri);
            let rc = result(candidate, xc.values()[i], yci);
            for (r, f) in [(rr, reference.output), (rc, candidate.output)] {
                if !r.is_finite() || r.abs() > f.max_finite() {
                    return Err(crate::bounds::reduction::overflow_error(
                        f,
                        vr.abs().max(vc.abs()),
                        "an output element",
                    ));
                }
            }
            // Slack for the f64 arithmetic of a norm of these differences, summed in any order
            // (relative (n + 8)·ε, a few 1e-12 at a million elements): the threshold is the
            // determined difference itself.
            let slack = (rc - rr).abs() * (x.len() as f64 + 8.0) * f64::EPSILON;
            let d = ElementDiff {
                offset: rc - rr,
                guaranteed: (rc - rr).abs() + slack,
                bias_bound: slack,
                ..ElementDiff::default()
            };
            grouped.push((d, count));
            continue;
        }
        let mut d = ElementDiff {
            offset: vc - vr,
            guaranteed: (vc - vr).abs(),
            ..ElementDiff::default()
        };
        // The f64 evaluation of a transcendental may be off by an ulp of f64 on either side.
        if matches!(op, Elementwise::Gelu | Elementwise::Silu | Elementwise::Exp) {
            d.guaranteed += 2.0 * Format::F64.ulp(vr).unwrap_or(0.0);
        }
        crate::bounds::ops::round_sides(&mut d, (Format::F64, Format::F64), (ar, ac), vr);
        crate::bounds::ops::round_sides(&mut d, (ar, ac), (reference.output, candidate.output), vr);
        grouped.push((d, count));
    }
    let norm = norm_sq.sqrt();
    if identical {
        return Ok(Threshold::identical(confidence, norm, x.len()));
    }
    Ok(grouped_threshold(&grouped, norm, confidence, x.len()))
}

/// Error statistics of FP8 quantization of a tensor: the largest |x̂ − x| and the model's
/// Σ E(x̂ − x)² (each element's rounding uniform within its grid spacing, saturation exact).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct QuantizationError {
    /// max |x̂ᵢ − xᵢ| over the tensor (exact: computed from the quantized values).
    pub max_abs: f64,
    /// The exact ‖x̂ − x‖_F.
    pub frobenius: f64,
    /// The a-priori bound Σ (spacingᵢ/2)² + saturation, square-rooted: what one can say
    /// without quantizing (u_fp8·|x| relative in the normal range, half the subnormal spacing
    /// (scaled) below it).
    pub bound_frobenius: f64,
}

/// The error of quantizing the 2-D tensor `x` (reduction along `axis` for block scaling) to
/// `fp8` with `scaling`, as [`quantize`](crate::engine::quantize) does (dequantized values
/// compared with x). Per element the a-priori bound is |x̂ − x| ≤ max(u·|x|, η/(2s)) with u the
/// FP8 unit roundoff, η its smallest subnormal and s the scale, unless the element saturates.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::quantization_error;
/// use ttrace::{Format, Scaling, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// let x = Tensor::from_vec(&[2, 4], vec![0.1, -3.0, 250.0, 7.5, 1e-3, 0.0, -42.0, 1.0], Format::F64)?;
/// let q = quantization_error(&x, 1, Format::E4M3, Scaling::PerTensorCurrent { margin: 0 })?;
/// // amax 250 is scaled to E4M3's 448: every element keeps a relative error of at most
/// // u = 2^-4, except those that fall below the normal range after scaling.
/// assert!(q.max_abs <= 250.0 / 16.0);
/// assert!(q.frobenius <= q.bound_frobenius);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::ShapeMismatch`] for a tensor that is not 2-D; [`Error::InvalidParameter`] for an
/// axis other than 0 or 1.
pub fn quantization_error(
    x: &Tensor,
    axis: usize,
    fp8: Format,
    scaling: Scaling,
) -> Result<QuantizationError> {
    let s = x.expect_rank(2, "quantization error")?;
    if axis > 1 {
        return Err(Error::InvalidParameter {
            name: "axis",
            reason: format!("a 2-D tensor has axes 0 and 1 (got {axis})"),
        });
    }
    let q = quantize(
        x.values(),
        [s[0], s[1]],
        axis,
        fp8,
        scaling,
        None,
        Overflow::Saturating,
    );
    let u = fp8.unit_roundoff();
    let (mut max_abs, mut fro, mut bound) = (0.0f64, 0.0, 0.0);
    for (&xv, &qv) in x.values().iter().zip(&q.values) {
        let deq = qv * q.scale_inv;
        let err = (deq - xv).abs();
        max_abs = max_abs.max(err);
        fro += err * err;
        // Effective scale of this element: x̂ = q/s with s = 1/scale_inv (per tensor), or
        // the block's power of two (already folded into q for MX).
        let scale = if q.scale_inv != 1.0 {
            1.0 / q.scale_inv
        } else {
            1.0
        };
        let saturated = (xv * scale).abs() > fp8.max_finite() && q.scale_inv != 1.0;
        let b = if saturated {
            err
        } else {
            (u * xv.abs()).max(fp8.min_subnormal() / (2.0 * scale)) * (1.0 + 1e-12)
        };
        bound += b * b;
    }
    Ok(QuantizationError {
        max_abs,
        frobenius: fro.sqrt(),
        bound_frobenius: bound.sqrt(),
    })
}

/// C = A·B: ‖ΔA·B‖_F ≤ ‖ΔA‖_F·‖B‖₂ ≤ ‖ΔA‖_F·‖B‖_F (the Frobenius norm bounds the spectral
/// norm; Higham 2002, §6.2). Returns the Frobenius form.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::matmul_gain;
/// use ttrace::{Format, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// let b = Tensor::from_vec(&[3, 2], vec![1.0, -2.0, 0.5, 4.0, -3.0, 1.0], Format::F64)?;
/// // A difference ΔA of the left operand (2×3), multiplied out by hand.
/// let da = [1e-3, -2e-3, 5e-4, 0.0, 1e-3, -1e-3];
/// let bv = b.values();
/// let dc: Vec<f64> = (0..2)
///     .flat_map(|i| (0..2).map(move |j| (0..3).map(|k| da[i * 3 + k] * bv[k * 2 + j]).sum::<f64>()))
///     .collect();
/// let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
/// assert!(norm(&dc) <= matmul_gain(&b).gain * norm(&da));
/// # Ok(())
/// # }
/// ```
pub fn matmul_gain(b: &Tensor) -> Gain {
    Gain {
        gain: b.values().iter().map(|v| v * v).sum::<f64>().sqrt(),
    }
}

/// Elementwise ops: the Lipschitz constant of the op over the given inputs (for GELU and SiLU
/// the maximum of |f'| over the interval the inputs span, widened by `slack`, evaluated on a
/// grid and inflated by 1% — GELU′ ≤ 1.13, SiLU′ ≤ 1.10 everywhere; for exp, max e^x·e^slack).
/// `Add` and `Scale { c }` have gains 1 and |c|.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{elementwise_gain, Elementwise};
/// use ttrace::{Format, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// let x = Tensor::from_vec(&[4], vec![-2.0, -0.5, 0.25, 1.5], Format::F64)?;
/// let g = elementwise_gain(Elementwise::Exp, &x, 0.01).gain;
/// // Moving each input by at most the slack moves exp by at most g times as much.
/// for &v in x.values() {
///     assert!((v.exp() - (v + 0.01).exp()).abs() <= g * 0.01);
/// }
/// # Ok(())
/// # }
/// ```
pub fn elementwise_gain(op: Elementwise, x: &Tensor, slack: f64) -> Gain {
    let (lo, hi) = x
        .values()
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &v| {
            (l.min(v), h.max(v))
        });
    let (lo, hi) = (lo - slack, hi + slack);
    let scan = |f: &dyn Fn(f64) -> f64| -> f64 {
        if !(lo.is_finite() && hi.is_finite()) {
            return 0.0;
        }
        let steps = 4096;
        (0..=steps)
            .map(|k| f(lo + (hi - lo) * k as f64 / steps as f64).abs())
            .fold(0.0, f64::max)
            * 1.01
    };
    let gain = match op {
        Elementwise::Add => 1.0,
        Elementwise::Scale { c } => c.abs(),
        Elementwise::Gelu => scan(&gelu_grad_f64).min(1.13),
        Elementwise::Silu => scan(&|v: f64| {
            let s = 1.0 / (1.0 + (-v).exp());
            s * (1.0 + v * (1.0 - s))
        })
        .min(1.10),
        Elementwise::Exp => hi.exp(),
    };
    Gain { gain }
}

/// Softmax along the last dimension: the Jacobian diag(p) − ppᵀ of each row is positive
/// semidefinite and below diag(p), so ‖Δp‖₂ ≤ max pᵢ·‖Δz‖₂ per row (to first order). Returns
/// the largest max pᵢ over the rows of the given probabilities.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::softmax_gain;
/// use ttrace::{Format, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// let softmax = |z: &[f64]| {
///     let e: Vec<f64> = z.iter().map(|v| v.exp()).collect();
///     let s: f64 = e.iter().sum();
///     e.into_iter().map(|v| v / s).collect::<Vec<f64>>()
/// };
/// let z = [0.3, -1.2, 2.0, 0.7];
/// let dz = [1e-6, -2e-6, 5e-7, 3e-6];
/// let p = softmax(&z);
/// let moved = softmax(&[z[0] + dz[0], z[1] + dz[1], z[2] + dz[2], z[3] + dz[3]]);
/// let dp: f64 = p.iter().zip(&moved).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt();
/// let g = softmax_gain(&Tensor::from_vec(&[1, 4], p, Format::F64)?).gain;
/// // First order: a second-order term of order ‖Δz‖² is all that may exceed g·‖Δz‖.
/// let norm_dz = dz.iter().map(|v| v * v).sum::<f64>().sqrt();
/// assert!(dp <= g * norm_dz + norm_dz * norm_dz);
/// # Ok(())
/// # }
/// ```
pub fn softmax_gain(probabilities: &Tensor) -> Gain {
    Gain {
        gain: probabilities
            .values()
            .iter()
            .fold(0.0, |m: f64, &p| m.max(p)),
    }
}

/// LayerNorm / RMSNorm: ‖Δy‖ ≤ max|γ|·rstd·‖Δx‖ per row to first order (the Jacobian is
/// γ·rstd times an orthogonal projection); returns max|γ|·max rstd.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::norm_gain;
/// use ttrace::{Format, Tensor};
///
/// # fn main() -> ttrace::Result<()> {
/// // RMSNorm of one row, by hand: yᵢ = γᵢ·xᵢ·rstd, rstd = 1/√(mean x² + ε).
/// let gamma = [0.5, -1.5, 1.0, 2.0];
/// let rms = |x: &[f64]| -> (Vec<f64>, f64) {
///     let rstd = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / 4.0 + 1e-5).sqrt();
///     (x.iter().zip(&gamma).map(|(v, g)| g * v * rstd).collect(), rstd)
/// };
/// let x = [1.0, -2.0, 0.5, 3.0];
/// let dx = [1e-6, 2e-6, -1e-6, 0.0];
/// let (y, rstd) = rms(&x);
/// let (moved, _) = rms(&[x[0] + dx[0], x[1] + dx[1], x[2] + dx[2], x[3] + dx[3]]);
/// let dy: f64 = y.iter().zip(&moved).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt();
/// let g = norm_gain(&Tensor::from_vec(&[4], gamma.to_vec(), Format::F64)?, &[rstd]).gain;
/// let norm_dx = dx.iter().map(|v| v * v).sum::<f64>().sqrt();
/// assert!(dy <= g * norm_dx * (1.0 + 1e-3));
/// # Ok(())
/// # }
/// ```
pub fn norm_gain(weight: &Tensor, rstd: &[f64]) -> Gain {
    let g = weight
        .values()
        .iter()
        .fold(0.0, |m: f64, &v| m.max(v.abs()));
    let r = rstd.iter().fold(0.0, |m: f64, &v| m.max(v));
    Gain { gain: g * r }
}

/// An elementwise op in the op registry: `add` (operands `x`, `y`), `scale:C`, `gelu`, `silu`,
/// `exp` (operand `x`); threshold [`elementwise_threshold`]; gain [`elementwise_gain`] in `x`
/// over the span of its values (1 for `add`, |C| for `scale:C`). `add` prices `residual`
/// modules, `gelu` and `silu` `activation` modules.
#[derive(Debug, Clone, Copy)]
pub struct ElementwiseModel(pub Elementwise);

impl OpModel for ElementwiseModel {
    fn operand_names(&self) -> &'static [&'static str] {
        match self.0 {
            Elementwise::Add => &["x", "y"],
            _ => &["x"],
        }
    }

    fn threshold(
        &self,
        inputs: &[&Tensor],
        reference: &OpSide,
        candidate: &OpSide,
        _: &OpOptions,
        confidence: Confidence,
    ) -> Result<Threshold> {
        elementwise_threshold(
            self.0,
            inputs[0],
            inputs.get(1).copied(),
            &reference.policy,
            &candidate.policy,
            confidence,
        )
    }

    fn gain(&self, inputs: &[&Tensor], _: &OpOptions) -> Result<Gain> {
        Ok(elementwise_gain(self.0, inputs[0], 0.0))
    }

    fn module_kinds(&self) -> &'static [ModuleKind] {
        match self.0 {
            Elementwise::Add => &[ModuleKind::Residual],
            Elementwise::Gelu | Elementwise::Silu => &[ModuleKind::Activation],
            Elementwise::Scale { .. } | Elementwise::Exp => &[],
        }
    }
}

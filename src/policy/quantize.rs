//! Preparing an operand for a reduction: rounding to its input format, or FP8 quantization
//! under the policy's [`Scaling`].

use crate::format::{Format, Overflow};
use crate::policy::{per_tensor_scale, Policy, Scaling};
use crate::tensor::Tensor;

/// An operand ready for the reduction: values (row-major, same shape as the input) and the
/// inverse per-tensor scale to apply after accumulation (1 when there is none).
#[derive(Debug, Clone)]
pub struct Quantized {
    /// The values that enter the products: plain input-format values, FP8 codes' values for
    /// per-tensor scaling, or exactly dequantized values for block scaling.
    pub values: Vec<f64>,
    /// s⁻¹ in FP32 for per-tensor scaling; 1 otherwise.
    pub scale_inv: f64,
    /// Format containing every element of `values`.
    pub format: Format,
}

/// Prepare a 2-D operand of shape `shape` for a reduction along `axis` (1 for the left operand,
/// 0 for the right one) under the input format `fmt` and the policy's scaling.
///
/// * No scaling, or a non-FP8 format: x ↦ fl_fmt(x).
/// * Per-tensor current / delayed scaling: s = `scale` if given (delayed) or
///   [`per_tensor_scale`]`(amax(x))`; q = sat_fp8(fl32(x·s)); the matmul multiplies the
///   accumulated result by s⁻¹ = fl32(1/s).
/// * Block scaling (MX): for each run of `size` consecutive elements along `axis`,
///   X = 2^(⌊log2 amax⌋ − e_max(fp8)) (X = 1 for an all-zero block) and x̂ = sat_fp8(x / X)·X,
///   which is exact; no scale is applied afterwards.
pub fn quantize(
    values: &[f64],
    shape: [usize; 2],
    axis: usize,
    fmt: Format,
    scaling: Scaling,
    scale: Option<f64>,
    overflow: Overflow,
) -> Quantized {
    let is_fp8 = matches!(fmt, Format::E4M3 | Format::E5M2);
    match scaling {
        Scaling::PerTensorCurrent { margin } | Scaling::PerTensorDelayed { margin } if is_fp8 => {
            let amax = values.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let s = scale.unwrap_or_else(|| per_tensor_scale(amax, fmt, margin));
            let q: Vec<f64> = values
                .iter()
                .map(|&x| {
                    fmt.round(
                        Format::F32.round(x * s, Overflow::Saturating),
                        Overflow::Saturating,
                    )
                })
                .collect();
            let scale_inv = Format::F32.round(1.0 / s, Overflow::Saturating);
            Quantized {
                values: q,
                scale_inv,
                format: fmt,
            }
        }
        Scaling::Block { size } if is_fp8 => {
            let [rows, cols] = shape;
            let mut out = vec![0.0; values.len()];
            let len_along = if axis == 1 { cols } else { rows };
            let lines = if axis == 1 { rows } else { cols };
            let at = |line: usize, pos: usize| {
                if axis == 1 {
                    line * cols + pos
                } else {
                    pos * cols + line
                }
            };
            let size = size.max(1);
            for line in 0..lines {
                let mut start = 0;
                while start < len_along {
                    let end = (start + size).min(len_along);
                    let amax = (start..end).fold(0.0f64, |m, p| m.max(values[at(line, p)].abs()));
                    let x_scale = if amax > 0.0 && amax.is_finite() {
                        2f64.powi(amax.log2().floor() as i32 - fmt.emax())
                    } else {
                        1.0
                    };
                    for p in start..end {
                        let i = at(line, p);
                        out[i] = fmt.round(values[i] / x_scale, Overflow::Saturating) * x_scale;
                    }
                    start = end;
                }
            }
            Quantized {
                values: out,
                scale_inv: 1.0,
                format: Format::F32,
            }
        }
        _ => {
            let mut v = values.to_vec();
            fmt.round_slice(&mut v, overflow);
            Quantized {
                values: v,
                scale_inv: 1.0,
                format: fmt,
            }
        }
    }
}

/// [`quantize`] without copying when there is nothing to do: the operand's values already
/// belong to `fmt` (its format is a subset, and no infinity would be saturated) and no FP8
/// scaling applies — then [`quantize`] would return the same values.
pub(crate) fn quantize_cow<'a>(
    t: &'a Tensor,
    shape: [usize; 2],
    axis: usize,
    fmt: Format,
    policy: &Policy,
    scale: Option<f64>,
) -> QuantizedCow<'a> {
    let scaled = matches!(fmt, Format::E4M3 | Format::E5M2) && policy.scaling != Scaling::None;
    // Saturation would move infinities; otherwise rounding values of a subset is the identity.
    let identity = t.format().is_subset_of(fmt)
        && (policy.input_overflow(fmt) == Overflow::NonSaturating
            || t.values().iter().all(|x| x.is_finite()));
    if !scaled && identity {
        return QuantizedCow {
            values: std::borrow::Cow::Borrowed(t.values()),
            scale_inv: 1.0,
            format: fmt,
        };
    }
    let q = quantize(
        t.values(),
        shape,
        axis,
        fmt,
        policy.scaling,
        scale,
        policy.input_overflow(fmt),
    );
    QuantizedCow {
        values: std::borrow::Cow::Owned(q.values),
        scale_inv: q.scale_inv,
        format: q.format,
    }
}

/// A [`Quantized`] operand that borrows the tensor's values where quantizing leaves them as
/// they are.
pub(crate) struct QuantizedCow<'a> {
    /// As [`Quantized::values`].
    pub(crate) values: std::borrow::Cow<'a, [f64]>,
    /// As [`Quantized::scale_inv`].
    pub(crate) scale_inv: f64,
    /// As [`Quantized::format`].
    pub(crate) format: Format,
}

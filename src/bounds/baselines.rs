//! The folklore tolerances the field uses, for side-by-side reports.
//!
//! * PyTorch `torch.testing.assert_close` defaults (`torch/testing/_comparison.py`,
//!   `_DTYPE_PRECISIONS`): elementwise |cand − ref| ≤ atol + rtol·|ref| with
//!   F16 (rtol 1e-3, atol 1e-5), BF16 (1.6e-2, 1e-5), F32 (1.3e-6, 1e-5), F64 (1e-7, 1e-7).
//!   FP8 has no entry (PyTorch compares FP8 bitwise).
//! * TransformerEngine's FP8 test tolerances (`tests/pytorch/utils.py`, `dtype_tols`):
//!   E4M3 (rtol 0.125, atol 0.0675), E5M2 (0.25, 0.125).
//! * Megatron-LM's adoption of TTrace (`test_optimizer_grads_match.py`, "theorem 5.3 of arXiv
//!   2506.09280"): a relative Frobenius threshold k·C^(L+1−l)·ε with k = 4, C = 1.03, ε the
//!   machine epsilon of the dtype and L + 1 − l the depth below the top layer.

use serde::Serialize;

use crate::format::Format;

/// A baseline tolerance.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Baseline {
    /// Where it comes from.
    pub name: String,
    /// How it judges a pair of tensors.
    pub rule: BaselineRule,
}

/// How a baseline judges.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "rule")]
pub enum BaselineRule {
    /// Every element: |cand − ref| ≤ atol + rtol·|ref|.
    Elementwise {
        /// Relative tolerance.
        rtol: f64,
        /// Absolute tolerance.
        atol: f64,
    },
    /// The tensor: ‖cand − ref‖_F ≤ tol·‖ref‖_F.
    RelativeFrobenius {
        /// The relative tolerance.
        tol: f64,
    },
    /// Bitwise equality (PyTorch's rule for FP8).
    Bitwise,
}

impl Baseline {
    /// Whether the baseline accepts `candidate` against `reference` (same length; NaN fails).
    pub fn accepts(&self, reference: &[f64], candidate: &[f64]) -> bool {
        if reference.len() != candidate.len() {
            return false;
        }
        match self.rule {
            BaselineRule::Elementwise { rtol, atol } => reference
                .iter()
                .zip(candidate)
                .all(|(r, c)| (c - r).abs() <= atol + rtol * r.abs()),
            BaselineRule::RelativeFrobenius { tol } => {
                let (mut d, mut n) = (0.0, 0.0);
                for (r, c) in reference.iter().zip(candidate) {
                    d += (c - r) * (c - r);
                    n += r * r;
                }
                d.sqrt() <= tol * n.sqrt()
            }
            BaselineRule::Bitwise => reference
                .iter()
                .zip(candidate)
                .all(|(r, c)| r.to_bits() == c.to_bits()),
        }
    }

    /// The relative Frobenius tolerance this baseline implies for a tensor (for tables):
    /// exact for the Frobenius rule, rtol for elementwise rules (ignoring atol), 0 for bitwise.
    pub fn nominal_relative(&self) -> f64 {
        match self.rule {
            BaselineRule::Elementwise { rtol, .. } => rtol,
            BaselineRule::RelativeFrobenius { tol } => tol,
            BaselineRule::Bitwise => 0.0,
        }
    }
}

/// PyTorch `assert_close` defaults for a tensor of `format`.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{torch_assert_close, BaselineRule};
/// use ttrace::Format;
///
/// // BF16: rtol 1.6e-2, atol 1e-5, elementwise |c − r| ≤ atol + rtol·|r|.
/// let b = torch_assert_close(Format::BF16);
/// assert_eq!(b.rule, BaselineRule::Elementwise { rtol: 1.6e-2, atol: 1e-5 });
/// assert!(b.accepts(&[100.0], &[101.0]));
/// assert!(!b.accepts(&[100.0], &[102.0]));
/// ```
pub fn torch_assert_close(format: Format) -> Baseline {
    let rule = match format {
        Format::F16 => BaselineRule::Elementwise {
            rtol: 1e-3,
            atol: 1e-5,
        },
        Format::BF16 => BaselineRule::Elementwise {
            rtol: 1.6e-2,
            atol: 1e-5,
        },
        Format::F32 | Format::TF32 => BaselineRule::Elementwise {
            rtol: 1.3e-6,
            atol: 1e-5,
        },
        Format::F64 => BaselineRule::Elementwise {
            rtol: 1e-7,
            atol: 1e-7,
        },
        Format::E4M3 | Format::E5M2 => BaselineRule::Bitwise,
    };
    Baseline {
        name: format!("torch.testing.assert_close({})", format.name()),
        rule,
    }
}

/// TransformerEngine's FP8 tolerances (`None` for non-FP8 formats).
pub fn transformer_engine_fp8(format: Format) -> Option<Baseline> {
    let rule = match format {
        Format::E4M3 => BaselineRule::Elementwise {
            rtol: 0.125,
            atol: 0.0675,
        },
        Format::E5M2 => BaselineRule::Elementwise {
            rtol: 0.25,
            atol: 0.125,
        },
        _ => return None,
    };
    Some(Baseline {
        name: format!("TransformerEngine dtype_tols({})", format.name()),
        rule,
    })
}

/// Megatron's TTrace-style threshold k·C^depth·ε (k = 4, C = 1.03) for a tensor of `format`
/// at `depth` = L + 1 − l (1 for the top layer or a single op). For FP8 recipes Megatron uses
/// the BF16 ε; pass `Format::BF16` then.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::megatron_ttrace;
/// use ttrace::Format;
///
/// // A BF16 tensor in the top layer: 4 · 1.03 · 2^-7 ≈ 3.2e-2 relative in the Frobenius norm.
/// let b = megatron_ttrace(Format::BF16, 1);
/// assert!((b.nominal_relative() - 4.0 * 1.03 / 128.0).abs() < 1e-15);
/// let reference = [1.0, 2.0, 3.0];
/// assert!(b.accepts(&reference, &[1.0, 2.0, 3.05]));
/// assert!(!b.accepts(&reference, &[1.0, 2.0, 3.5]));
/// ```
pub fn megatron_ttrace(format: Format, depth: u32) -> Baseline {
    let tol = 4.0 * 1.03f64.powi(depth as i32) * format.machine_epsilon();
    Baseline {
        name: format!(
            "Megatron k*C^depth*eps (k=4, C=1.03, depth={depth}, {})",
            format.name()
        ),
        rule: BaselineRule::RelativeFrobenius { tol },
    }
}

/// The baselines that apply to a tensor of `format` at `depth`.
pub fn baselines_for(format: Format, depth: u32) -> Vec<Baseline> {
    let mut out = vec![torch_assert_close(format)];
    if let Some(te) = transformer_engine_fp8(format) {
        out.push(te);
    }
    let eps_format = if matches!(format, Format::E4M3 | Format::E5M2) {
        Format::BF16
    } else {
        format
    };
    out.push(megatron_ttrace(eps_format, depth));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_judge_as_documented() {
        let t = torch_assert_close(Format::BF16);
        assert!(t.accepts(&[1.0, 100.0], &[1.0 + 1.5e-2, 101.5]));
        assert!(!t.accepts(&[1.0], &[1.02]));
        assert!(!t.accepts(&[1.0], &[f64::NAN]));
        let m = megatron_ttrace(Format::BF16, 1);
        assert_eq!(m.nominal_relative(), 4.0 * 1.03 * 0.0078125);
        assert!(m.accepts(&[3.0, 4.0], &[3.0, 4.1]));
        assert!(!m.accepts(&[3.0, 4.0], &[3.0, 4.2]));
        assert!(torch_assert_close(Format::E4M3).accepts(&[1.0], &[1.0]));
        assert!(!torch_assert_close(Format::E4M3).accepts(&[1.0], &[1.0625]));
        assert_eq!(baselines_for(Format::E4M3, 1).len(), 3);
    }
}

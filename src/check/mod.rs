//! The differential checker: verdicts per traced tensor (reference vs merged candidate), and
//! the localizer that names the first module whose *own* output is wrong.
//!
//! Per tensor: the relative Frobenius error ‖c − r‖/‖r‖ (also in units of ε of the training
//! dtype) against its threshold, the largest absolute difference, the largest distance in
//! units in the last place of the tensor's format (ordered bit patterns), and non-finite
//! mismatches. Non-finite policy: a NaN or ±∞ in the candidate where the reference is finite,
//! or a finite candidate where the reference is not, is a failure reported with its first
//! flat index; identical non-finite values (NaN and NaN, or the same infinity) agree and are
//! left out of the norms. A shard set that cannot be merged (replicas that differ, a layout
//! that does not fit) is a failure with the merge error as its reason.

pub mod dirs;
pub mod localize;
pub mod price;

use std::collections::HashMap;

use serde::Serialize;

use crate::engine::tensor::Tensor;
use crate::engine::trace::Trace;
use crate::error::Error;
use crate::format::Format;

pub use dirs::{check_dir_paths, check_dirs, DirCheck, FileLocalization, PricingMode};
pub use localize::{localize, Localization};

/// The verdict on one tensor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorVerdict {
    /// Canonical id.
    pub id: String,
    /// Elements.
    pub elements: usize,
    /// ‖cand − ref‖_F / ‖ref‖_F over the finite pairs (0 when identical).
    pub rel_error: f64,
    /// `rel_error` in units of ε.
    pub rel_error_eps: f64,
    /// The relative threshold.
    pub threshold: f64,
    /// `rel_error` / `threshold` (∞ for a nonzero error against a zero threshold).
    pub ratio: f64,
    /// Largest |cand − ref|.
    pub max_abs: f64,
    /// Largest distance in units in the last place of the tensor's format.
    pub max_ulp: u64,
    /// Non-finite mismatches (NaN or ±∞ on one side only, or different non-finite values).
    pub nonfinite_mismatches: usize,
    /// Flat index of the first non-finite mismatch.
    pub first_nonfinite: Option<usize>,
    /// Why the tensor could not be compared (a merge error), if so.
    pub problem: Option<String>,
    /// Within the threshold, with no non-finite mismatch and no problem.
    pub passed: bool,
}

/// The report of one comparison of traces.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckReport {
    /// Per tensor, in execution order.
    pub verdicts: Vec<TensorVerdict>,
    /// Tensors that failed.
    pub failures: usize,
    /// The first failing tensor in execution order.
    pub first_failure: Option<String>,
    /// The unit of `rel_error_eps`.
    pub eps: f64,
}

impl CheckReport {
    /// No tensor failed.
    pub fn passed(&self) -> bool {
        self.failures == 0
    }
}

/// Position of a value on its format's ordered grid (sign-magnitude bit pattern → integer).
fn ordinal(format: Format, x: f64) -> Option<i128> {
    let bits = match format {
        // Exact: the value is an F32 (or BF16, the top half of its F32 pattern).
        Format::F32 => i128::from((x as f32).to_bits()),
        Format::BF16 => i128::from((x as f32).to_bits() >> 16),
        _ => format.encode(x).ok()? as i128,
    };
    let width = format.bit_width();
    let sign = 1i128 << (width - 1);
    Some(if bits & sign != 0 {
        -(bits & (sign - 1))
    } else {
        bits
    })
}

/// Compare one tensor against a threshold on ‖cand − ref‖_F (absolute); `eps` is the unit of
/// the ε column.
pub fn compare_tensor(
    id: &str,
    reference: &Tensor,
    candidate: &Tensor,
    threshold_abs: f64,
    eps: f64,
) -> TensorVerdict {
    let mut verdict = TensorVerdict {
        id: id.to_string(),
        elements: reference.len(),
        rel_error: 0.0,
        rel_error_eps: 0.0,
        threshold: 0.0,
        ratio: 0.0,
        max_abs: 0.0,
        max_ulp: 0,
        nonfinite_mismatches: 0,
        first_nonfinite: None,
        problem: None,
        passed: false,
    };
    if reference.shape() != candidate.shape() {
        verdict.problem = Some(format!(
            "shape {:?} differs from the reference's {:?}",
            candidate.shape(),
            reference.shape()
        ));
        return verdict;
    }
    let fmt = reference.format();
    let (mut d2, mut r2) = (0.0, 0.0);
    for (i, (&r, &c)) in reference
        .values()
        .iter()
        .zip(candidate.values())
        .enumerate()
    {
        if !(r.is_finite() && c.is_finite()) {
            let same = (r.is_nan() && c.is_nan()) || r == c;
            if !same {
                verdict.nonfinite_mismatches += 1;
                verdict.first_nonfinite.get_or_insert(i);
            }
            continue;
        }
        let d = c - r;
        d2 += d * d;
        r2 += r * r;
        verdict.max_abs = verdict.max_abs.max(d.abs());
        if d != 0.0 {
            let u = match (ordinal(fmt, r), ordinal(candidate.format(), c)) {
                (Some(a), Some(b)) if candidate.format() == fmt => (a - b).unsigned_abs() as u64,
                _ => u64::MAX,
            };
            verdict.max_ulp = verdict.max_ulp.max(u);
        }
    }
    apply_threshold(&mut verdict, d2.sqrt(), r2.sqrt(), threshold_abs);
    verdict.rel_error_eps = verdict.rel_error / eps;
    verdict
}

/// Fill a verdict's error, threshold, ratio and pass columns from ‖cand − ref‖_F = `dn`,
/// ‖ref‖_F = `rn` and the absolute threshold (the ε column is the caller's: it is left as is).
pub fn apply_threshold(verdict: &mut TensorVerdict, dn: f64, rn: f64, threshold_abs: f64) {
    let rel = |x: f64| {
        if x == 0.0 {
            0.0
        } else if rn > 0.0 {
            x / rn
        } else {
            f64::INFINITY
        }
    };
    verdict.rel_error = rel(dn);
    verdict.threshold = rel(threshold_abs);
    verdict.ratio = if dn == 0.0 {
        0.0
    } else if threshold_abs > 0.0 {
        dn / threshold_abs
    } else {
        f64::INFINITY
    };
    verdict.passed = dn <= threshold_abs && verdict.nonfinite_mismatches == 0;
}

/// Check a merged candidate trace against the reference: every id of `ids` (in order) is
/// compared with its threshold from `thresholds` (absolute; a missing id has threshold 0: the
/// tensor must be bit-identical); ids in `merge_errors` fail with the error as the reason, and
/// an id missing from the candidate fails too.
pub fn check(
    reference: &Trace,
    candidate: &Trace,
    merge_errors: &[(String, Error)],
    ids: &[String],
    thresholds: &HashMap<String, f64>,
    eps: f64,
) -> CheckReport {
    let errors: HashMap<&str, &Error> = merge_errors.iter().map(|(i, e)| (i.as_str(), e)).collect();
    let mut verdicts = Vec::with_capacity(ids.len());
    for id in ids {
        let Some(r) = reference.get(id) else {
            continue;
        };
        let th = thresholds.get(id).copied().unwrap_or(0.0);
        let v = match (errors.get(id.as_str()), candidate.get(id)) {
            (Some(e), _) => failed(id, r.len(), e.to_string()),
            (None, Some(c)) => compare_tensor(id, r, c, th, eps),
            (None, None) => failed(id, r.len(), "missing from the candidate".into()),
        };
        verdicts.push(v);
    }
    let failures = verdicts.iter().filter(|v| !v.passed).count();
    let first_failure = verdicts.iter().find(|v| !v.passed).map(|v| v.id.clone());
    CheckReport {
        verdicts,
        failures,
        first_failure,
        eps,
    }
}

fn failed(id: &str, elements: usize, problem: String) -> TensorVerdict {
    TensorVerdict {
        id: id.to_string(),
        elements,
        rel_error: f64::NAN,
        rel_error_eps: f64::NAN,
        threshold: f64::NAN,
        ratio: f64::INFINITY,
        max_abs: f64::NAN,
        max_ulp: 0,
        nonfinite_mismatches: 0,
        first_nonfinite: None,
        problem: Some(problem),
        passed: false,
    }
}

/// The report as a table: the failing tensors first (all of them), then a count of passes.
pub fn render_check(report: &CheckReport) -> String {
    let mut out = String::new();
    let n = report.verdicts.len();
    if report.passed() {
        out.push_str(&format!(
            "PASS: all {n} tensors within their thresholds (ε = {:e})\n",
            report.eps
        ));
        return out;
    }
    out.push_str(&format!(
        "FAIL: {} of {n} tensors outside their thresholds; first in execution order: {}\n",
        report.failures,
        report.first_failure.as_deref().unwrap_or("-")
    ));
    out.push_str(&format!(
        "{:<44} {:>11} {:>11} {:>9} {:>10} {:>8}  note\n",
        "tensor", "error (ε)", "thresh (ε)", "ratio", "max abs", "max ulp"
    ));
    for v in report.verdicts.iter().filter(|v| !v.passed) {
        let note = match (&v.problem, v.first_nonfinite) {
            (Some(p), _) => p.clone(),
            (None, Some(i)) => format!(
                "{} non-finite mismatches, first at {i}",
                v.nonfinite_mismatches
            ),
            _ => String::new(),
        };
        out.push_str(&format!(
            "{:<44} {:>11.3} {:>11.3} {:>9.3} {:>10.3e} {:>8}  {}\n",
            v.id,
            v.rel_error_eps,
            v.threshold / report.eps,
            v.ratio,
            v.max_abs,
            if v.max_ulp == u64::MAX {
                "-".to_string()
            } else {
                v.max_ulp.to_string()
            },
            note
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: Vec<f64>) -> Tensor {
        Tensor::from_vec(&[v.len()], v, Format::BF16).unwrap()
    }

    #[test]
    fn verdict_measures_errors_ulps_and_nonfinite() {
        let r = t(vec![1.0, 2.0, -1.0, 0.5]);
        let c = t(vec![1.0078125, 2.0, -1.0, 0.5]);
        let v = compare_tensor("x", &r, &c, 0.01, 2f64.powi(-7));
        assert_eq!(v.max_ulp, 1);
        assert_eq!(v.max_abs, 0.0078125);
        assert!(v.passed);
        let v = compare_tensor("x", &r, &c, 0.0, 2f64.powi(-7));
        assert!(!v.passed && v.ratio.is_infinite());
        // Sign change: ulps counted across zero.
        let c2 = t(vec![1.0, 2.0, 1.0, 0.5]);
        assert!(compare_tensor("x", &r, &c2, 10.0, 1.0).max_ulp > 1000);
        // NaN where the reference is finite fails, with its index; matching NaNs agree.
        let c3 = t(vec![1.0, f64::NAN, -1.0, 0.5]);
        let v = compare_tensor("x", &r, &c3, 1e9, 1.0);
        assert!(!v.passed);
        assert_eq!(v.first_nonfinite, Some(1));
        let rn = t(vec![f64::NAN, f64::INFINITY]);
        assert!(compare_tensor("y", &rn, &rn.clone(), 0.0, 1.0).passed);
        let ri = t(vec![f64::INFINITY]);
        let ci = t(vec![f64::NEG_INFINITY]);
        assert!(!compare_tensor("z", &ri, &ci, 1e9, 1.0).passed);
        // All-zero reference: any difference is an infinite relative error.
        let z = t(vec![0.0, 0.0]);
        let v = compare_tensor("w", &z, &t(vec![0.0, 1.0]), 0.5, 1.0);
        assert!(v.rel_error.is_infinite() && !v.passed);
    }

    #[test]
    fn check_reports_merge_errors_missing_tensors_and_the_first_failure() {
        let mut reference = Trace::new();
        let mut candidate = Trace::new();
        for (id, r, c) in [
            ("a|fwd.output.0", 1.0, 1.0),
            ("b|fwd.output.0", 1.0, 1.5),
            ("c|fwd.output.0", 2.0, 2.0),
        ] {
            reference.push(id, t(vec![r])).unwrap();
            candidate.push(id, t(vec![c])).unwrap();
        }
        reference.push("d|param_grad", t(vec![1.0])).unwrap();
        let ids: Vec<String> = reference.ids().map(str::to_string).collect();
        let errors = vec![(
            "c|fwd.output.0".to_string(),
            Error::Layout {
                id: "c|fwd.output.0".into(),
                reason: "bad".into(),
            },
        )];
        let mut th = HashMap::new();
        th.insert("b|fwd.output.0".to_string(), 0.25);
        let rep = check(&reference, &candidate, &errors, &ids, &th, 1.0);
        assert_eq!(rep.failures, 3);
        assert_eq!(rep.first_failure.as_deref(), Some("b|fwd.output.0"));
        assert!(rep.verdicts[2].problem.as_deref().unwrap().contains("bad"));
        assert!(rep.verdicts[3]
            .problem
            .as_deref()
            .unwrap()
            .contains("missing"));
        let text = render_check(&rep);
        assert!(text.starts_with("FAIL: 3 of 4"));
        // Within a generous threshold and without the broken ones, it passes.
        th.insert("b|fwd.output.0".to_string(), 1.0);
        let rep = check(&reference, &candidate, &[], &ids[..2], &th, 1.0);
        assert!(rep.passed() && render_check(&rep).starts_with("PASS"));
    }
}

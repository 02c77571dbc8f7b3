//! The differential checker: traces and trace directories compared tensor by tensor, each
//! tensor priced ([`price_local`]) and judged ([`TensorVerdict`], from the verdict room below
//! the bounds), and the first module whose *own* output is wrong named.
//!
//! Per tensor: the relative Frobenius error ‖c − r‖/‖r‖ (also in units of ε of the training
//! dtype) against its threshold, the largest absolute difference, the largest distance in
//! units in the last place of the tensor's format (ordered bit patterns), and non-finite
//! mismatches. Non-finite policy: a NaN or ±∞ in the candidate where the reference is finite,
//! or a finite candidate where the reference is not, is a failure reported with its first
//! flat index; identical non-finite values (NaN and NaN, or the same infinity) agree and are
//! left out of the norms. A shard set that cannot be merged (replicas that differ, a layout
//! that does not fit) is a failure with the merge error as its reason.

pub(crate) mod attention_site;
pub(crate) mod bias_grad;
mod blame;
mod chain;
pub(crate) mod dirs;
mod localization;
pub(crate) mod loss;
pub(crate) mod loss_site;
pub(crate) mod price;
mod summaries;
mod text;
pub(crate) mod weight_grad;

use std::collections::HashMap;

use serde::Serialize;

use crate::error::Error;
use crate::trace::id::Trace;

use crate::verdict::failed;
pub use crate::verdict::{
    apply_threshold, compare_tensor, compare_tensor_with, Detection, Detector, Finding,
    TensorVerdict, NORM_SHARE,
};
pub use dirs::{
    check_dir_paths, check_dir_traces, check_dirs, check_share, check_share_paths,
    combine_share_paths, combine_shares, resolve_steps, setup_needs, share_owners, DirCheck,
    PricingMode, UntracedGap,
};
pub use localization::Localization;
pub use loss::LossNormalization;
pub use price::{price_local, InputIndex, OpMeasure, PriceContext, Priced, Pricing, TensorStat};
pub use summaries::{
    compare_summaries, Proof, StepComparison, SummaryCheck, SummaryThresholds, TensorBound,
};
pub use text::{localization_line, render_check, render_dir_check, render_summary_check};

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

/// Check a merged candidate trace against the reference: every id of `ids` (in order) is
/// compared with its threshold from `thresholds` (absolute; a missing id has threshold 0: the
/// tensor must be bit-identical) and by the tests of `detection`; ids in `merge_errors` fail
/// with the error as the reason, and an id missing from the candidate fails too.
pub fn check(
    reference: &Trace,
    candidate: &Trace,
    merge_errors: &[(String, Error)],
    ids: &[String],
    thresholds: &HashMap<String, f64>,
    eps: f64,
    detection: Detection,
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
            (None, Some(c)) => compare_tensor_with(id, r, c, th, eps, detection),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Format;
    use crate::tensor::Tensor;

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
        let rep = check(
            &reference,
            &candidate,
            &errors,
            &ids,
            &th,
            1.0,
            Detection::default(),
        );
        assert_eq!(rep.failures, 3);
        assert_eq!(rep.first_failure.as_deref(), Some("b|fwd.output.0"));
        assert!(rep.verdicts[2].problem.as_deref().unwrap().contains("bad"));
        assert!(rep.verdicts[3]
            .problem
            .as_deref()
            .unwrap()
            .contains("missing"));
        assert_eq!(rep.verdicts.len(), 4);
        // Within a generous threshold and without the broken ones, it passes.
        th.insert("b|fwd.output.0".to_string(), 1.0);
        let rep = check(
            &reference,
            &candidate,
            &[],
            &ids[..2],
            &th,
            1.0,
            Detection::default(),
        );
        assert!(rep.passed() && rep.failures == 0);
    }
}

//! Checking two trace directories (`ttrace check REF_DIR CAND_DIR`): the candidate's shards are
//! merged into logical tensors one at a time and compared with the reference's.
//!
//! Thresholds: the reference manifest's `threshold` of a tensor when the producer priced one
//! (`ttrace simulate --dump` records ttrace's composed thresholds there); otherwise a stated
//! fallback — Megatron's 4·1.03^(L+1)·ε·‖ref‖ with L the number of layers seen in the ids and ε
//! that of the recipe's training dtype (or of the tensor's dtype without a recipe). Pricing
//! external traces from their metadata alone is not implemented yet; the report says which
//! tensors used the fallback.

use serde::Serialize;

use crate::check::{compare_tensor, CheckReport, TensorVerdict};
use crate::engine::policy::Recipe;
use crate::error::{Error, Result};
use crate::io::TraceDir;

/// The result of checking two trace directories.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DirCheck {
    /// The verdicts.
    pub report: CheckReport,
    /// Ids whose threshold is the fallback rule.
    pub fallback: Vec<String>,
    /// The fallback rule, in words.
    pub fallback_rule: String,
}

fn layers(ids: &[String]) -> u32 {
    ids.iter()
        .filter_map(|id| id.strip_prefix("layers."))
        .filter_map(|r| r.split('.').next()?.parse::<u32>().ok())
        .max()
        .map(|m| m + 1)
        .unwrap_or(0)
}

/// Check `candidate` against `reference` (see the module docs). Errors are unusable input (a
/// tensor the candidate lacks, unreadable files); a merge failure of a candidate tensor is a
/// failing verdict.
pub fn check_dirs(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    progress: &dyn Fn(),
) -> Result<DirCheck> {
    let ids: Vec<String> = reference
        .ids()
        .iter()
        .filter(|id| !id.contains("|fwd.input.") && !id.contains("|grad.output."))
        .cloned()
        .collect();
    if let Some(missing) = ids.iter().find(|id| !candidate.ids().contains(id)) {
        return Err(Error::UnknownName {
            kind: "tensor of the reference trace that the candidate trace lacks",
            name: missing.clone(),
        });
    }
    let train = match &reference.manifest().recipe {
        Some(r) => Some(Recipe::by_name(r)?.activation_format),
        None => None,
    };
    let depth = layers(&ids) + 1;
    let mut verdicts: Vec<TensorVerdict> = Vec::with_capacity(ids.len());
    let mut fallback = vec![];
    let mut eps_unit = None;
    for id in &ids {
        let r = reference.logical(id)?;
        let eps = train.unwrap_or(r.format()).machine_epsilon();
        eps_unit.get_or_insert(eps);
        let th = match reference.threshold(id) {
            Some(t) => t,
            None => {
                fallback.push(id.clone());
                let norm = r.values().iter().map(|x| x * x).sum::<f64>().sqrt();
                4.0 * 1.03f64.powi(depth as i32) * eps * norm
            }
        };
        let v = match candidate.logical(id) {
            Ok(c) => compare_tensor(id, &r, &c, th, eps),
            Err(e @ (Error::ReplicaMismatch { .. } | Error::Layout { .. })) => {
                let mut v = compare_tensor(id, &r, &r, th, eps);
                v.passed = false;
                v.ratio = f64::INFINITY;
                v.problem = Some(e.to_string());
                v
            }
            Err(e) => return Err(e),
        };
        verdicts.push(v);
        progress();
    }
    let failures = verdicts.iter().filter(|v| !v.passed).count();
    let first_failure = verdicts.iter().find(|v| !v.passed).map(|v| v.id.clone());
    Ok(DirCheck {
        report: CheckReport {
            verdicts,
            failures,
            first_failure,
            eps: eps_unit.unwrap_or(f64::NAN),
        },
        fallback,
        fallback_rule: format!(
            "Megatron 4*1.03^{depth}*eps*||ref|| (no threshold priced in the reference manifest)"
        ),
    })
}

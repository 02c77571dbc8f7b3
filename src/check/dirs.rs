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
use std::path::Path;

use crate::engine::policy::Recipe;
use crate::error::{Error, Result};
use crate::format::Format;
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

/// The produced tensors of a reference trace, in its order (inputs and arriving gradients are
/// the same tensors under their consumers' ids).
fn produced(reference: &TraceDir) -> Vec<String> {
    reference
        .ids()
        .iter()
        .filter(|id| !id.contains("|fwd.input.") && !id.contains("|grad.output."))
        .cloned()
        .collect()
}

/// The verdict on one tensor, and whether its threshold is the fallback.
fn verdict(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    id: &str,
    train: Option<Format>,
    depth: u32,
) -> Result<(TensorVerdict, bool)> {
    let r = reference.logical(id)?;
    let eps = train.unwrap_or(r.format()).machine_epsilon();
    let (th, fallback) = match reference.threshold(id) {
        Some(t) => (t, false),
        None => {
            let norm = r.values().iter().map(|x| x * x).sum::<f64>().sqrt();
            (4.0 * 1.03f64.powi(depth as i32) * eps * norm, true)
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
    Ok((v, fallback))
}

fn finish(verdicts: Vec<(TensorVerdict, bool)>, train: Option<Format>, depth: u32) -> DirCheck {
    let fallback = verdicts
        .iter()
        .filter(|(_, f)| *f)
        .map(|(v, _)| v.id.clone())
        .collect();
    let verdicts: Vec<TensorVerdict> = verdicts.into_iter().map(|(v, _)| v).collect();
    let failures = verdicts.iter().filter(|v| !v.passed).count();
    let first_failure = verdicts.iter().find(|v| !v.passed).map(|v| v.id.clone());
    let eps = match (train, verdicts.first()) {
        (Some(f), _) => f.machine_epsilon(),
        (None, Some(v)) if v.rel_error.is_finite() && v.rel_error_eps > 0.0 => {
            v.rel_error / v.rel_error_eps
        }
        _ => f64::NAN,
    };
    DirCheck {
        report: CheckReport {
            verdicts,
            failures,
            first_failure,
            eps,
        },
        fallback,
        fallback_rule: format!(
            "Megatron 4*1.03^{depth}*eps*||ref|| (no threshold priced in the reference manifest)"
        ),
    }
}

fn preamble(
    reference: &TraceDir,
    candidate: &TraceDir,
) -> Result<(Vec<String>, Option<Format>, u32)> {
    let ids = produced(reference);
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
    Ok((ids, train, depth))
}

/// Check `candidate` against `reference` (see the module docs), one tensor at a time. Errors
/// are unusable input (a tensor the candidate lacks, unreadable files); a merge failure of a
/// candidate tensor is a failing verdict.
pub fn check_dirs(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    progress: &dyn Fn(),
) -> Result<DirCheck> {
    let (ids, train, depth) = preamble(reference, candidate)?;
    let mut out = Vec::with_capacity(ids.len());
    for id in &ids {
        out.push(verdict(reference, candidate, id, train, depth)?);
        progress();
    }
    Ok(finish(out, train, depth))
}

/// [`check_dirs`] on directory paths, spread over the rayon thread pool: every worker opens
/// its own handles and checks a contiguous run of tensors; the verdicts come back in the
/// reference's order, identical for any number of threads. Memory: one tensor per worker.
pub fn check_dir_paths(
    reference: &Path,
    candidate: &Path,
    progress: &(dyn Fn() + Sync),
) -> Result<DirCheck> {
    use rayon::prelude::*;
    let (r0, c0) = (TraceDir::open(reference)?, TraceDir::open(candidate)?);
    let (ids, train, depth) = preamble(&r0, &c0)?;
    drop((r0, c0));
    let workers = rayon::current_num_threads().max(1);
    let chunk = ids.len().div_ceil(workers * 4).max(1);
    let parts: Vec<Vec<(TensorVerdict, bool)>> = ids
        .par_chunks(chunk)
        .map(|part| {
            let mut r = TraceDir::open(reference)?;
            let mut c = TraceDir::open(candidate)?;
            part.iter()
                .map(|id| {
                    let v = verdict(&mut r, &mut c, id, train, depth);
                    progress();
                    v
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<_>>()?;
    Ok(finish(parts.into_iter().flatten().collect(), train, depth))
}

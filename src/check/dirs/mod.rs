//! Checking two trace directories (`ttrace check REF_DIR CAND_DIR`): the candidate's shards are
//! merged into logical tensors one at a time and compared with the reference's.
//!
//! Two passes. The first reads every traced id of both runs once (tensors are streamed: one
//! tensor pair per worker in memory, kept in its stored format — an FP8 element is one byte —
//! from the file through the merge to the comparison, which decodes a piece at a time) and
//! keeps per-id statistics — norms of the reference and of
//! the difference, the candidate's layout, the norm gain of norm inputs — and the verdict's
//! error columns. The second prices each produced tensor's threshold without touching the
//! files:
//!
//! 1. the reference manifest's `threshold` when the producer priced one (`ttrace simulate
//!    --dump` records ttrace's composed thresholds there), unless [`PricingMode::Local`];
//! 2. else the local model of [`crate::check::price`] from the manifest's metadata (module
//!    kind and formats; the recipe) and the measured differences of the module's inputs — with
//!    the generic gain allowance when the manifest gives no module kind;
//! 3. else (an id outside the `{module}|…` naming convention, so its inputs are unknown)
//!    Megatron's 4·1.03^(L+1)·ε·‖ref‖ with L the number of layers seen in the ids.
//!
//! The report says which rule priced each tensor. The manifest's order is taken as execution
//! order; the first failing tensor names the module the failure is localized to (under the
//! local model a tensor fails only when its own inputs do not explain its difference).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::check::price::{
    gain_allowance, norm_gain_by, price_local, role, InputIndex, PriceContext, Pricing, TensorStat,
};
use crate::check::{CheckReport, Localization};
use crate::error::{Error, Result};
use crate::format::Format;
use crate::io::guard::printable;
use crate::io::{InferredLayout, TraceDir};
use crate::policy::{Pass, Recipe};
use crate::trace::id::{TensorId, TensorRole};
use crate::trace::stored::Window;
use crate::trace::ModuleKind;
use crate::verdict::{
    apply_threshold, compare_stored, detect::DEFAULT_DELTA, Detection, TensorVerdict, NORM_SHARE,
};

mod gather;
mod online;
mod share;
mod verdicts;

use gather::*;
pub use online::setup_needs;
pub use share::{
    check_share, check_share_paths, combine_share_paths, combine_shares, share_owners,
};
use verdicts::*;

/// Which thresholds `ttrace check` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PricingMode {
    /// The producer's threshold where the reference manifest has one, else the local model.
    #[default]
    Auto,
    /// The local model everywhere (ignore producers' thresholds).
    Local,
}

/// The result of checking two trace directories.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DirCheck {
    /// The verdicts.
    pub report: CheckReport,
    /// How each verdict's threshold was priced (same order as the verdicts).
    pub pricing: Vec<Pricing>,
    /// Tensors per pricing rule, with the rule in words.
    pub pricing_summary: Vec<(Pricing, usize, String)>,
    /// Ids whose threshold is a fallback (generic local model or Megatron's rule).
    pub fallback: Vec<String>,
    /// The first failure, localized.
    pub localization: Option<Localization>,
    /// Where code that no traced module covers made a tensor a traced module consumes, in
    /// execution order: the gaps in what the trace sees.
    pub untraced: Vec<UntracedGap>,
    /// Layouts the candidate's writer could only guess (plain tensors of code it cannot see
    /// into), as inferred from the shards' and the reference's shapes.
    pub inferred: Vec<InferredLayout>,
    /// The mode used.
    pub mode: PricingMode,
    /// The arithmetic settings the traces recorded and the checker priced (autocast, FP32
    /// matmul and convolution precision), per run: (`reference` or `candidate`, the setting
    /// as `name=value`, how many tensors carry it).
    pub arithmetic: Vec<(String, String, usize)>,
    /// How the candidate's data-parallel ranks normalized their loss, where its tracer did
    /// not know and the checker settled it from the reference.
    pub loss: Option<crate::check::LossNormalization>,
}

/// A tensor a traced module consumes that untraced code made (its reference content equals no
/// earlier traced output): functional code, a module left out, autograd's gradient sums.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UntracedGap {
    /// The module whose traced output last precedes the tensor in its pass, if any.
    pub after: Option<String>,
    /// The module that consumes it.
    pub before: String,
    /// The consumed tensor's id.
    pub tensor: String,
}
/// Check `candidate` against `reference` (see the module docs), one tensor at a time on the
/// calling thread. Errors are unusable input (a tensor the candidate lacks, unreadable files,
/// shards whose shapes do not fit their layout); replicas that disagree are a failing verdict
/// naming the rank. `progress` is called once per traced id.
pub fn check_dirs(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    mode: PricingMode,
    progress: &dyn Fn(),
) -> Result<DirCheck> {
    let setup = Setup::new(reference, candidate)?;
    let (mut r, mut c) = (setup.reference.share(), setup.candidate.share());
    let mut out = Vec::with_capacity(setup.plan.ids.len());
    let mut aliases = Aliases::default();
    for id in &setup.plan.ids {
        out.push(gather_reusing(
            &mut r,
            &mut c,
            id,
            &setup.plan,
            &mut aliases,
        )?);
        progress();
    }
    Ok(setup.conclude(out, mode))
}

/// In a pipelined candidate, the first failure's pipeline stage — and, for a difference born
/// in untraced code between two modules on different stages, the boundary it crossed (the
/// activation or gradient sent between them).
fn pipeline_stage(candidate: &TraceDir, mut check: DirCheck) -> DirCheck {
    let Some(loc) = check.localization.as_mut() else {
        return check;
    };
    if candidate.manifest().pipeline.is_none_or(|p| p.stages < 2) {
        return check;
    }
    // The stage of the first entry whose id passes `hit`.
    let stage_of = |hit: &dyn Fn(&str) -> bool| {
        candidate
            .manifest()
            .tensors
            .iter()
            .find(|e| hit(&e.id))
            .and_then(|e| e.stage)
    };
    let of_module = |m: &str| {
        let prefix = format!("{m}|");
        stage_of(&|id: &str| id.starts_with(&prefix))
    };
    loc.stage = stage_of(&|id: &str| id == loc.tensor).or_else(|| of_module(&loc.module));
    let before = loc.born_after.as_deref().and_then(of_module);
    match (before, loc.stage) {
        (Some(a), Some(b)) if a != b => {
            loc.detail = format!(
                "at the boundary between pipeline stages {a} and {b} (sent from stage {a} to \
                 stage {b}): {}",
                loc.detail
            );
        }
        (_, Some(s)) => loc.detail = format!("{} (pipeline stage {s})", loc.detail),
        _ => {}
    }
    check
}

/// The first failure in an expert's tensor that one rank holds whole (an owned id on a mesh of
/// one rank) and computes — its output, the gradient it sends back, its parameters' — names
/// that rank, unless the same tensor of a sibling expert held by another rank fails too (every
/// rank's experts are wrong). An expert's inputs and arriving gradients gather every rank's
/// tokens: no rank is named for them.
fn expert_owner(candidate: &TraceDir, mut check: DirCheck) -> DirCheck {
    use crate::trace::id::{TensorId, TensorRole};
    let holder = |id: &str| -> Option<usize> {
        let computed = TensorId::parse(id).is_some_and(|t| {
            matches!(
                t.role,
                TensorRole::FwdOutput(_) | TensorRole::GradInput(_) | TensorRole::ParamGrad { .. }
            )
        });
        (computed && candidate.owner(id).is_some() && candidate.mesh_of(id).world() == 1)
            .then(|| candidate.global_rank(id, 0))
    };
    // Siblings: the same role of modules with one parent (`….experts.2` and `….experts.3`).
    let key = |id: &str| {
        TensorId::parse(id).map(|t| {
            let parent = t.module.rsplit_once('.').map(|(p, _)| p.to_string());
            (parent, t.role)
        })
    };
    let verdicts = &check.report.verdicts;
    let Some(loc) = check.localization.as_mut() else {
        return check;
    };
    let Some(rank) = holder(&loc.tensor).filter(|_| loc.rank.is_none()) else {
        return check;
    };
    let mine = key(&loc.tensor);
    let elsewhere = verdicts
        .iter()
        .any(|v| !v.passed && key(&v.id) == mine && holder(&v.id).is_some_and(|k| k != rank));
    if !elsewhere {
        loc.rank = Some(rank);
    }
    check
}

/// In a candidate of several microbatches, the first failure's relative difference over each
/// microbatch's slice (the tensor split along the pipeline's dimension into equal parts), said
/// in its detail when some microbatches differ far more than others. Left out for a parameter
/// gradient (accumulated over them), a tensor either side lacks or that does not split evenly.
fn by_microbatch(reference: &TraceDir, candidate: &TraceDir, mut check: DirCheck) -> DirCheck {
    let Some(p) = candidate.manifest().pipeline.filter(|p| p.microbatches > 1) else {
        return check;
    };
    let Some(loc) = check.localization.as_mut() else {
        return check;
    };
    if loc.tensor.ends_with("|param_grad") || !candidate.contains(&loc.tensor) {
        return check;
    }
    let (mut r, mut c) = (reference.share(), candidate.share());
    let (Ok(rt), Ok(ct)) = (r.logical(&loc.tensor), c.logical(&loc.tensor)) else {
        return check;
    };
    let (m, dim) = (p.microbatches, p.dim.unwrap_or(0));
    let shape = rt.shape();
    if shape != ct.shape() || dim >= shape.len() || shape[dim] % m != 0 {
        return check;
    }
    let inner: usize = shape[dim + 1..].iter().product();
    let per = shape[dim] / m * inner;
    let mut sq = vec![(0.0f64, 0.0f64); m];
    for (k, (x, y)) in rt.values().iter().zip(ct.values()).enumerate() {
        let slot = &mut sq[(k % (shape[dim] * inner)) / per];
        let d = if x == y { 0.0 } else { y - x };
        slot.0 += d * d;
        slot.1 += x * x;
    }
    let rel: Vec<f64> = sq
        .iter()
        .map(|&(d, n)| if n > 0.0 { (d / n).sqrt() } else { d.sqrt() })
        .collect();
    let (lo, hi) = rel
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
    if hi > 4.0 * lo {
        let list: Vec<String> = rel.iter().map(|x| format!("{x:.2e}")).collect();
        loc.detail = format!(
            "{}; by microbatch (‖c − r‖/‖r‖ of each of {m}): {} — the difference is in some \
             microbatches only",
            loc.detail,
            list.join(", ")
        );
    }
    loc.microbatches = Some(rel);
    check
}

/// A first failure in a tensor consumed after module `m` (untraced code between), where `m`
/// handed its output to plain code as a partial sum ([`ModuleInfo::unreduced`]
/// (crate::io::ModuleInfo::unreduced)): the difference was born at `m`, whose missing
/// reduction its own output — merged as the sum it is — cannot show. The localization names
/// `m` and its output, and says why.
fn unreduced_producer(candidate: &TraceDir, mut check: DirCheck) -> DirCheck {
    let Some(loc) = check.localization.as_mut() else {
        return check;
    };
    let (Some(after), Some(Pass::Forward)) = (loc.born_after.clone(), loc.pass) else {
        return check;
    };
    let prefix = format!("{after}|fwd.output.");
    let hit = candidate.manifest().tensors.iter().find_map(|e| {
        let m = e.module.as_ref()?;
        (e.id.starts_with(&prefix) && !m.unreduced.is_empty()).then_some((e, m))
    });
    if let Some((e, m)) = hit {
        let axes: Vec<&str> = m.unreduced.iter().map(|a| a.name()).collect();
        loc.detail = format!(
            "module {} handed its output {} to plain code as a partial sum over {} (a DTensor \
             Partial() made local without its reduction): a missing all-reduce, seen where the \
             sum is used, in {}: {}",
            printable(&after),
            printable(&e.id),
            axes.join(" and "),
            printable(&loc.tensor),
            loc.detail
        );
        loc.tensor = e.id.clone();
        loc.kind = m.kind.or(loc.kind);
        loc.module = after;
        loc.born_after = None;
        // Every rank skipped it: the consumer's differing replica names no culprit.
        loc.rank = None;
        loc.ratio = f64::INFINITY;
    }
    check
}

/// The trace directories to compare for `reference` and `candidate` as a user names them: the
/// directories themselves when they hold a manifest, else the one traced step (`step{n}`, as
/// the Python tracer writes them) both hold. Several common steps are refused with the list
/// and the command to pick one; no manifest and no step is left to the reader's error.
///
/// # Examples
///
/// ```no_run
/// let (r, c) = ttrace::check::resolve_steps("traces/reference".as_ref(), "traces/candidate".as_ref())?;
/// # Ok::<(), ttrace::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::File`] naming the common steps when there are several, or the steps of each side
/// when they have none in common.
pub fn resolve_steps(reference: &Path, candidate: &Path) -> Result<(PathBuf, PathBuf)> {
    let has_manifest = |d: &Path| {
        d.join("manifest.json").exists()
            || std::fs::read_dir(d).is_ok_and(|it| {
                it.filter_map(|e| e.ok()).any(|e| {
                    let n = e.file_name();
                    let n = n.to_string_lossy();
                    n.starts_with("manifest.rank") && n.ends_with(".json")
                })
            })
    };
    let steps = |d: &Path| -> Vec<(u64, String)> {
        let mut v: Vec<(u64, String)> = std::fs::read_dir(d)
            .map(|it| {
                it.filter_map(|e| e.ok())
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .filter_map(|e| {
                        let n = e.file_name().to_string_lossy().to_string();
                        let k = n.strip_prefix("step")?.parse::<u64>().ok()?;
                        has_manifest(&e.path()).then_some((k, n))
                    })
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    if has_manifest(reference) || has_manifest(candidate) {
        return Ok((reference.to_path_buf(), candidate.to_path_buf()));
    }
    let (rs, cs) = (steps(reference), steps(candidate));
    if rs.is_empty() && cs.is_empty() {
        return Ok((reference.to_path_buf(), candidate.to_path_buf()));
    }
    let common: Vec<&String> = rs
        .iter()
        .filter(|s| cs.contains(s))
        .map(|(_, n)| n)
        .collect();
    let list = |v: &[(u64, String)]| {
        v.iter()
            .map(|(_, n)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match common.as_slice() {
        [one] => Ok((reference.join(one), candidate.join(one))),
        [] => Err(Error::File {
            path: reference.display().to_string(),
            reason: format!(
                "holds traced steps ({}) and the candidate {} ({}): none in common",
                list(&rs),
                candidate.display(),
                list(&cs)
            ),
            io: None,
        }),
        many => Err(Error::File {
            path: reference.display().to_string(),
            reason: format!(
                "holds {} traced steps ({}): name one, e.g. ttrace check {} {}",
                many.len(),
                many.iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                reference.join(many[0]).display(),
                candidate.join(many[0]).display()
            ),
            io: None,
        }),
    }
}

/// [`check_dirs`] on directory paths, spread over the rayon thread pool: every worker reads a
/// contiguous run of tensors through its own reader (sharing the validated headers); the verdicts come back in the
/// reference's order, identical for any number of threads. Memory: one tensor pair per
/// worker.
pub fn check_dir_paths(
    reference: &Path,
    candidate: &Path,
    mode: PricingMode,
    progress: &(dyn Fn() + Sync),
) -> Result<DirCheck> {
    let (reference, candidate) = resolve_steps(reference, candidate)?;
    check_dir_traces(
        &TraceDir::open(&reference)?,
        &TraceDir::open(&candidate)?,
        mode,
        progress,
    )
}

/// [`check_dir_paths`] on traces already opened (their headers validated once; every worker
/// reads through its own [`TraceDir::share`]).
pub fn check_dir_traces(
    r0: &TraceDir,
    c0: &TraceDir,
    mode: PricingMode,
    progress: &(dyn Fn() + Sync),
) -> Result<DirCheck> {
    let setup = Setup::new(r0, c0)?;
    let all: Vec<usize> = (0..setup.plan.ids.len()).collect();
    let gathered = gather_ids(&setup, &all, progress)?;
    Ok(setup.conclude(gathered, mode))
}

/// What every checker of a pair of traces settles before reading a tensor (the same on every
/// checker rank of a distributed check): layouts the candidate's writer guessed, how its data
/// ranks normalized their loss, and the plan (which ids, the recipe, ε, the tests).
struct Setup {
    /// The reference, with its guessed layouts settled against the candidate when it is
    /// sharded itself (a trusted configuration: FSDP alone, TP 2).
    reference: TraceDir,
    /// The candidate with its guessed layouts settled against the reference.
    candidate: TraceDir,
    inferred: Vec<InferredLayout>,
    loss: Option<crate::check::LossNormalization>,
    plan: Plan,
}

impl Setup {
    fn new(r0: &TraceDir, c0: &TraceDir) -> Result<Setup> {
        let reference = if r0.manifest().mesh.world() > 1 {
            r0.infer_guessed_jointly(c0)?.0
        } else {
            r0.share()
        };
        let (mut candidate, inferred) = c0.infer_guessed(&reference)?;
        let loss = crate::check::loss::settle_dp_loss(&mut reference.share(), &mut candidate)?;
        let plan = plan(&reference, &candidate)?;
        Ok(Setup {
            reference,
            candidate,
            inferred,
            loss,
            plan,
        })
    }

    /// The second pass on the first's results (one per id of the plan, in its order).
    fn conclude(self, gathered: Vec<Gathered>, mode: PricingMode) -> DirCheck {
        let (producer, kinds) = side_info(&self.reference);
        let check = DirCheck {
            loss: self.loss,
            ..finish(
                &self.plan,
                gathered,
                &producer,
                (
                    self.candidate.manifest().mesh.clone(),
                    self.reference.manifest().mesh.clone(),
                    (
                        self.candidate.manifest().microbatches(),
                        self.reference.manifest().microbatches(),
                    ),
                ),
                &kinds,
                mode,
                self.inferred,
            )
        };
        let check = pipeline_stage(&self.candidate, unreduced_producer(&self.candidate, check));
        let check = expert_owner(&self.candidate, check);
        by_microbatch(&self.reference, &self.candidate, check)
    }
}

/// `ids` cut into at most `workers` contiguous runs of about equal work: the bytes both runs
/// store for each id, a linear's weight gradient with its operands' (its element test reads
/// them again: `check::weight_grad`).
fn balanced_runs<'a>(setup: &Setup, ids: &'a [usize], workers: usize) -> Vec<&'a [usize]> {
    let (plan, r, c) = (&setup.plan, &setup.reference, &setup.candidate);
    let bytes = |id: &str| r.stored_bytes(id) + c.stored_bytes(id);
    let cost: Vec<u64> = ids
        .iter()
        .map(|&k| {
            let id = &plan.ids[k];
            let operands: u64 = crate::check::weight_grad::operands(r, id)
                .iter()
                .map(|o| bytes(o))
                .sum();
            bytes(id) + operands + 1
        })
        .collect();
    let total: u64 = cost.iter().sum();
    let workers = workers.clamp(1, ids.len().max(1));
    let mut runs = Vec::with_capacity(workers);
    let (mut start, mut acc) = (0usize, 0u64);
    for (i, w) in cost.iter().enumerate() {
        acc += w;
        // Close a run once it holds its share of the work (the last takes the rest).
        let due = total.saturating_mul(runs.len() as u64 + 1) / workers as u64;
        if acc >= due && runs.len() + 1 < workers {
            runs.push(&ids[start..=i]);
            start = i + 1;
        }
    }
    if start < ids.len() || runs.is_empty() {
        runs.push(&ids[start..]);
    }
    runs
}

/// The first pass over the plan's ids at positions `ids`, spread over the rayon thread pool:
/// every worker reads a contiguous run of them through its own readers (sharing the validated
/// headers); the results come back in the order of `ids`, identical for any number of
/// threads. Memory: one tensor pair per worker.
fn gather_ids(setup: &Setup, ids: &[usize], progress: &(dyn Fn() + Sync)) -> Result<Vec<Gathered>> {
    let (plan, r0, c0) = (&setup.plan, &setup.reference, &setup.candidate);
    let workers = crate::parallel::threads();
    // One run of tensors per worker: each opens its handles once and reuses their read and
    // value buffers for every tensor (smaller runs balanced load better but paid fresh pages
    // for every run's first tensors).
    let runs = balanced_runs(setup, ids, workers);
    let parts: Vec<Vec<Gathered>> = crate::parallel::map(&runs, |part| {
        // Readers sharing the validated headers: memory for the metadata once.
        let (mut r, mut c) = (r0.share(), c0.share());
        let mut aliases = Aliases::default();
        part.iter()
            .map(|&k| {
                let g = gather_reusing(&mut r, &mut c, &plan.ids[k], plan, &mut aliases);
                progress();
                g
            })
            .collect::<Result<Vec<_>>>()
    })
    .into_iter()
    .collect::<Result<_>>()?;
    Ok(parts.into_iter().flatten().collect())
}

//! Bug runs: one catalog bug injected into a sharded run, checked against its reference, and
//! the meshes each bug applies to.

use super::dump::write_dump;
use super::*;
use ttrace::trace::Axis;

/// One bug injected into one configuration (or none: a clean check).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BugResult {
    /// The bug (`None`: the correct sharded run).
    pub bug: Option<Bug>,
    /// The configuration.
    pub config: RunConfig,
    /// Our composed (end-to-end) thresholds flagged at least one tensor (or a merge failed).
    pub end_to_end: bool,
    /// Flagged by the end-to-end check or by the localizer (a module whose own output fails).
    pub detected: bool,
    /// The first failing tensor in execution order.
    pub first_failure: Option<String>,
    /// Tensors that failed.
    pub failures: usize,
    /// Largest error / threshold over the tensors (∞ for a merge failure or a zero threshold).
    pub max_ratio: f64,
    /// Where the localizer found it.
    pub localization: Option<Localization>,
    /// The localizer named a module of the kind and pass the bug lives in.
    pub localized: bool,
    /// Whether each baseline flags it: `torch`, `megatron`, `perturbation`.
    pub baselines: BTreeMap<String, bool>,
    /// The full check of the merged candidate against the composed thresholds.
    pub check: CheckReport,
}

/// Run `run` with `bug` injected (or none), check the merged candidate against the clean
/// run's `thresholds` and localize the first wrong module.
pub fn run_bug(
    options: &SweepOptions,
    run: &RunConfig,
    bug: Option<Bug>,
    thresholds: &Thresholds,
) -> Result<BugResult> {
    run_bug_dumping(options, run, bug, thresholds, None)
}

/// [`run_bug`], also writing the step's traces under `dump` as [`dump_run`] does — from the
/// same run, not a second one.
pub fn run_bug_dumping(
    options: &SweepOptions,
    run: &RunConfig,
    bug: Option<Bug>,
    thresholds: &Thresholds,
    dump: Option<&Path>,
) -> Result<BugResult> {
    let (recipe, mut reference, mut sharded) = prepare(options, run, bug)?;
    let cand_step = sharded.step()?;
    if !sharded.scales().is_empty() {
        reference.set_scale_overrides(sharded.scales().clone());
    }
    let ref_trace = reference.step()?.trace;
    if let Some(dir) = dump {
        write_dump(run, &reference, &ref_trace, &cand_step, thresholds, dir)?;
    }
    let (merged, errors) = cand_step.merge_each(&ref_trace);
    let ids: Vec<String> = ref_trace
        .ids()
        .filter(|id| TensorId::parse(id).is_none_or(|t| t.produced()))
        .map(str::to_string)
        .collect();
    let train = recipe.activation_format;
    let eps = train.machine_epsilon();
    let report = check(
        &ref_trace,
        &merged,
        &errors,
        &ids,
        &thresholds.composed,
        eps,
        Detection::default().accumulated_in(recipe.narrowest_accumulator()),
    );
    let localization = localize(&mut sharded, &cand_step, &ref_trace, &thresholds.local, eps)?;
    let localized = match bug {
        Some(b) => {
            let site = b.site();
            localization.as_ref().is_some_and(|l| {
                l.kind == Some(site.kind)
                    && l.pass == Some(site.pass)
                    && site.name_suffix.is_none_or(|sfx| l.module.ends_with(sfx))
            })
        }
        None => localization.is_none(),
    };
    let depth = options.model.layers as u32 + 1;
    let mut baselines = BTreeMap::new();
    let (mut torch, mut meg, mut pert) =
        (!errors.is_empty(), !errors.is_empty(), !errors.is_empty());
    for id in &ids {
        let (Some(r), Some(c)) = (ref_trace.get(id), merged.get(id)) else {
            continue;
        };
        torch |= !torch_assert_close(r.format()).accepts(r.values(), c.values());
        meg |= !megatron_ttrace(train, depth).accepts(r.values(), c.values());
        let p = thresholds.perturbation.get(id).copied().unwrap_or(0.0);
        pert |= rel_diff(r, c) > p;
    }
    baselines.insert("torch".to_string(), torch);
    baselines.insert("megatron".to_string(), meg);
    baselines.insert("perturbation".to_string(), pert);
    // The offset tests of the composed path (not part of `check`'s report).
    let offsets = ids.iter().any(|id| {
        let (Some(r), Some(c), Some(b)) = (
            ref_trace.get(id),
            merged.get(id),
            thresholds.offsets.get(id),
        ) else {
            return false;
        };
        b.findings(r.shape(), r.values(), c.values(), eps)
            .iter()
            .any(|f| f.fired)
    });
    let end_to_end = !report.passed() || offsets;
    Ok(BugResult {
        bug,
        config: run.clone(),
        end_to_end,
        detected: end_to_end || localization.is_some(),
        first_failure: report.first_failure.clone(),
        failures: report.failures,
        max_ratio: report.verdicts.iter().map(|v| v.ratio).fold(0.0, f64::max),
        localization,
        localized,
        baselines,
        check: report,
    })
}

/// Up to `n` meshes of the sweep on which `bug` applies (preferring varied meshes: the
/// smallest first, then the largest, then one in the middle).
pub fn bug_meshes(bug: Bug, fp8: bool, batch: usize, n: usize) -> Vec<Mesh> {
    let all: Vec<Mesh> = SweepOptions::meshes()
        .into_iter()
        .filter(|m| applies(bug, m, fp8, batch))
        .collect();
    let mut out = vec![];
    for i in [
        0,
        all.len().saturating_sub(1),
        all.len() / 2,
        1,
        all.len().saturating_sub(2),
    ] {
        if let Some(m) = all.get(i) {
            if !out.contains(m) && out.len() < n {
                out.push(m.clone());
            }
        }
    }
    out
}

/// Whether `bug` can show on this mesh with this recipe (FP8 per-tensor scaling, batch
/// size for the reduce-scatter confusion).
pub(super) fn applies(bug: Bug, mesh: &Mesh, fp8: bool, batch: usize) -> bool {
    let sp = mesh.sequence_parallel();
    match bug {
        Bug::SpNormGradNotReduced | Bug::SpRowBiasGradNotReduced => sp,
        Bug::CpWrongLseCorrection
        | Bug::CpChunkOrderNotInverted
        | Bug::CpStaleKvBlock
        | Bug::MissingMicrobatchDivision => mesh.size(&Axis::CP) > 1,
        Bug::Fp8AmaxNotReduced => fp8 && mesh.size(&Axis::TP) > 1,
        Bug::DpGradSummedNotAveraged | Bug::EmbeddingGradNotDpReduced => mesh.size(&Axis::DP) > 1,
        Bug::RowBiasOnEveryRank | Bug::SoftmaxScaleFromLocalWidth | Bug::QkvWrongInterleave => {
            mesh.size(&Axis::TP) > 1
        }
        Bug::GradAllReduceInBf16 => mesh.size(&Axis::DP) * mesh.size(&Axis::CP) > 1,
        Bug::NormEpsMismatch => true,
        Bug::ReduceScatterWrongDim => {
            sp && (batch / mesh.size(&Axis::DP)) % mesh.size(&Axis::TP) == 0
        }
    }
}

//! The sweep and its report: per module kind the false-alarm margins, the tests' columns,
//! the sensitivity study's rows and the bug rows.

use super::*;

/// One row of the per-kind table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KindRow {
    /// Tensor kind.
    pub kind: String,
    /// Tensors compared (over all runs).
    pub compared: usize,
    /// Of which differ from the reference at all.
    pub differing: usize,
    /// Largest observed relative error, in units of ε of the training dtype.
    pub max_observed_eps: f64,
    /// Median of our threshold over the differing tensors, in units of ε.
    pub median_threshold_eps: f64,
    /// Median of threshold / observed over the differing tensors.
    pub tightness_median: f64,
    /// 90th percentile of threshold / observed over the differing tensors.
    pub tightness_p90: f64,
    /// Largest threshold / observed over the differing tensors.
    pub tightness_worst: f64,
    /// Our false alarms.
    pub false_alarms: usize,
    /// Perturbation estimate: false alarms.
    pub perturbation_false_alarms: usize,
    /// Perturbation estimate: median estimate / observed over the differing tensors.
    pub perturbation_tightness_median: f64,
    /// False alarms of each baseline (`torch`, `megatron`).
    pub baseline_false_alarms: BTreeMap<String, usize>,
    /// The tests beyond the norm (scale, bias, sparse): on how many tensors each applied, how
    /// many it fired on (false alarms: these runs are correct) and its largest ratio
    /// statistic / threshold (the closest call).
    pub tests: BTreeMap<Detector, TestColumn>,
}

/// One test beyond the norm over a set of correct tensors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TestColumn {
    /// Tensors it applied to.
    pub applied: usize,
    /// Tensors it fired on.
    pub fired: usize,
    /// Largest statistic / threshold.
    pub closest: f64,
}

/// The sweep's report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepReport {
    /// What ran.
    pub options: SweepOptions,
    /// Per-kind table rows.
    pub rows: Vec<KindRow>,
    /// The all-tensors row.
    pub total: KindRow,
    /// FP8 scales over all runs: how many of the candidate's differ from the reference's own.
    pub fp8_scales: ScaleSummary,
    /// The localizer's false alarms on the correct runs.
    pub localizer_false_alarms: usize,
    /// The detection table.
    pub bug_rows: Vec<BugRow>,
    /// The sensitivity table.
    pub sensitivity_rows: Vec<SensitivityRow>,
    /// Every bug run.
    pub bugs: Vec<BugResult>,
    /// Every run's per-tensor results.
    pub runs: Vec<RunResult>,
    /// Wall time in seconds.
    pub seconds: f64,
}

pub(super) fn percentile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

pub(super) fn row(kind: &str, ts: &[&TensorResult]) -> KindRow {
    let differing: Vec<&&TensorResult> = ts.iter().filter(|t| t.observed > 0.0).collect();
    let tight: Vec<f64> = differing.iter().map(|t| t.threshold / t.observed).collect();
    let mut baseline_false_alarms = BTreeMap::new();
    for t in ts {
        for b in &t.baseline_alarms {
            *baseline_false_alarms.entry(b.clone()).or_insert(0) += 1;
        }
    }
    KindRow {
        kind: kind.to_string(),
        compared: ts.len(),
        differing: differing.len(),
        max_observed_eps: ts.iter().map(|t| t.observed / t.eps).fold(0.0, f64::max),
        median_threshold_eps: median(differing.iter().map(|t| t.threshold / t.eps).collect()),
        tightness_median: median(tight.clone()),
        tightness_p90: percentile(tight.clone(), 0.9),
        tightness_worst: tight.iter().copied().fold(f64::NAN, f64::max),
        false_alarms: ts.iter().filter(|t| t.false_alarm()).count(),
        perturbation_false_alarms: ts.iter().filter(|t| t.observed > t.perturbation).count(),
        perturbation_tightness_median: median(
            differing
                .iter()
                .map(|t| t.perturbation / t.observed)
                .collect(),
        ),
        baseline_false_alarms,
        tests: test_columns(ts.iter().flat_map(|t| t.findings.iter())),
    }
}

/// Tally the findings of the tests beyond the norm on correct tensors.
pub(crate) fn test_columns<'a>(
    findings: impl Iterator<Item = &'a Finding>,
) -> BTreeMap<Detector, TestColumn> {
    let mut out: BTreeMap<Detector, TestColumn> = BTreeMap::new();
    for f in findings {
        let c = out.entry(f.detector).or_default();
        c.applied += 1;
        c.fired += usize::from(f.fired);
        c.closest = c.closest.max(f.ratio);
    }
    out
}

impl SweepReport {
    /// Aggregate run results into the per-kind table.
    pub fn new(
        options: SweepOptions,
        runs: Vec<RunResult>,
        bugs: Vec<BugResult>,
        seconds: f64,
    ) -> SweepReport {
        let mut by_kind: BTreeMap<String, Vec<&TensorResult>> = BTreeMap::new();
        for r in &runs {
            for t in &r.tensors {
                by_kind.entry(t.kind.clone()).or_default().push(t);
            }
        }
        let rows = by_kind.iter().map(|(k, ts)| row(k, ts)).collect();
        let all: Vec<&TensorResult> = runs.iter().flat_map(|r| r.tensors.iter()).collect();
        let total = row("all", &all);
        let mut fp8_scales = ScaleSummary::default();
        for r in &runs {
            fp8_scales.compared += r.scales.compared;
            fp8_scales.differing += r.scales.differing;
            fp8_scales.max_relative = fp8_scales.max_relative.max(r.scales.max_relative);
        }
        SweepReport {
            options,
            rows,
            total,
            fp8_scales,
            localizer_false_alarms: runs
                .iter()
                .filter(|r| r.localizer_false_alarm.is_some())
                .count(),
            bug_rows: bug_rows(&bugs),
            sensitivity_rows: sensitivity_rows(&runs),
            bugs,
            runs,
            seconds,
        }
    }
}

/// Run every configuration of `options` on the rayon thread pool (with the `parallel` feature), calling `progress` after
/// each one. Results are in configuration order, identical for any number of threads (each
/// configuration is deterministic and independent).
pub fn run_sweep(options: &SweepOptions, progress: &(dyn Fn() + Sync)) -> Result<SweepReport> {
    let most = ttrace::io::limits::SWEEP_RUNS;
    if options.simulation.samples as u64 > most {
        return Err(ttrace::Error::InvalidParameter {
            name: "samples",
            reason: format!(
                "{} samples exceed the limit of {most}",
                options.simulation.samples
            ),
        });
    }
    let start = std::time::Instant::now();
    let done: Vec<(RunResult, Thresholds)> = ttrace::__lab::map(&options.runs, |r| {
        let out = run_config_with_thresholds(options, r);
        progress();
        out
    })
    .into_iter()
    .collect::<Result<Vec<_>>>()?;
    let bug_runs = options.bug_runs();
    let bugs = ttrace::__lab::map(&bug_runs, |(bug, idx)| {
        let out = run_bug(options, &options.runs[*idx], Some(*bug), &done[*idx].1);
        progress();
        out
    })
    .into_iter()
    .collect::<Result<Vec<_>>>()?;
    let runs = done.into_iter().map(|(r, _)| r).collect();
    Ok(SweepReport::new(
        options.clone(),
        runs,
        bugs,
        start.elapsed().as_secs_f64(),
    ))
}

/// One row of the sensitivity table: per recipe and tensor kind, the median over tensors of
/// the smallest detectable injected perturbation ρ*, in units of ε, for each rule, and how
/// many tensors each rule already rejects unperturbed (false alarms, no figure).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SensitivityRow {
    /// Recipe.
    pub recipe: String,
    /// Tensor kind.
    pub kind: String,
    /// The perturbation's shape.
    pub perturbation: Perturbation,
    /// Tensors.
    pub tensors: usize,
    /// (rule, median ρ* / ε, false alarms) for ours, the norm alone, megatron, torch, the
    /// perturbation estimate and the localizer (over the tensors it replays).
    pub rules: Vec<(String, f64, usize)>,
}

/// The localizer's index in [`RuleFigures::named`].
pub(super) const LOCALIZER: usize = 5;

pub(super) fn sensitivity_rows(runs: &[RunResult]) -> Vec<SensitivityRow> {
    let mut groups: BTreeMap<(String, String), Vec<(&TensorResult, &Sensitivity)>> =
        BTreeMap::new();
    for r in runs {
        for t in &r.tensors {
            if let Some(sv) = &t.sensitivity {
                let kind = if t.kind.starts_with("param") {
                    "param grads"
                } else if t.kind.ends_with("fwd") {
                    "activations"
                } else {
                    "activation grads"
                };
                groups
                    .entry((r.config.recipe.clone(), kind.to_string()))
                    .or_default()
                    .push((t, sv));
            }
        }
    }
    let mut out = vec![];
    for p in Perturbation::ALL {
        for ((recipe, kind), ts) in &groups {
            let figures: Vec<(&TensorResult, bool, _)> = ts
                .iter()
                .filter_map(|(t, sv)| sv.of(p).map(|f| (*t, sv.replayed, f.named())))
                .collect();
            let rules = (0..LOCALIZER + 1)
                .map(|k| {
                    // The localizer's column: the tensors it replays.
                    let of = |replayed: bool| k != LOCALIZER || replayed;
                    let name = RuleFigures::NAMES[k];
                    let vals: Vec<f64> = figures
                        .iter()
                        .filter(|(_, rep, _)| of(*rep))
                        .filter_map(|(t, _, f)| f[k].1.map(|x| x / t.eps))
                        .collect();
                    let fa = figures
                        .iter()
                        .filter(|(_, rep, f)| of(*rep) && f[k].1.is_none())
                        .count();
                    (name.to_string(), median(vals), fa)
                })
                .collect();
            out.push(SensitivityRow {
                recipe: recipe.clone(),
                kind: kind.clone(),
                perturbation: p,
                tensors: figures.len(),
                rules,
            });
        }
    }
    out
}

/// One row of the detection table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BugRow {
    /// The bug.
    pub bug: Bug,
    /// Bug runs (configurations × recipes).
    pub runs: usize,
    /// Detected by the end-to-end check.
    pub end_to_end: usize,
    /// Detected by the end-to-end check or the localizer.
    pub detected: usize,
    /// Localized to the right module kind and pass.
    pub localized: usize,
    /// Smallest (over runs) of the largest error / threshold.
    pub min_ratio: f64,
    /// Runs in which each baseline flags it.
    pub baselines: BTreeMap<String, usize>,
    /// Where the localizer put it in the first run (module and pass).
    pub example_site: String,
}

pub(super) fn bug_rows(bugs: &[BugResult]) -> Vec<BugRow> {
    Bug::ALL
        .iter()
        .filter_map(|&b| {
            let rs: Vec<&BugResult> = bugs.iter().filter(|r| r.bug == Some(b)).collect();
            if rs.is_empty() {
                return None;
            }
            let mut baselines = BTreeMap::new();
            for r in &rs {
                for (k, &v) in &r.baselines {
                    *baselines.entry(k.clone()).or_insert(0) += usize::from(v);
                }
            }
            Some(BugRow {
                bug: b,
                runs: rs.len(),
                end_to_end: rs.iter().filter(|r| r.end_to_end).count(),
                detected: rs.iter().filter(|r| r.detected).count(),
                localized: rs.iter().filter(|r| r.localized).count(),
                min_ratio: rs.iter().map(|r| r.max_ratio).fold(f64::INFINITY, f64::min),
                baselines,
                example_site: rs[0]
                    .localization
                    .as_ref()
                    .map(|l| {
                        format!(
                            "{} {}",
                            l.module,
                            match l.pass {
                                Some(ttrace::engine::Pass::Forward) => "fwd",
                                Some(ttrace::engine::Pass::Backward) => "bwd",
                                None => "?",
                            }
                        )
                    })
                    .unwrap_or_else(|| "-".into()),
            })
        })
        .collect()
}

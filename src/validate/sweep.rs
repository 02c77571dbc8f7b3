//! The validation sweep: configurations × recipes × seeds, per-tensor results, and the table
//! per tensor kind that `ttrace validate` prints.

use std::collections::BTreeMap;

use serde::Serialize;

use std::collections::HashMap;
use std::path::Path;

use crate::bounds::baselines::{megatron_ttrace, torch_assert_close};
use crate::bounds::Confidence;
use crate::bugs::Bug;
use crate::check::{
    check, compare_with_sums, localize, replayed_outputs, CheckReport, Detection, Detector,
    Finding, Localization, NORM_SHARE,
};
use crate::engine::model::{Gpt, GptConfig};
use crate::engine::trace::{TensorId, TensorRole, Trace};
use crate::error::Result;
use crate::io::write_trace_dir;
use crate::policy::AttentionImpl;
use crate::policy::{Recipe, Scaling};
use crate::shard::collective::Algorithm;
use crate::shard::layout::Mesh;
use crate::shard::model::{ShardedGpt, ShardedStep};
use crate::tensor::Tensor;
use crate::validate::compose::{
    composed_thresholds, perturbation_estimate, OffsetBounds, SimulationConfig,
};
use crate::validate::fresh::{fresh_sites, local_thresholds};
use crate::validate::sensitivity::{
    sensitivity, Perturbation, Replayed, RuleFigures, Sensitivity, Subject,
};

/// One configuration of the sweep.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunConfig {
    /// The mesh.
    pub mesh: Mesh,
    /// Recipe name (`fp32`, `bf16`, `fp8-delayed`, ...).
    pub recipe: String,
    /// Seed of the consistent generator.
    pub seed: u64,
    /// All-reduce algorithm of the sharded run.
    pub algorithm: Algorithm,
}

/// What the sweep runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepOptions {
    /// The model (its `seed` is replaced by each run's seed).
    pub model: GptConfig,
    /// The configurations.
    pub runs: Vec<RunConfig>,
    /// Difference-simulation settings.
    pub simulation: SimulationConfig,
    /// Samples of the perturbation estimate.
    pub perturbation_samples: usize,
    /// Inject every catalog bug on up to this many meshes where it applies, in the bf16 and
    /// fp8 recipes of the sweep (first seed, ring all-reduce); 0 for none.
    pub bug_meshes: usize,
    /// The mesh on which every tensor's sensitivity is measured (first seed, ring).
    pub sensitivity_mesh: Option<Mesh>,
    /// The sensitivity study skips tensors of fewer elements.
    pub sensitivity_min_elements: usize,
}

impl SweepOptions {
    /// The bug runs: (bug, index of the clean run whose configuration and thresholds it uses).
    pub fn bug_runs(&self) -> Vec<(Bug, usize)> {
        let mut out = vec![];
        if self.bug_meshes == 0 {
            return out;
        }
        let Some(seed) = self.runs.first().map(|r| r.seed) else {
            return out;
        };
        for bug in Bug::ALL {
            for recipe in ["bf16", "fp8-delayed", "fp8-current", "fp32"] {
                let fp8 = recipe.starts_with("fp8");
                let meshes = bug_meshes(bug, fp8, self.model.batch, self.bug_meshes);
                for m in meshes {
                    if let Some(i) = self.runs.iter().position(|r| {
                        r.mesh == m
                            && r.recipe == recipe
                            && r.seed == seed
                            && r.algorithm == Algorithm::Ring
                    }) {
                        out.push((bug, i));
                    }
                }
            }
        }
        // Bugs are checked in the bf16 and fp8 recipes (fp32 only when neither runs).
        let has_low = out.iter().any(|&(_, i)| self.runs[i].recipe != "fp32");
        if has_low {
            out.retain(|&(_, i)| self.runs[i].recipe != "fp32");
        }
        out
    }
}

impl SweepOptions {
    /// The model of the sweeps: 2 layers, hidden 32, 4 heads, sequence 16, batch 4,
    /// vocabulary 64, online attention with key blocks of 4 (= the CP = 2 chunk).
    pub fn model() -> GptConfig {
        GptConfig {
            layers: 2,
            hidden: 32,
            heads: 4,
            seq: 16,
            batch: 4,
            vocab: 64,
            attention: AttentionImpl::Online { block: 4 },
            ..GptConfig::default()
        }
    }

    /// Every mesh of the sweep: TP ∈ {1, 2, 4}, SP on/off (TP > 1), CP ∈ {1, 2}, DP ∈ {1, 2}.
    pub fn meshes() -> Vec<Mesh> {
        let mut out = vec![];
        for tp in [1, 2, 4] {
            for sp in [false, true] {
                if sp && tp == 1 {
                    continue;
                }
                for cp in [1, 2] {
                    for dp in [1, 2] {
                        out.push(Mesh { tp, cp, dp, sp });
                    }
                }
            }
        }
        out
    }

    /// The default sweep: every mesh × {fp32, bf16, fp8-delayed} × `seeds` seeds, ring
    /// all-reduce.
    pub fn default_sweep(seeds: u64) -> SweepOptions {
        Self::sweep(&["fp32", "bf16", "fp8-delayed"], &[Algorithm::Ring], seeds)
    }

    /// The full sweep: every mesh × {fp32, bf16, fp8-delayed, fp8-current} × {ring, tree}
    /// all-reduce × `seeds` seeds.
    pub fn full_sweep(seeds: u64) -> SweepOptions {
        Self::sweep(
            &["fp32", "bf16", "fp8-delayed", "fp8-current"],
            &[Algorithm::Ring, Algorithm::Tree],
            seeds,
        )
    }

    /// Every mesh × `recipes` × `algorithms` × `seeds` seeds (1000, 1001, ...).
    pub fn sweep(recipes: &[&str], algorithms: &[Algorithm], seeds: u64) -> SweepOptions {
        let mut runs = vec![];
        for seed in 0..seeds {
            for recipe in recipes {
                for &algorithm in algorithms {
                    for mesh in Self::meshes() {
                        runs.push(RunConfig {
                            mesh,
                            recipe: recipe.to_string(),
                            seed: 1000 + seed,
                            algorithm,
                        });
                    }
                }
            }
        }
        SweepOptions {
            model: Self::model(),
            runs,
            simulation: SimulationConfig::default(),
            perturbation_samples: 4,
            bug_meshes: 3,
            sensitivity_mesh: Some(Self::SENSITIVITY_MESH),
            sensitivity_min_elements: 0,
        }
    }

    /// The mesh of the sensitivity study: tp2-sp-cp2-dp2.
    pub const SENSITIVITY_MESH: Mesh = Mesh {
        tp: 2,
        cp: 2,
        dp: 2,
        sp: true,
    };

    /// The larger GPT of the size study: 2 layers, hidden 128, 4 heads, sequence 64, batch 4
    /// (256 tokens), vocabulary 256, online attention with key blocks of 16 (the CP = 2
    /// chunk): activations of 3·10⁴–1.3·10⁵ elements, weight gradients of 3·10⁴–6.6·10⁴.
    pub fn large_model() -> GptConfig {
        GptConfig {
            layers: 2,
            hidden: 128,
            heads: 4,
            seq: 64,
            batch: 4,
            vocab: 256,
            attention: AttentionImpl::Online { block: 16 },
            ..GptConfig::default()
        }
    }

    /// The size study: the sensitivity study on [`SweepOptions::large_model`] and tensors of
    /// at least 10⁴ elements, one correct run per recipe of `recipes` on the sensitivity mesh
    /// (its false alarms counted as in any sweep), no bug runs.
    pub fn large(recipes: &[&str]) -> SweepOptions {
        let runs = recipes
            .iter()
            .map(|recipe| RunConfig {
                mesh: Self::SENSITIVITY_MESH,
                recipe: recipe.to_string(),
                seed: 1000,
                algorithm: Algorithm::Ring,
            })
            .collect();
        SweepOptions {
            model: Self::large_model(),
            runs,
            bug_meshes: 0,
            sensitivity_min_elements: 10_000,
            ..Self::sweep(&[], &[], 0)
        }
    }
}

/// The comparison of one traced tensor in one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorResult {
    /// Canonical id.
    pub id: String,
    /// Kind for the table, e.g. `linear fwd`, `attention bwd`, `param norm`.
    pub kind: String,
    /// Elements.
    pub elements: usize,
    /// Observed ‖cand − ref‖ / ‖ref‖.
    pub observed: f64,
    /// Our composed threshold (relative).
    pub threshold: f64,
    /// The model's typical relative difference.
    pub expected: f64,
    /// Perturbation estimate (relative).
    pub perturbation: f64,
    /// Machine epsilon of the training dtype (the recipe's activation format), the unit of
    /// the tables.
    pub eps: f64,
    /// Effective rank of the simulated difference's covariance.
    pub effective_rank: f64,
    /// Baselines that reject this (correct) tensor: `torch` (assert_close defaults for the
    /// tensor's dtype), `megatron` (4·1.03^(L+1)·ε of the training dtype).
    pub baseline_alarms: Vec<String>,
    /// Smallest detectable injected perturbation per rule (only on the sensitivity mesh).
    pub sensitivity: Option<Sensitivity>,
    /// The tests beyond the norm (scale, bias, channel, row, sparse) on this tensor.
    pub findings: Vec<Finding>,
}

impl TensorResult {
    /// Our tests raised a false alarm: the norm beyond its threshold, or another test fired.
    pub fn false_alarm(&self) -> bool {
        self.observed > self.threshold || self.findings.iter().any(|f| f.fired)
    }
}

/// Results of one configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunResult {
    /// The configuration.
    pub config: RunConfig,
    /// Per compared tensor.
    pub tensors: Vec<TensorResult>,
    /// FP8 per-tensor scales of the candidate against the reference's own.
    pub scales: ScaleSummary,
    /// The localizer run on this correct step: a module it names is a false alarm.
    pub localizer_false_alarm: Option<Localization>,
}

/// How the candidate's FP8 scales compare with the reference's own (before the reference is
/// re-run with the candidate's scales for the comparison).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ScaleSummary {
    /// Scales compared (operands quantized to FP8 with a per-tensor scale).
    pub compared: usize,
    /// Of which differ.
    pub differing: usize,
    /// Largest |s_cand / s_ref − 1|.
    pub max_relative: f64,
}

fn kind_of(model: &Gpt, id: &str) -> String {
    let Some(t) = TensorId::parse(id) else {
        return "other".into();
    };
    let kind = model
        .module(&t.module)
        .map(|m| format!("{:?}", m.kind).to_lowercase());
    if let TensorRole::ParamGrad { .. } = t.role {
        return format!("param {}", kind.unwrap_or_else(|_| "embedding".into()));
    }
    let pass = match t.pass() {
        crate::engine::Pass::Forward => "fwd",
        crate::engine::Pass::Backward => "bwd",
    };
    format!("{} {pass}", kind.unwrap_or_else(|_| "other".into()))
}

fn rel_diff(r: &Tensor, c: &Tensor) -> f64 {
    let mut d = 0.0;
    let mut n = 0.0;
    for (a, b) in r.values().iter().zip(c.values()) {
        d += (b - a) * (b - a);
        n += a * a;
    }
    if d == 0.0 {
        0.0
    } else if n > 0.0 {
        (d / n).sqrt()
    } else {
        f64::INFINITY
    }
}

/// Run one configuration: reference and sharded steps (two steps for delayed FP8 scaling, the
/// second compared), merge, fresh sites, composed thresholds, perturbation estimate, baselines.
/// Only produced tensors are compared (`fwd.output`, `grad.input`, `param_grad`): a module's
/// inputs are the same tensors under their consumer's id.
pub fn run_config(options: &SweepOptions, run: &RunConfig) -> Result<RunResult> {
    Ok(run_config_with_thresholds(options, run)?.0)
}

/// What a configuration's clean run leaves for the bug runs of the same configuration: our
/// composed thresholds and the localizer's local thresholds (absolute, by id), and the
/// perturbation estimate (relative).
#[derive(Debug, Clone, Default)]
pub struct Thresholds {
    /// Composed (end-to-end) thresholds on ‖cand − ref‖_F.
    pub composed: HashMap<String, f64>,
    /// Local (per-module, on the reference's inputs) thresholds on ‖cand − ref‖_F.
    pub local: HashMap<String, f64>,
    /// The perturbation estimate (relative).
    pub perturbation: HashMap<String, f64>,
    /// Composed bounds on the per-channel and per-row offsets (‖column / row means of
    /// cand − ref‖), by id.
    pub offsets: HashMap<String, OffsetBounds>,
}

/// The reference and the sharded model (with `bug`) of a run, after the warm-up step that
/// delayed FP8 scaling needs (its scales come from the previous step's amax).
fn prepare(
    options: &SweepOptions,
    run: &RunConfig,
    bug: Option<Bug>,
) -> Result<(Recipe, Gpt, ShardedGpt)> {
    let recipe = Recipe::by_name(&run.recipe)?;
    let mut cfg = options.model.clone();
    cfg.seed = run.seed;
    let warmup = usize::from(matches!(
        recipe
            .policy(crate::engine::OpClass::Matmul, crate::engine::Pass::Forward)
            .scaling,
        Scaling::PerTensorDelayed { .. }
    ));
    let mut reference = Gpt::new(cfg.clone(), recipe.clone())?;
    let mut sharded = ShardedGpt::new(Gpt::new(cfg, recipe.clone())?, run.mesh, run.algorithm)?;
    if let Some(b) = bug {
        sharded = sharded.with_bug(b);
    }
    for _ in 0..warmup {
        reference.step()?;
        sharded.step()?;
    }
    Ok((recipe, reference, sharded))
}

/// [`run_config`], also returning the thresholds for bug runs of the same configuration; the
/// localizer runs on the clean step too (a module it names is a localizer false alarm).
pub fn run_config_with_thresholds(
    options: &SweepOptions,
    run: &RunConfig,
) -> Result<(RunResult, Thresholds)> {
    let (recipe, mut reference, mut sharded) = prepare(options, run, None)?;
    let mut before = reference.clone();
    let own_scales_trace = reference.step()?;
    let cand_step = sharded.step()?;
    // FP8: compare against the reference quantized with the candidate's scales (a scale
    // moves as a whole when one amax element differs); count the scales that moved.
    let cand_scales = sharded.scales().clone();
    let mut scales = ScaleSummary::default();
    for (k, s) in reference.scales() {
        scales.compared += 1;
        if let Some(c) = cand_scales.get(k) {
            if c != s {
                scales.differing += 1;
                scales.max_relative = scales.max_relative.max((c / s - 1.0).abs());
            }
        }
    }
    let ref_trace = if cand_scales.is_empty() {
        own_scales_trace.trace
    } else {
        before.set_scale_overrides(cand_scales);
        before.clone().step()?.trace
    };
    let cand = cand_step.merge(Some(&ref_trace))?;
    let sites = fresh_sites(&before, &ref_trace, &run.mesh, run.algorithm)?;
    let mut sim = options.simulation;
    sim.seed ^= run.seed;
    let composed = composed_thresholds(&before, &ref_trace, &sites, sim)?;
    let pert = perturbation_estimate(&before, &ref_trace, options.perturbation_samples, run.seed)?;
    let local = local_thresholds(
        &sites,
        &ref_trace,
        Confidence::Probabilistic {
            delta: sim.delta * NORM_SHARE,
        },
    )?;
    let eps = recipe.activation_format.machine_epsilon();
    let localizer = localize(&mut sharded, &cand_step, &ref_trace, &local, eps)?;
    let depth = before.config().layers as u32 + 1;
    let detection = Detection {
        delta: sim.delta,
        ..Detection::default()
    }
    .accumulated_in(recipe.narrowest_accumulator());
    let studied = Some(run.mesh) == options.sensitivity_mesh
        && Some(run.seed) == options.runs.first().map(|r| r.seed)
        && run.algorithm == Algorithm::Ring;
    // The localizer's view of every module's own output, for its column of the study.
    let replayed = if studied {
        replayed_outputs(&mut sharded, &cand_step, &ref_trace)?
    } else {
        HashMap::new()
    };
    let mut tensors = vec![];
    for e in ref_trace.entries() {
        if TensorId::parse(&e.id).is_some_and(|t| !t.produced()) {
            continue;
        }
        let c = cand.require(&e.id)?;
        let th = composed
            .get(&e.id)
            .copied()
            .unwrap_or(crate::validate::Composed {
                abs: 0.0,
                relative: 0.0,
                expected_relative: 0.0,
                effective_rank: 1.0,
                offsets: OffsetBounds::default(),
            });
        // Units of ε: the training dtype (the recipe's activation format), as TTrace and
        // Megatron report; assert_close judges each tensor by its own dtype.
        let train = recipe.activation_format;
        let mut baseline_alarms = vec![];
        if !torch_assert_close(e.tensor.format()).accepts(e.tensor.values(), c.values()) {
            baseline_alarms.push("torch".to_string());
        }
        if !megatron_ttrace(train, depth).accepts(e.tensor.values(), c.values()) {
            baseline_alarms.push("megatron".to_string());
        }
        // One pass gives the norm (‖Δ‖/‖ref‖ over the finite pairs; non-finite values that
        // disagree count as an infinite difference) and the tests beyond it.
        let verdict = compare_with_sums(
            &e.id,
            &e.tensor,
            c,
            th.abs,
            train.machine_epsilon(),
            detection,
        )
        .0;
        let observed = if verdict.nonfinite_mismatches > 0 {
            f64::INFINITY
        } else {
            verdict.rel_error
        };
        let mut findings = verdict.findings;
        findings.extend(th.offsets.findings(
            e.tensor.shape(),
            e.tensor.values(),
            c.values(),
            train.machine_epsilon(),
        ));
        tensors.push(TensorResult {
            findings,
            id: e.id.clone(),
            kind: kind_of(&before, &e.id),
            elements: e.tensor.len(),
            observed,
            threshold: th.relative,
            expected: th.expected_relative,
            perturbation: pert.get(&e.id).copied().unwrap_or(0.0),
            eps: train.machine_epsilon(),
            effective_rank: th.effective_rank,
            baseline_alarms,
            sensitivity: (studied && e.tensor.len() >= options.sensitivity_min_elements).then(
                || {
                    sensitivity(
                        &Perturbation::ALL,
                        &Subject {
                            offsets: th.offsets,
                            perturbation: pert.get(&e.id).copied().unwrap_or(0.0),
                            depth,
                            detection,
                            replayed: replayed.get(&e.id).map(|output| Replayed {
                                output,
                                threshold_abs: local.get(&e.id).copied().unwrap_or(0.0),
                            }),
                            ..Subject::new(&e.id, &e.tensor, c, th.abs, train)
                        },
                    )
                },
            ),
        });
    }
    let thresholds = Thresholds {
        composed: composed.iter().map(|(k, c)| (k.clone(), c.abs)).collect(),
        offsets: composed
            .iter()
            .map(|(k, c)| (k.clone(), c.offsets))
            .collect(),
        local,
        perturbation: pert,
    };
    Ok((
        RunResult {
            config: run.clone(),
            tensors,
            scales,
            localizer_false_alarm: localizer,
        },
        thresholds,
    ))
}

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
                out.push(*m);
            }
        }
    }
    out
}

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

fn percentile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn median(mut v: Vec<f64>) -> f64 {
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

fn row(kind: &str, ts: &[&TensorResult]) -> KindRow {
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
    let most = crate::io::guard::limits::SWEEP_RUNS;
    if options.simulation.samples as u64 > most {
        return Err(crate::error::Error::InvalidParameter {
            name: "samples",
            reason: format!(
                "{} samples exceed the limit of {most}",
                options.simulation.samples
            ),
        });
    }
    let start = std::time::Instant::now();
    let done: Vec<(RunResult, Thresholds)> = crate::parallel::map(&options.runs, |r| {
        let out = run_config_with_thresholds(options, r);
        progress();
        out
    })
    .into_iter()
    .collect::<Result<Vec<_>>>()?;
    let bug_runs = options.bug_runs();
    let bugs = crate::parallel::map(&bug_runs, |(bug, idx)| {
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
const LOCALIZER: usize = 5;

fn sensitivity_rows(runs: &[RunResult]) -> Vec<SensitivityRow> {
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

fn bug_rows(bugs: &[BugResult]) -> Vec<BugRow> {
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
                                Some(crate::engine::Pass::Forward) => "fwd",
                                Some(crate::engine::Pass::Backward) => "bwd",
                                None => "?",
                            }
                        )
                    })
                    .unwrap_or_else(|| "-".into()),
            })
        })
        .collect()
}

/// Run `run` (with `bug`, if any) and write two trace directories under `dir`: `reference`
/// (the single-device step — for FP8, quantized with the candidate's scales, as the checks
/// compare) and `candidate` (every rank's shards with their layouts), in the format of
/// [`Manifest`](crate::io::Manifest); the reference's manifest carries the clean run's composed
/// `thresholds` so that `ttrace check` can use them.
pub fn dump_run(
    options: &SweepOptions,
    run: &RunConfig,
    bug: Option<Bug>,
    thresholds: &Thresholds,
    dir: &Path,
) -> Result<()> {
    let (_, mut reference, mut sharded) = prepare(options, run, bug)?;
    let cand = sharded.step()?;
    if !sharded.scales().is_empty() {
        reference.set_scale_overrides(sharded.scales().clone());
    }
    let ref_trace = reference.step()?.trace;
    write_dump(run, &reference, &ref_trace, &cand, thresholds, dir)
}

/// Write the two trace directories of [`dump_run`] from a step already run.
fn write_dump(
    run: &RunConfig,
    reference: &Gpt,
    ref_trace: &Trace,
    cand: &ShardedStep,
    thresholds: &Thresholds,
    dir: &Path,
) -> Result<()> {
    let mut kinds = HashMap::new();
    for e in ref_trace.entries() {
        let module = TensorId::parse(&e.id).map(|t| t.module);
        if let Some(m) = module.and_then(|m| reference.module(&m).ok()) {
            kinds.insert(e.id.clone(), m.kind);
        }
    }
    let single = Mesh::single();
    let ref_entries: Vec<_> = ref_trace
        .entries()
        .iter()
        .map(|e| {
            (
                e.id.clone(),
                crate::shard::Layout::replicated(),
                vec![e.tensor.clone()],
            )
        })
        .collect();
    write_trace_dir(
        &dir.join("reference"),
        &single,
        Some(&run.recipe),
        &ref_entries,
        &kinds,
        &thresholds.composed,
    )?;
    let cand_entries: Vec<_> = cand
        .entries
        .iter()
        .map(|e| (e.id.clone(), e.layout, e.shards.clone()))
        .collect();
    write_trace_dir(
        &dir.join("candidate"),
        &run.mesh,
        Some(&run.recipe),
        &cand_entries,
        &kinds,
        &HashMap::new(),
    )
}

/// Whether `bug` can show on this mesh with this recipe (FP8 per-tensor scaling, batch
/// size for the reduce-scatter confusion).
fn applies(bug: Bug, mesh: &Mesh, fp8: bool, batch: usize) -> bool {
    let sp = mesh.sequence_parallel();
    match bug {
        Bug::SpNormGradNotReduced | Bug::SpRowBiasGradNotReduced => sp,
        Bug::CpWrongLseCorrection
        | Bug::CpChunkOrderNotInverted
        | Bug::CpStaleKvBlock
        | Bug::MissingMicrobatchDivision => mesh.cp > 1,
        Bug::Fp8AmaxNotReduced => fp8 && mesh.tp > 1,
        Bug::DpGradSummedNotAveraged | Bug::EmbeddingGradNotDpReduced => mesh.dp > 1,
        Bug::RowBiasOnEveryRank | Bug::SoftmaxScaleFromLocalWidth | Bug::QkvWrongInterleave => {
            mesh.tp > 1
        }
        Bug::GradAllReduceInBf16 => mesh.dp * mesh.cp > 1,
        Bug::NormEpsMismatch => true,
        Bug::ReduceScatterWrongDim => sp && (batch / mesh.dp) % mesh.tp == 0,
    }
}

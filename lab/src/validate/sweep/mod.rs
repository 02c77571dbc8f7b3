//! The validation sweep: configurations × recipes × seeds, per-tensor results, and the table
//! per tensor kind that `ttrace validate` prints.

use std::collections::BTreeMap;

use serde::Serialize;

use std::collections::HashMap;
use std::path::Path;

use crate::bugs::Bug;
use crate::validate::localize::{localize, replayed_outputs};
use ttrace::__lab::compare_with_sums;
use ttrace::bounds::Confidence;
use ttrace::bounds::{megatron_ttrace, torch_assert_close};
use ttrace::check::{check, CheckReport, Detection, Detector, Finding, Localization, NORM_SHARE};

mod bugs;
mod dump;
mod report;

use crate::shard::collective::Algorithm;
use crate::shard::model::{ShardedGpt, ShardedStep};
use crate::validate::compose::{
    composed_thresholds, perturbation_estimate, OffsetBounds, SimulationConfig,
};
use crate::validate::fresh::{fresh_sites, local_thresholds};
use crate::validate::sensitivity::{
    sensitivity, Perturbation, Replayed, RuleFigures, Sensitivity, Subject,
};
pub use bugs::{bug_meshes, run_bug, run_bug_dumping, BugResult};
pub use dump::dump_run;
pub use report::{run_sweep, BugRow, KindRow, SensitivityRow, SweepReport, TestColumn};
use ttrace::engine::AttentionImpl;
use ttrace::engine::{Gpt, GptConfig};
use ttrace::io::write_trace_dir;
use ttrace::trace::Mesh;
use ttrace::trace::{TensorId, TensorRole, Trace};
use ttrace::Result;
use ttrace::Tensor;
use ttrace::{Recipe, Scaling};

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
                        // Sizes of at most 4: always a valid mesh.
                        if let Ok(m) = Mesh::megatron(tp, cp, dp, sp) {
                            out.push(m);
                        }
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
            sensitivity_mesh: Some(Self::sensitivity_mesh()),
            sensitivity_min_elements: 0,
        }
    }

    /// The mesh of the sensitivity study: tp2-sp-cp2-dp2.
    pub fn sensitivity_mesh() -> Mesh {
        Mesh::megatron(2, 2, 2, true).unwrap_or_else(|_| Mesh::single())
    }

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
                mesh: Self::sensitivity_mesh(),
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
        ttrace::engine::Pass::Forward => "fwd",
        ttrace::engine::Pass::Backward => "bwd",
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
            .policy(
                ttrace::engine::OpClass::Matmul,
                ttrace::engine::Pass::Forward
            )
            .scaling,
        Scaling::PerTensorDelayed { .. }
    ));
    let mut reference = Gpt::new(cfg.clone(), recipe.clone())?;
    let mut sharded = ShardedGpt::new(
        Gpt::new(cfg, recipe.clone())?,
        run.mesh.clone(),
        run.algorithm,
    )?;
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
    let sites = fresh_sites(
        &before,
        &ref_trace,
        &run.mesh,
        sharded.plan(),
        run.algorithm,
    )?;
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
    let studied = Some(&run.mesh) == options.sensitivity_mesh.as_ref()
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

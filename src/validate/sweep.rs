//! The validation sweep: configurations × recipes × seeds, per-tensor results, and the table
//! per tensor kind that `ttrace validate` prints.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::bounds::baselines::baselines_for;
use crate::engine::attention::AttentionImpl;
use crate::engine::model::{Gpt, GptConfig};
use crate::engine::policy::{Recipe, Scaling};
use crate::engine::tensor::Tensor;
use crate::error::Result;
use crate::format::Format;
use crate::shard::collective::Algorithm;
use crate::shard::layout::Mesh;
use crate::shard::model::ShardedGpt;
use crate::validate::compose::{perturbation_estimate, simulate, SimulationConfig};
use crate::validate::fresh::fresh_sites;

/// One configuration of the sweep.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunConfig {
    /// The mesh.
    pub mesh: Mesh,
    /// Recipe name (`fp32`, `bf16`, `fp8-delayed`, ...).
    pub recipe: String,
    /// Seed of the consistent generator.
    pub seed: u64,
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
    /// All-reduce algorithm of the sharded runs.
    pub algorithm: Algorithm,
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

    /// The default sweep: every mesh × {fp32, bf16, fp8-delayed} × `seeds` seeds.
    pub fn default_sweep(seeds: u64) -> SweepOptions {
        let mut runs = vec![];
        for seed in 0..seeds {
            for recipe in ["fp32", "bf16", "fp8-delayed"] {
                for mesh in Self::meshes() {
                    runs.push(RunConfig {
                        mesh,
                        recipe: recipe.to_string(),
                        seed: 1000 + seed,
                    });
                }
            }
        }
        SweepOptions {
            model: Self::model(),
            runs,
            simulation: SimulationConfig::default(),
            perturbation_samples: 4,
            algorithm: Algorithm::Ring,
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
    /// Machine epsilon of the tensor's format (for "units of ε").
    pub eps: f64,
    /// Effective rank of the simulated difference's covariance.
    pub effective_rank: f64,
    /// Names of the baselines that reject this (correct) tensor.
    pub baseline_alarms: Vec<String>,
}

impl TensorResult {
    /// Our threshold raised a false alarm.
    pub fn false_alarm(&self) -> bool {
        self.observed > self.threshold
    }
}

/// Results of one configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunResult {
    /// The configuration.
    pub config: RunConfig,
    /// Per compared tensor.
    pub tensors: Vec<TensorResult>,
}

fn kind_of(model: &Gpt, id: &str) -> String {
    let (name, what) = id.split_once('|').unwrap_or((id, ""));
    if what == "param_grad" {
        let module = name.rsplit_once('.').map(|(m, _)| m).unwrap_or(name);
        let k = model
            .module(module)
            .map(|m| format!("{:?}", m.kind).to_lowercase())
            .unwrap_or_else(|_| "embedding".into());
        return format!("param {k}");
    }
    let k = model
        .module(name)
        .map(|m| format!("{:?}", m.kind).to_lowercase())
        .unwrap_or_else(|_| "other".into());
    let pass = if what.starts_with("fwd") {
        "fwd"
    } else {
        "bwd"
    };
    format!("{k} {pass}")
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
    let mut sharded = ShardedGpt::new(Gpt::new(cfg, recipe.clone())?, run.mesh, options.algorithm)?;
    for _ in 0..warmup {
        reference.step()?;
        sharded.step()?;
    }
    let before = reference.clone();
    let ref_trace = reference.step()?.trace;
    let cand = sharded.step()?.merge(Some(&ref_trace))?;
    let sites = fresh_sites(&before, &ref_trace, &run.mesh)?;
    let mut sim = options.simulation;
    sim.seed ^= run.seed;
    let composed = simulate(&before, &ref_trace, &sites, sim)?;
    let pert = perturbation_estimate(&before, &ref_trace, options.perturbation_samples, run.seed)?;
    let depth = before.config().layers as u32 + 1;
    let mut tensors = vec![];
    for e in ref_trace.entries() {
        if e.id.contains("|fwd.input.") || e.id.contains("|grad.output.") {
            continue;
        }
        let c = cand.require(&e.id)?;
        let observed = rel_diff(&e.tensor, c);
        let th = composed
            .get(&e.id)
            .copied()
            .unwrap_or(crate::validate::Composed {
                abs: 0.0,
                relative: 0.0,
                expected_relative: 0.0,
                effective_rank: 1.0,
            });
        let fmt = e.tensor.format();
        let eps_fmt = if recipe.name.starts_with("fp8") && fmt == Format::BF16 {
            Format::BF16
        } else {
            fmt
        };
        let baseline_alarms = baselines_for(eps_fmt, depth)
            .into_iter()
            .filter(|b| !b.accepts(e.tensor.values(), c.values()))
            .map(|b| b.name)
            .collect();
        tensors.push(TensorResult {
            id: e.id.clone(),
            kind: kind_of(&before, &e.id),
            elements: e.tensor.len(),
            observed,
            threshold: th.relative,
            expected: th.expected_relative,
            perturbation: pert.get(&e.id).copied().unwrap_or(0.0),
            eps: fmt.machine_epsilon(),
            effective_rank: th.effective_rank,
            baseline_alarms,
        });
    }
    Ok(RunResult {
        config: run.clone(),
        tensors,
    })
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
    /// Largest observed relative error, in units of ε of the tensor's format.
    pub max_observed_eps: f64,
    /// Median of our threshold over the differing tensors, in units of ε.
    pub median_threshold_eps: f64,
    /// Median of threshold / observed over the differing tensors.
    pub tightness_median: f64,
    /// Largest threshold / observed over the differing tensors.
    pub tightness_worst: f64,
    /// Our false alarms.
    pub false_alarms: usize,
    /// Perturbation estimate: false alarms.
    pub perturbation_false_alarms: usize,
    /// Perturbation estimate: median estimate / observed over the differing tensors.
    pub perturbation_tightness_median: f64,
    /// False alarms of each baseline.
    pub baseline_false_alarms: BTreeMap<String, usize>,
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
    /// Every run's per-tensor results.
    pub runs: Vec<RunResult>,
    /// Wall time in seconds.
    pub seconds: f64,
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
            let key = b.split(" (").next().unwrap_or(b).to_string();
            *baseline_false_alarms.entry(key).or_insert(0) += 1;
        }
    }
    KindRow {
        kind: kind.to_string(),
        compared: ts.len(),
        differing: differing.len(),
        max_observed_eps: ts.iter().map(|t| t.observed / t.eps).fold(0.0, f64::max),
        median_threshold_eps: median(differing.iter().map(|t| t.threshold / t.eps).collect()),
        tightness_median: median(tight.clone()),
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
    }
}

impl SweepReport {
    /// Aggregate run results into the per-kind table.
    pub fn new(options: SweepOptions, runs: Vec<RunResult>, seconds: f64) -> SweepReport {
        let mut by_kind: BTreeMap<String, Vec<&TensorResult>> = BTreeMap::new();
        for r in &runs {
            for t in &r.tensors {
                by_kind.entry(t.kind.clone()).or_default().push(t);
            }
        }
        let rows = by_kind.iter().map(|(k, ts)| row(k, ts)).collect();
        let all: Vec<&TensorResult> = runs.iter().flat_map(|r| r.tensors.iter()).collect();
        let total = row("all", &all);
        SweepReport {
            options,
            rows,
            total,
            runs,
            seconds,
        }
    }
}

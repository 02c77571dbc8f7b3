//! `ttrace validate`: the validation sweep.

use std::io::{self, Write};

use crate::out::{stdout_error, write_atomic};
use crate::render::{render_bugs, render_sensitivity, render_svg, render_table};
use crate::Outcome;

/// The options of `ttrace validate`.
#[derive(clap::Args)]
pub struct Args {
    /// The larger sweep: 6 seeds, fp8-current too, ring and tree all-reduce.
    #[arg(long)]
    pub full: bool,
    /// Number of seeds (default 2, or 6 with --full).
    #[arg(long)]
    pub seeds: Option<u64>,
    /// Difference-simulation samples per run.
    #[arg(long, default_value_t = 12)]
    pub samples: usize,
    /// Failure probability δ of our thresholds.
    #[arg(long, default_value_t = 1e-6)]
    pub delta: f64,
    /// Worker threads (default: all cores). Results do not depend on it.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Only these recipes (repeatable): fp32, bf16, fp8-delayed, fp8-current.
    #[arg(long = "recipe", value_parser = crate::out::parse_recipe)]
    pub recipes: Vec<String>,
    /// Write the full report as JSON to this path, and an SVG plot next to it.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Skip the bug-detection runs.
    #[arg(long)]
    pub no_bugs: bool,
    /// The size study instead: the sensitivity study on a larger GPT (hidden 128, 256
    /// tokens), over its tensors of at least 10⁴ elements, one correct run per recipe
    /// (fp32, bf16, fp8-delayed unless --recipe says).
    #[arg(long, conflicts_with_all = ["full", "seeds", "no_bugs"])]
    pub large: bool,
}

/// Run the sweep, print the tables and write the reports.
pub fn run(a: Args) -> Result<Outcome, String> {
    let Args {
        full,
        seeds,
        samples,
        delta,
        threads,
        recipes,
        json,
        no_bugs,
        large,
    } = a;
    let (recipes, json) = (recipes.as_slice(), json.as_deref());
    use ttrace_lab::validate::{run_sweep, SweepOptions};
    let seeds = seeds.unwrap_or(if full { 6 } else { 2 });
    let most = ttrace::io::limits::SWEEP_RUNS;
    if seeds == 0 || seeds > most {
        return Err(format!(
            "--seeds must be between 1 and {most} (got {seeds})"
        ));
    }
    if samples as u64 > most {
        return Err(format!("--samples must be at most {most} (got {samples})"));
    }
    let mut options = if large {
        // The default sweep's recipes, or those asked for.
        let asked: Vec<&str> = recipes.iter().map(String::as_str).collect();
        SweepOptions::large(if asked.is_empty() {
            &["fp32", "bf16", "fp8-delayed"]
        } else {
            &asked
        })
    } else if full {
        SweepOptions::full_sweep(seeds)
    } else {
        SweepOptions::default_sweep(seeds)
    };
    if !recipes.is_empty() {
        options.runs.retain(|run| recipes.contains(&run.recipe));
        if options.runs.is_empty() {
            return Err(format!(
                "no run of the {} sweep uses the recipe(s) {}",
                if full { "full" } else { "default" },
                recipes.join(", ")
            ));
        }
    }
    options.simulation.samples = samples;
    if no_bugs {
        options.bug_meshes = 0;
    }
    options.simulation.delta = delta;
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(t) = threads {
        if t == 0 {
            return Err("--threads must be at least 1".into());
        }
        pool = pool.num_threads(t);
    }
    let pool = pool
        .build()
        .map_err(|e| format!("starting worker threads: {e}"))?;
    let bar = indicatif::ProgressBar::new((options.runs.len() + options.bug_runs().len()) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} validate [{elapsed_precise}] {bar:40} {pos}/{len} runs (eta {eta})",
        )
        .map_err(|e| e.to_string())?,
    );
    let report = pool
        .install(|| run_sweep(&options, &|| bar.inc(1)))
        .map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    let compared: usize = report.runs.iter().map(|r| r.tensors.len()).sum();
    let meshes: std::collections::BTreeSet<String> =
        options.runs.iter().map(|r| r.mesh.label()).collect();
    outln!(
        "ttrace validate: {} runs ({} meshes x recipes x seeds), model {} layers, hidden {}, \
         seq {}, batch {}; {} produced tensors compared; delta = {:e}, {} simulation samples; \
         {:.1} s on {} threads",
        report.runs.len(),
        meshes.len(),
        options.model.layers,
        options.model.hidden,
        options.model.seq,
        options.model.batch,
        compared,
        delta,
        samples,
        report.seconds,
        pool.current_num_threads()
    );
    outln!();
    out!("{}", render_table(&report));
    outln!();
    outln!(
        "ε: machine epsilon of the training dtype (fp32: 2^-23; bf16 and fp8 recipes: 2^-7). \
         tight = threshold / observed, over tensors that differ. FA = false alarms on these \
         correct runs (pert = perturbation estimate; torch = assert_close defaults for the \
         tensor's dtype; megatron = 4*1.03^(L+1)*ε)."
    );
    if !report.bugs.is_empty() {
        outln!();
        outln!(
            "Bug detection: every catalog bug injected on up to {} meshes where it applies, per \
             recipe (seed {}); end-to-end = our composed thresholds flag a tensor; detected = \
             end-to-end or the localizer; localized = the localizer names the module kind and \
             pass of the bug; min err/thr = smallest over runs of the largest error / \
             threshold; torch, megatron, pert = runs in which that baseline flags the bug.",
            options.bug_meshes,
            options.runs.first().map(|r| r.seed).unwrap_or(0)
        );
        out!("{}", render_bugs(&report));
    }
    outln!(
        "Localizer on the {} correct runs: {} false alarms.",
        report.runs.len(),
        report.localizer_false_alarms
    );
    if !report.sensitivity_rows.is_empty() {
        outln!();
        outln!(
            "Sensitivity on {}: the smallest relative perturbation ρ of one tensor each rule \
             detects with 99% power, median over tensors, in units of ε (smaller is more \
             sensitive; FA n: the rule rejects n of these correct tensors unperturbed, so it has \
             no figure for them). Shapes: gaussian (‖N‖ ≈ ρ‖ref‖), scale (1 ± ρ), channel bias \
             (ρ·rms·g per channel), k elements (each ±ρ of its magnitude). Rules: ours = the \
             norm and the scale, bias and sparse tests; norm only; megatron = \
             4·1.03^(L+1)·ε; torch = assert_close; perturbation estimate — all end to end; \
             localizer = the module's own output replayed on the reference's inputs, \
             perturbed, against its local threshold and the same tests (0: any change is \
             detected, the replay being bit-identical). inf: not detected at ρ = 100.",
            options
                .sensitivity_mesh
                .map(|m| m.label())
                .unwrap_or_default()
        );
        out!("{}", render_sensitivity(&report));
    }
    if report.fp8_scales.compared > 0 {
        outln!(
            "FP8: {} of {} per-tensor scales of the sharded runs differ from the reference's \
             own (largest relative difference {:.2e}: an amax element differs by round-off); \
             FP8 runs are compared against the reference quantized with the candidate's scales.",
            report.fp8_scales.differing,
            report.fp8_scales.compared,
            report.fp8_scales.max_relative
        );
    }
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        write_atomic(path, text.as_bytes())?;
        let svg = path.with_extension("svg");
        write_atomic(&svg, render_svg(&report).as_bytes())?;
        outln!("report: {} and {}", path.display(), svg.display());
    }
    let clean = report.total.false_alarms == 0 && report.localizer_false_alarms == 0;
    let (runs, detected, localized) = report.bug_rows.iter().fold((0, 0, 0), |a, r| {
        (a.0 + r.runs, a.1 + r.detected, a.2 + r.localized)
    });
    outln!();
    outln!(
        "verdict: {} — {} false alarms in {} tensors of {} correct runs (localizer: {}){}",
        if clean { "PASS" } else { "FAIL" },
        report.total.false_alarms,
        report.total.compared,
        report.runs.len(),
        report.localizer_false_alarms,
        if runs > 0 {
            format!("; {detected} of {runs} bug runs detected, {localized} localized")
        } else {
            String::new()
        }
    );
    Ok(Outcome::of(clean))
}

//! `ttrace simulate`: one sharded training step, checked and localized.

use std::io::{self, Write};

use crate::out::stdout_error;
use crate::Outcome;

/// The options of `ttrace simulate`.
#[derive(clap::Args)]
pub struct Args {
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 2)]
    pub tp: usize,
    /// Sequence parallelism.
    #[arg(long)]
    pub sp: bool,
    /// Context-parallel size.
    #[arg(long, default_value_t = 1)]
    pub cp: usize,
    /// Data-parallel size.
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Recipe: fp32, bf16, fp8-delayed, fp8-current.
    #[arg(long, default_value = "bf16", value_parser = crate::out::parse_recipe)]
    pub recipe: String,
    /// Inject this bug (see `ttrace bugs`).
    #[arg(long, value_parser = parse_bug)]
    pub bug: Option<ttrace_lab::bugs::Bug>,
    /// Seed of the consistent generator.
    #[arg(long, default_value_t = 1000)]
    pub seed: u64,
    /// All-reduce algorithm.
    #[arg(long, value_enum, default_value_t = Algorithm::Ring)]
    pub algorithm: Algorithm,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also write the reference and candidate traces (safetensors per rank + manifest)
    /// to DIR/reference and DIR/candidate.
    #[arg(long)]
    pub dump: Option<std::path::PathBuf>,
}

/// The all-reduce algorithm of the simulated collectives.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Algorithm {
    /// Ring reduce-scatter and all-gather.
    Ring,
    /// A binary tree.
    Tree,
}

/// A bug of the catalog, by name.
fn parse_bug(s: &str) -> Result<ttrace_lab::bugs::Bug, String> {
    ttrace_lab::bugs::Bug::by_name(s).map_err(|e| e.to_string())
}

/// Simulate, check, localize and print.
pub fn run(a: Args) -> Result<Outcome, String> {
    let Args {
        tp,
        sp,
        cp,
        dp,
        recipe,
        bug,
        seed,
        algorithm,
        json,
        dump,
    } = a;
    use ttrace_lab::validate::{
        run_bug_dumping, run_config_with_thresholds, RunConfig, SweepOptions,
    };
    let (recipe, dump) = (recipe.as_str(), dump.as_deref());
    let algorithm = match algorithm {
        Algorithm::Ring => ttrace_lab::shard::Algorithm::Ring,
        Algorithm::Tree => ttrace_lab::shard::Algorithm::Tree,
    };
    let mesh = ttrace::trace::Mesh::megatron(tp, cp, dp, sp).map_err(|e| e.to_string())?;
    let options = SweepOptions::default_sweep(1);
    let run = RunConfig {
        mesh: mesh.clone(),
        recipe: recipe.to_string(),
        seed,
        algorithm,
    };
    let (_, thresholds) = run_config_with_thresholds(&options, &run).map_err(|e| e.to_string())?;
    // One run of the step, checked and (with --dump) written.
    let r = run_bug_dumping(&options, &run, bug, &thresholds, dump).map_err(|e| e.to_string())?;
    if let Some(dir) = dump {
        if !json {
            outln!(
                "traces written to {} and {}",
                dir.join("reference").display(),
                dir.join("candidate").display()
            );
        }
    }
    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?
        );
    } else {
        outln!(
            "ttrace simulate: {} {}{} (seed {seed}, {} all-reduce), model {} layers, hidden {}",
            mesh.label(),
            recipe,
            bug.map(|b| format!(", bug {b}")).unwrap_or_default(),
            if algorithm == ttrace_lab::shard::Algorithm::Ring {
                "ring"
            } else {
                "tree"
            },
            options.model.layers,
            options.model.hidden
        );
        out!("{}", ttrace::check::render_check(&r.check));
        match &r.localization {
            None => outln!("localizer: every module's own output is within its local threshold"),
            Some(l) => outln!("{}", ttrace::check::localization_line(l)),
        }
    }
    Ok(Outcome::of(!r.detected))
}

//! `ttrace check`: compare a candidate trace directory with a reference one.

use std::io::{self, Write};

use clap::ValueEnum;
use ttrace::check::PricingMode;

use crate::out::{refuse_report_inside, stdout_error, write_atomic};
use crate::Outcome;

/// The options of `ttrace check`.
#[derive(clap::Args)]
pub struct Args {
    /// The reference trace directory.
    pub reference: std::path::PathBuf,
    /// The candidate trace directory.
    pub candidate: std::path::PathBuf,
    /// Also write the report as JSON to this path.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Thresholds: `auto` uses the producer's thresholds from the reference manifest where
    /// present and prices the rest from the metadata and the data; `local` prices every
    /// tensor from the metadata and the data.
    #[arg(long, value_enum, default_value_t = Pricing::Auto)]
    pub pricing: Pricing,
    /// Summary traces only: the relative threshold (on ‖c − r‖ / ‖r‖) a lower bound must
    /// exceed to prove a difference, for tensors without one from `--thresholds`.
    #[arg(long)]
    pub rtol: Option<f64>,
    /// Summary traces only: per-tensor relative thresholds from the JSON report of a full
    /// check (`ttrace check --json`) of a traced step of the same runs.
    #[arg(long)]
    pub thresholds: Option<std::path::PathBuf>,
}

/// How `ttrace check` prices thresholds.
#[derive(Clone, Copy, ValueEnum)]
pub enum Pricing {
    /// The producer's thresholds from the reference manifest where present, the local model
    /// elsewhere.
    Auto,
    /// The local model everywhere.
    Local,
}

/// Check, print the report, and write it as JSON when asked.
pub fn run(a: Args) -> Result<Outcome, String> {
    let mode = match a.pricing {
        Pricing::Auto => PricingMode::Auto,
        Pricing::Local => PricingMode::Local,
    };
    let summaries = [&a.reference, &a.candidate].map(|p| ttrace::io::summary::is_summary_dir(p));
    if summaries[0] || summaries[1] {
        if summaries != [true, true] {
            return Err(format!(
                "{} is a summary trace and {} is not: summaries compare only with summaries",
                if summaries[0] {
                    a.reference.display()
                } else {
                    a.candidate.display()
                },
                if summaries[0] {
                    a.candidate.display()
                } else {
                    a.reference.display()
                }
            ));
        }
        return check_summaries_cli(&a).map(Outcome::of);
    }
    if a.rtol.is_some() || a.thresholds.is_some() {
        return Err(
            "--rtol and --thresholds apply to summary traces only (a full trace's \
                    thresholds are priced from its data)"
                .into(),
        );
    }
    let passed = check_dirs_cli(&a.reference, &a.candidate, a.json.as_deref(), mode)?;
    Ok(Outcome::of(passed))
}

/// Compare two summary traces; `Ok(true)` when no difference is proven.
fn check_summaries_cli(a: &Args) -> Result<bool, String> {
    use ttrace::check::SummaryThresholds;
    if let Some(path) = &a.json {
        refuse_report_inside(path, &[&a.reference, &a.candidate])?;
    }
    let mut t = match &a.thresholds {
        Some(p) => {
            let bytes =
                ttrace::io::read_limited(p, ttrace::io::limits::MANIFEST_BYTES, "a check report")
                    .map_err(|e| e.to_string())?;
            let text =
                String::from_utf8(bytes).map_err(|_| format!("{}: not UTF-8 text", p.display()))?;
            SummaryThresholds::from_check_report(&text).map_err(|e| e.to_string())?
        }
        None => SummaryThresholds::default(),
    };
    if let Some(r) = a.rtol {
        if !(r.is_finite() && r >= 0.0) {
            return Err(format!(
                "--rtol must be a finite non-negative number (got {r})"
            ));
        }
        t.rtol = Some(r);
    }
    let mut r = ttrace::io::summary::SummaryRun::open(&a.reference).map_err(|e| e.to_string())?;
    let mut c = ttrace::io::summary::SummaryRun::open(&a.candidate).map_err(|e| e.to_string())?;
    let out = ttrace::check::compare_summaries(&mut r, &mut c, &t).map_err(|e| e.to_string())?;
    outln!(
        "ttrace check: summaries of {} against {}",
        a.candidate.display(),
        a.reference.display()
    );
    out!("{}", ttrace::check::render_summary_check(&out));
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?;
        write_atomic(path, text.as_bytes())?;
    }
    Ok(out.proven() == 0)
}

fn check_dirs_cli(
    reference: &std::path::Path,
    candidate: &std::path::Path,
    json: Option<&std::path::Path>,
    mode: ttrace::check::PricingMode,
) -> Result<bool, String> {
    if let Some(path) = json {
        refuse_report_inside(path, &[reference, candidate])?;
    }
    // A directory of traced steps (step0/, step1/, …) resolves to the one both hold.
    let (reference, candidate) =
        ttrace::check::resolve_steps(reference, candidate).map_err(|e| e.to_string())?;
    let (reference, candidate) = (reference.as_path(), candidate.as_path());
    // Each trace is opened (its headers validated) once; no file stays open between reads.
    let r = ttrace::io::TraceDir::open(reference).map_err(|e| e.to_string())?;
    let c = ttrace::io::TraceDir::open(candidate).map_err(|e| e.to_string())?;
    let (n, world) = (r.ids().len(), c.manifest().mesh.world());
    let bar = indicatif::ProgressBar::new(n as u64);
    let out =
        ttrace::check::check_dir_traces(&r, &c, mode, &|| bar.inc(1)).map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    // A pipelined trace's mesh is one stage's.
    let ranks = match c.manifest().pipeline {
        Some(p) if p.stages > 1 => format!(
            "{} pipeline stages of {world} rank{}, {} microbatches",
            p.stages,
            if world == 1 { "" } else { "s" },
            p.microbatches
        ),
        Some(p) if p.microbatches > 1 => format!("{world} ranks, {} microbatches", p.microbatches),
        _ => format!("{world} ranks"),
    };
    outln!(
        "ttrace check: {} against {} ({ranks})",
        candidate.display(),
        reference.display(),
    );
    out!("{}", ttrace::check::render_dir_check(&out));
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?;
        write_atomic(path, text.as_bytes())?;
    }
    Ok(out.report.passed())
}

//! The `ttrace` command line: a thin layer over the library (parse, call, print).

use std::io::{self, BufRead, BufWriter, Write};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

/// `println!` that returns a write error (a closed pipe, a full disk, `> /dev/full`) as the
/// command's error (exit code 2) instead of panicking.
macro_rules! outln {
    () => {
        writeln!(io::stdout().lock()).map_err(stdout_error)?
    };
    ($($t:tt)*) => {
        writeln!(io::stdout().lock(), $($t)*).map_err(stdout_error)?
    };
}

/// `print!` with the same error handling as [`outln!`].
macro_rules! out {
    ($($t:tt)*) => {
        write!(io::stdout().lock(), $($t)*).map_err(stdout_error)?
    };
}

fn stdout_error(e: io::Error) -> String {
    format!("writing to standard output: {e}")
}
use serde::Serialize;
use ttrace::bounds::{baselines_for, Baseline, MatmulPlan, NormData, NormSide};
use ttrace::bounds::{
    elementwise_threshold, matmul_threshold, norm_threshold, plan_matmul, plan_sum,
    softmax_threshold, Confidence, Elementwise, NormOp, TermStats, Threshold,
};
use ttrace::engine::{AttentionImpl, Variance};
use ttrace::{Format, Overflow};
use ttrace::{Policy, Scaling, Tensor};

#[derive(Parser)]
#[command(
    name = "ttrace",
    version,
    about = "Tell floating-point round-off apart from real bugs in distributed training",
    long_about = None
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the constants of every number format (u = 2^-p is the unit roundoff,
    /// eps = 2^(1-p) the machine epsilon).
    Formats {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Round numbers read from standard input (one per line) to a format, correctly.
    ///
    /// Each output line is the rounded value as shortest round-trip decimal text
    /// (NaN, inf, -inf and -0 included).
    Round {
        /// Target format: f64, f32, tf32, f16, bf16, e4m3, e5m2.
        #[arg(long, value_parser = parse_format)]
        format: Format,
        /// Clamp overflow to the largest finite value instead of inf (or NaN for e4m3).
        #[arg(long)]
        saturate: bool,
    },
    /// Price the comparison threshold of an op between a reference and a candidate policy,
    /// for data with given statistics (planning; `ttrace::bounds` prices real tensors).
    ///
    /// A policy is written `in=bf16,acc=f32,out=bf16,order=ORDER[,products=exact|FMT]`;
    /// ORDER is `sequential`, `pairwise:B`, `blocked:B`, `blockfma:B`, or
    /// `splitk:P:FMT:COMBINE` with COMBINE `seq`, `tree` or `ring[:START]` (inner order
    /// sequential).
    Threshold {
        /// The op.
        #[arg(value_enum)]
        op: Op,
        /// Rows of the output (matmul: m; sum: number of sums).
        #[arg(long, default_value_t = 1024)]
        m: usize,
        /// Reduction length (matmul: k; sum: n).
        #[arg(long, default_value_t = 4096)]
        k: usize,
        /// Columns of the output (matmul only).
        #[arg(long, default_value_t = 1024)]
        n: usize,
        /// Reference policy.
        #[arg(
            long = "ref",
            default_value = "in=bf16,acc=f32,out=bf16,order=sequential"
        )]
        reference: String,
        /// Candidate policy.
        #[arg(
            long = "cand",
            default_value = "in=bf16,acc=f32,out=bf16,order=splitk:8:bf16:ring"
        )]
        candidate: String,
        /// Mean of the input entries.
        #[arg(long, default_value_t = 0.0)]
        mean: f64,
        /// Standard deviation of the input entries.
        #[arg(long, default_value_t = 1.0)]
        std: f64,
        /// Failure probability of the probabilistic threshold.
        #[arg(long, default_value_t = 1e-6)]
        delta: f64,
        /// Price the guaranteed (worst-case) threshold instead.
        #[arg(long)]
        guaranteed: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The validation sweep: simulate sharded training steps (TP/SP/CP/DP) of a tiny GPT,
    /// merge the shards, and compare every traced tensor against the reference with our
    /// composed thresholds, the perturbation estimate and the folklore baselines.
    ///
    /// Default: TP in {1,2,4}, SP on/off, CP in {1,2}, DP in {1,2}, recipes fp32, bf16 and
    /// fp8-delayed, 2 seeds (120 runs). Exit code 1 if any of our thresholds raised a false
    /// alarm, 2 on an error.
    Validate {
        /// The larger sweep: 6 seeds, fp8-current too, ring and tree all-reduce.
        #[arg(long)]
        full: bool,
        /// Number of seeds (default 2, or 6 with --full).
        #[arg(long)]
        seeds: Option<u64>,
        /// Difference-simulation samples per run.
        #[arg(long, default_value_t = 12)]
        samples: usize,
        /// Failure probability δ of our thresholds.
        #[arg(long, default_value_t = 1e-6)]
        delta: f64,
        /// Worker threads (default: all cores). Results do not depend on it.
        #[arg(long)]
        threads: Option<usize>,
        /// Only these recipes (repeatable): fp32, bf16, fp8-delayed, fp8-current.
        #[arg(long = "recipe")]
        recipes: Vec<String>,
        /// Write the full report as JSON to this path, and an SVG plot next to it.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
        /// Skip the bug-detection runs.
        #[arg(long)]
        no_bugs: bool,
    },
    /// Check a candidate trace directory against a reference one (as `ttrace simulate --dump`
    /// writes them; format in papers/trace-format.md): merge the candidate's shards, compare
    /// every produced tensor with its threshold, report the first failing tensor in execution
    /// order. Exit code 0: all within thresholds; 1: a discrepancy; 2: unusable input.
    Check {
        /// The reference trace directory.
        reference: std::path::PathBuf,
        /// The candidate trace directory.
        candidate: std::path::PathBuf,
        /// Also write the report as JSON to this path.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
        /// Thresholds: `auto` uses the producer's thresholds from the reference manifest where
        /// present and prices the rest from the metadata and the data; `local` prices every
        /// tensor from the metadata and the data.
        #[arg(long, default_value = "auto", value_parser = ["auto", "local"])]
        pricing: String,
    },
    /// List the catalog of injectable silent bugs.
    Bugs {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Simulate one sharded training step (optionally with a bug), check it against the
    /// single-device reference and localize the first wrong module. Exit code 0: within the
    /// thresholds; 1: a discrepancy; 2: an error.
    Simulate {
        /// Tensor-parallel size.
        #[arg(long, default_value_t = 2)]
        tp: usize,
        /// Sequence parallelism.
        #[arg(long)]
        sp: bool,
        /// Context-parallel size.
        #[arg(long, default_value_t = 1)]
        cp: usize,
        /// Data-parallel size.
        #[arg(long, default_value_t = 1)]
        dp: usize,
        /// Recipe: fp32, bf16, fp8-delayed, fp8-current.
        #[arg(long, default_value = "bf16")]
        recipe: String,
        /// Inject this bug (see `ttrace bugs`).
        #[arg(long)]
        bug: Option<String>,
        /// Seed of the consistent generator.
        #[arg(long, default_value_t = 1000)]
        seed: u64,
        /// All-reduce algorithm: ring or tree.
        #[arg(long, default_value = "ring")]
        algorithm: String,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Also write the reference and candidate traces (safetensors per rank + manifest)
        /// to DIR/reference and DIR/candidate.
        #[arg(long)]
        dump: Option<std::path::PathBuf>,
    },
}

#[derive(Clone, Copy, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Op {
    /// C = A·B (closed-form plan; priced on synthetic data when a side uses FP8 scaling).
    Matmul,
    /// Row sums (closed-form plan).
    Sum,
    /// Softmax along rows of length k (synthetic data).
    Softmax,
    /// LayerNorm over rows of length k (synthetic data).
    Layernorm,
    /// RMSNorm over rows of length k (synthetic data).
    Rmsnorm,
    /// GELU, elementwise on an m×k tensor (synthetic data).
    Gelu,
    /// SiLU, elementwise (synthetic data).
    Silu,
}

/// Options of a policy spec that are not part of `Policy`: the softmax form and the LayerNorm
/// variance algorithm.
#[derive(Clone, Copy)]
struct SpecExtras {
    form: AttentionImpl,
    variance: Variance,
}

/// A policy spec: the library's policy text (`Policy`'s `FromStr`, which refuses unknown
/// keys) plus the keys `form=standard|online:B` and `variance=twopass|onepass|welford` that
/// only the softmax and norm thresholds read — one parser, every key accounted for.
fn parse_spec(s: &str) -> Result<(Policy, SpecExtras), String> {
    let mut extras = SpecExtras {
        form: AttentionImpl::Standard,
        variance: Variance::TwoPass,
    };
    let mut policy = vec![];
    for item in s.split(',').filter(|x| !x.trim().is_empty()) {
        match item.split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
            Some(("form", v)) => {
                extras.form = match v {
                    "standard" => AttentionImpl::Standard,
                    v if v.starts_with("online:") => AttentionImpl::Online {
                        block: v[7..]
                            .parse()
                            .map_err(|_| format!("form '{v}': online:B needs a whole number"))?,
                    },
                    v => return Err(format!("unknown softmax form '{v}' (standard, online:B)")),
                }
            }
            Some(("variance", v)) => {
                extras.variance = match v {
                    "twopass" => Variance::TwoPass,
                    "onepass" => Variance::OnePass,
                    "welford" => Variance::Welford,
                    v => {
                        return Err(format!(
                            "unknown variance '{v}' (twopass, onepass, welford)"
                        ))
                    }
                }
            }
            _ => policy.push(item),
        }
    }
    let policy = policy
        .join(",")
        .parse::<Policy>()
        .map_err(|e| e.to_string())?;
    Ok((policy, extras))
}

/// A synthetic tensor with entries mean + std·N(0, 1), rounded to `format`.
fn synthetic(
    shape: &[usize],
    mean: f64,
    std: f64,
    seed: &str,
    format: Format,
) -> Result<Tensor, String> {
    let n = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .unwrap_or(usize::MAX);
    if n > 1 << 24 {
        return Err(format!(
            "synthetic pricing is limited to 2^24 elements (asked {n}); use smaller --m/--k/--n"
        ));
    }
    let values = ttrace::engine::normal_values(seed, n, mean, std, 7);
    Tensor::rounded(shape, values, format, Overflow::Saturating).map_err(|e| e.to_string())
}

#[derive(Serialize)]
struct ThresholdReport {
    op: Op,
    shape: [usize; 3],
    reference: Policy,
    candidate: Policy,
    input_mean: f64,
    input_std: f64,
    threshold: Threshold,
    baselines: Vec<BaselineReport>,
}

#[derive(Serialize)]
struct BaselineReport {
    baseline: Baseline,
    nominal_relative: f64,
}

#[allow(clippy::too_many_arguments)]
fn threshold(
    op: Op,
    m: usize,
    k: usize,
    n: usize,
    reference: &str,
    candidate: &str,
    mean: f64,
    std: f64,
    delta: f64,
    guaranteed: bool,
    json: bool,
) -> Result<(), String> {
    let (rp, er) = parse_spec(reference)?;
    let (cp, ec) = parse_spec(candidate)?;
    if !(std >= 0.0 && std.is_finite() && mean.is_finite()) {
        return Err(format!(
            "--mean and --std must be finite and --std non-negative (got {mean}, {std})"
        ));
    }
    let confidence = if guaranteed {
        Confidence::Guaranteed
    } else {
        Confidence::probabilistic(delta).map_err(|e| e.to_string())?
    };
    let stats = TermStats::normal(mean, std);
    let fmt = rp.input();
    let e = |r: ttrace::Result<Threshold>| r.map_err(|e| e.to_string());
    let fp8 = rp.scaling != Scaling::None || cp.scaling != Scaling::None;
    let th = match op {
        Op::Matmul if fp8 => {
            let a = synthetic(&[m, k], mean, std, "cli.a", Format::F32)?;
            let b = synthetic(&[k, n], mean, std, "cli.b", Format::F32)?;
            e(matmul_threshold(&a, &b, None, &rp, &cp, confidence))?
        }
        Op::Matmul => e(plan_matmul(
            &MatmulPlan {
                m,
                k,
                n,
                a: stats,
                b: stats,
            },
            &rp,
            &cp,
            confidence,
        ))?,
        Op::Sum => e(plan_sum(m, k, stats, &rp, &cp, confidence))?,
        Op::Softmax => {
            let x = synthetic(&[m, k], mean, std, "cli.x", fmt)?;
            e(softmax_threshold(
                &x, &rp, er.form, &cp, ec.form, confidence,
            ))?
        }
        Op::Layernorm | Op::Rmsnorm => {
            let x = synthetic(&[m, k], mean, std, "cli.x", fmt)?;
            let w = synthetic(&[k], 1.0, 0.1, "cli.w", fmt)?;
            let b = synthetic(&[k], 0.0, 0.1, "cli.b", fmt)?;
            let (ro, co, bias) = if matches!(op, Op::Rmsnorm) {
                (NormOp::RmsNorm, NormOp::RmsNorm, None)
            } else {
                (
                    NormOp::LayerNorm(er.variance),
                    NormOp::LayerNorm(ec.variance),
                    Some(&b),
                )
            };
            e(norm_threshold(
                &NormData {
                    x: &x,
                    weight: &w,
                    bias,
                    eps: 1e-5,
                },
                NormSide {
                    op: ro,
                    policy: &rp,
                },
                NormSide {
                    op: co,
                    policy: &cp,
                },
                confidence,
            ))?
        }
        Op::Gelu | Op::Silu => {
            let x = synthetic(&[m, k], mean, std, "cli.x", fmt)?;
            let f = if matches!(op, Op::Gelu) {
                Elementwise::Gelu
            } else {
                Elementwise::Silu
            };
            e(elementwise_threshold(f, &x, None, &rp, &cp, confidence))?
        }
    };
    let out_format = rp.output;
    let baselines: Vec<BaselineReport> = baselines_for(out_format, 1)
        .into_iter()
        .map(|b| BaselineReport {
            nominal_relative: b.nominal_relative(),
            baseline: b,
        })
        .collect();
    let shape = match op {
        Op::Matmul => [m, k, n],
        _ => [m, k, 1],
    };
    if json {
        let report = ThresholdReport {
            op,
            shape,
            reference: rp,
            candidate: cp,
            input_mean: mean,
            input_std: std,
            threshold: th,
            baselines,
        };
        outln!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    let kind = match th.confidence {
        Confidence::Guaranteed => "guaranteed (every input, every rounding)".to_string(),
        Confidence::Probabilistic { delta } => {
            format!("probabilistic, fails with probability <= {delta:e}")
        }
    };
    let name = serde_json::to_value(op)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let how = match op {
        Op::Matmul if !fp8 => "closed-form plan",
        Op::Sum => "closed-form plan",
        _ => "priced on a synthetic tensor",
    };
    outln!("op: {name}  shape: {shape:?}  inputs ~ N({mean}, {std}^2)  ({how})");
    outln!("reference: {reference}\ncandidate: {candidate}");
    if th.identical {
        outln!("identical arithmetic: the outputs agree bit for bit; threshold 0");
        return Ok(());
    }
    outln!("kind: {kind}");
    outln!(
        "  ||cand - ref||_F / ||ref||_F <= {:.3e}   (expected {:.3e}; worst case {:.3e})",
        th.relative,
        th.expected_relative,
        th.guaranteed_relative
    );
    outln!("  max |cand - ref| per element <= {:.3e}", th.per_element);
    outln!(
        "baselines for {} outputs (nominal relative tolerance):",
        out_format.name()
    );
    for b in &baselines {
        outln!("  {:<62} {:.3e}", b.baseline.name, b.nominal_relative);
    }
    Ok(())
}

fn parse_format(s: &str) -> Result<Format, String> {
    s.parse::<Format>().map_err(|e| e.to_string())
}

/// Shortest text that reads back as exactly `x`.
fn shortest(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    let a = x.abs();
    if a == 0.0 || a.is_infinite() || (1e-5..1e16).contains(&a) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

fn formats(json: bool) -> io::Result<()> {
    let infos: Vec<_> = Format::ALL.iter().map(|f| f.info()).collect();
    let mut out = io::stdout().lock();
    if json {
        let text = serde_json::to_string_pretty(&infos).map_err(io::Error::other)?;
        writeln!(out, "{text}")?;
        return Ok(());
    }
    writeln!(
        out,
        "{:<6} {:>4} {:>3} {:>4} {:>4} {:>6} {:>6} {:>12} {:>12} {:>12} {:>12} {:>24} {:>4}",
        "format",
        "bits",
        "p",
        "ebit",
        "fbit",
        "emin",
        "emax",
        "u=2^-p",
        "eps=2^(1-p)",
        "min_subnorm",
        "min_normal",
        "max_finite",
        "inf"
    )?;
    for i in &infos {
        writeln!(
            out,
            "{:<6} {:>4} {:>3} {:>4} {:>4} {:>6} {:>6} {:>12} {:>12} {:>12} {:>12} {:>24} {:>4}",
            i.name,
            i.bits,
            i.precision,
            i.exponent_bits,
            i.fraction_bits,
            i.emin,
            i.emax,
            format!("2^{}", -(i.precision as i32)),
            format!("2^{}", 1 - i.precision as i32),
            format!("2^{}", i.emin - i.precision as i32 + 1),
            format!("2^{}", i.emin),
            shortest(i.max_finite),
            if i.has_infinity { "yes" } else { "no" }
        )?;
    }
    writeln!(
        out,
        "\nu is the unit roundoff used in every bound; eps = 2u is what torch.finfo().eps reports."
    )?;
    Ok(())
}

fn round(format: Format, saturate: bool) -> Result<(), String> {
    let overflow = if saturate {
        Overflow::Saturating
    } else {
        Overflow::NonSaturating
    };
    let stdin = io::stdin();
    let mut out = BufWriter::new(io::stdout().lock());
    for (i, line) in stdin.lock().lines().enumerate() {
        let line = line.map_err(|e| format!("reading standard input, line {}: {e}", i + 1))?;
        let value = format
            .round_decimal(&line, overflow)
            .map_err(|_| format!("line {}: '{}' is not a number", i + 1, line.trim()))?;
        writeln!(out, "{}", shortest(value)).map_err(|e| format!("writing output: {e}"))?;
    }
    out.flush().map_err(|e| format!("writing output: {e}"))
}

/// Write a report atomically (see [`ttrace::io::write_atomic`]).
fn write_atomic(path: &std::path::Path, contents: &[u8]) -> Result<(), String> {
    ttrace::io::write_atomic(path, contents).map_err(|e| e.to_string())
}

/// A report is never written into a trace directory being read: it could replace one of the
/// inputs (the manifest, a rank file) of this or a later check.
fn refuse_report_inside(report: &std::path::Path, dirs: &[&std::path::Path]) -> Result<(), String> {
    let parent = report
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let Ok(parent) = std::fs::canonicalize(parent) else {
        // A missing parent directory fails when the report is written, with its own message.
        return Ok(());
    };
    let target = parent.join(report.file_name().unwrap_or_default());
    for dir in dirs {
        if let Ok(d) = std::fs::canonicalize(dir) {
            if target.starts_with(&d) {
                return Err(format!(
                    "{}: refusing to write the report inside the trace directory {} (it could \
                     replace one of its files); write it elsewhere",
                    report.display(),
                    dir.display()
                ));
            }
        }
    }
    Ok(())
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
    // Each trace is opened (its headers validated) once; no file stays open between reads.
    let r = ttrace::io::TraceDir::open(reference).map_err(|e| e.to_string())?;
    let c = ttrace::io::TraceDir::open(candidate).map_err(|e| e.to_string())?;
    let (n, world) = (r.ids().len(), c.manifest().mesh.world());
    let bar = indicatif::ProgressBar::new(n as u64);
    let out =
        ttrace::check::check_dir_traces(&r, &c, mode, &|| bar.inc(1)).map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    outln!(
        "ttrace check: {} against {} ({} ranks)",
        candidate.display(),
        reference.display(),
        world
    );
    out!("{}", ttrace::check::render_check(&out.report));
    if let Some(l) = &out.localization {
        let kind = l.kind.map(|k| format!(" ({k:?})")).unwrap_or_default();
        let pass = match l.pass {
            Some(ttrace::engine::Pass::Forward) => " forward",
            Some(ttrace::engine::Pass::Backward) => " backward",
            None => "",
        };
        let rank = l.rank.map(|r| format!(", rank {r}")).unwrap_or_default();
        outln!(
            "localized: module {}{kind}{pass}, tensor {}{rank}: {}",
            ttrace::io::printable(&l.module),
            ttrace::io::printable(&l.tensor),
            ttrace::io::sanitize(&l.detail)
        );
    }
    outln!("thresholds:");
    for (_, n, rule) in &out.pricing_summary {
        outln!("  {n:>6} tensors: {rule}");
    }
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?;
        write_atomic(path, text.as_bytes())?;
    }
    Ok(out.report.passed())
}

fn bugs(json: bool) -> Result<(), String> {
    use ttrace::bugs::Bug;
    #[derive(Serialize)]
    struct Row {
        name: &'static str,
        needs: &'static str,
        models: &'static str,
        localized_at: String,
    }
    let rows: Vec<Row> = Bug::ALL
        .iter()
        .map(|b| {
            let s = b.site();
            Row {
                name: b.name(),
                needs: b.needs(),
                models: b.models(),
                localized_at: format!(
                    "{:?} {}{}",
                    s.kind,
                    if s.pass == ttrace::engine::Pass::Forward {
                        "fwd"
                    } else {
                        "bwd"
                    },
                    s.name_suffix.map(|x| format!(" ({x})")).unwrap_or_default()
                )
                .to_lowercase(),
            }
        })
        .collect();
    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    for r in &rows {
        outln!(
            "{:<32} needs {:<40} expected at {}",
            r.name,
            r.needs,
            r.localized_at
        );
        outln!("{:<32} models {}", "", r.models);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn simulate(
    tp: usize,
    sp: bool,
    cp: usize,
    dp: usize,
    recipe: &str,
    bug: Option<&str>,
    seed: u64,
    algorithm: &str,
    json: bool,
    dump: Option<&std::path::Path>,
) -> Result<bool, String> {
    use ttrace::validate::{dump_run, run_bug, run_config_cached, RunConfig, SweepOptions};
    let bug = bug
        .map(ttrace::bugs::Bug::by_name)
        .transpose()
        .map_err(|e| e.to_string())?;
    ttrace::Recipe::by_name(recipe).map_err(|e| e.to_string())?;
    let algorithm = match algorithm {
        "ring" => ttrace::shard::Algorithm::Ring,
        "tree" => ttrace::shard::Algorithm::Tree,
        other => {
            return Err(format!(
                "unknown all-reduce algorithm '{other}' (ring, tree)"
            ))
        }
    };
    let mesh = ttrace::shard::Mesh::new(tp, cp, dp, sp).map_err(|e| e.to_string())?;
    let options = SweepOptions::default_sweep(1);
    let run = RunConfig {
        mesh,
        recipe: recipe.to_string(),
        seed,
        algorithm,
    };
    let (_, thresholds) = run_config_cached(&options, &run).map_err(|e| e.to_string())?;
    let r = run_bug(&options, &run, bug, &thresholds).map_err(|e| e.to_string())?;
    if let Some(dir) = dump {
        dump_run(&options, &run, bug, &thresholds, dir).map_err(|e| e.to_string())?;
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
            if algorithm == ttrace::shard::Algorithm::Ring {
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
            Some(l) => outln!(
                "localizer: first wrong module {} ({}, {:?}{}{}): {} — {}",
                l.module,
                if l.pass == ttrace::engine::Pass::Forward {
                    "forward"
                } else {
                    "backward"
                },
                l.kind,
                l.rank.map(|r| format!(", rank {r}")).unwrap_or_default(),
                l.parameter
                    .as_ref()
                    .map(|p| format!(", parameter {p}"))
                    .unwrap_or_default(),
                l.tensor,
                l.detail
            ),
        }
    }
    Ok(!r.detected)
}

#[allow(clippy::too_many_arguments)]
fn validate(
    full: bool,
    seeds: Option<u64>,
    samples: usize,
    delta: f64,
    threads: Option<usize>,
    recipes: &[String],
    no_bugs: bool,
    json: Option<&std::path::Path>,
) -> Result<bool, String> {
    use ttrace::validate::{
        render_bugs, render_sensitivity, render_svg, render_table, run_sweep, SweepOptions,
    };
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
    let mut options = if full {
        SweepOptions::full_sweep(seeds)
    } else {
        SweepOptions::default_sweep(seeds)
    };
    for r in recipes {
        ttrace::Recipe::by_name(r).map_err(|e| e.to_string())?;
    }
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
    outln!(
        "ttrace validate: {} runs ({} meshes x recipes x seeds), model {} layers, hidden {}, \
         seq {}, batch {}; {} produced tensors compared; delta = {:e}, {} simulation samples; \
         {:.1} s on {} threads",
        report.runs.len(),
        ttrace::validate::SweepOptions::meshes().len(),
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
        outln!(
            "Localizer on the {} correct runs: {} false alarms.",
            report.runs.len(),
            report.localizer_false_alarms
        );
    }
    if !report.sensitivity_rows.is_empty() {
        outln!();
        outln!(
            "Sensitivity on {}: the smallest relative perturbation ρ of one tensor (Gaussian, \
             ‖N‖ ≈ ρ‖ref‖) each rule detects with 99% power, median over tensors, in units of ε \
             (smaller is more sensitive; FA n: the rule rejects n of these correct tensors \
             unperturbed, so it has no figure for them).",
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
    Ok(report.total.false_alarms == 0 && report.localizer_false_alarms == 0)
}

/// Keep large buffers in the heap once freed: `ttrace check` allocates one buffer per tensor of
/// a trace (tens of MB each), and glibc's default of serving such sizes with fresh `mmap`s
/// makes the kernel zero every page again for every tensor (profiled: about a third of the
/// check's time). Raising the mmap and trim thresholds lets freed buffers be reused.
fn keep_freed_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning parameters; it is called before any other
    // thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 512 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn main() -> ExitCode {
    keep_freed_buffers();
    let cli = Cli::parse();
    let mut cli_extra: Option<ExitCode> = None;
    let result = match cli.command {
        Command::Bugs { json } => bugs(json),
        Command::Check {
            reference,
            candidate,
            json,
            pricing,
        } => match check_dirs_cli(
            &reference,
            &candidate,
            json.as_deref(),
            if pricing == "local" {
                ttrace::check::PricingMode::Local
            } else {
                ttrace::check::PricingMode::Auto
            },
        ) {
            Ok(true) => Ok(()),
            Ok(false) => {
                cli_extra = Some(ExitCode::from(1));
                Ok(())
            }
            Err(e) => Err(e),
        },
        Command::Simulate {
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
        } => match simulate(
            tp,
            sp,
            cp,
            dp,
            &recipe,
            bug.as_deref(),
            seed,
            &algorithm,
            json,
            dump.as_deref(),
        ) {
            Ok(true) => Ok(()),
            Ok(false) => {
                cli_extra = Some(ExitCode::from(1));
                Ok(())
            }
            Err(e) => Err(e),
        },
        Command::Formats { json } => formats(json).map_err(|e| format!("writing output: {e}")),
        Command::Round { format, saturate } => round(format, saturate),
        Command::Threshold {
            op,
            m,
            k,
            n,
            reference,
            candidate,
            mean,
            std,
            delta,
            guaranteed,
            json,
        } => threshold(
            op, m, k, n, &reference, &candidate, mean, std, delta, guaranteed, json,
        ),
        Command::Validate {
            full,
            seeds,
            samples,
            delta,
            threads,
            recipes,
            json,
            no_bugs,
        } => match validate(
            full,
            seeds,
            samples,
            delta,
            threads,
            &recipes,
            no_bugs,
            json.as_deref(),
        ) {
            Ok(true) => Ok(()),
            Ok(false) => {
                cli_extra = Some(ExitCode::from(1));
                Ok(())
            }
            Err(e) => Err(e),
        },
    };
    // What is still buffered must reach standard output too, or the run failed.
    let result = result.and_then(|()| io::stdout().flush().map_err(stdout_error));
    let result = match (result, cli_extra) {
        (Err(e), _) if e.starts_with("writing to standard output") => Err(e),
        (r, None) => r,
        (_, Some(code)) => {
            if io::stdout().flush().is_err() {
                let _ = writeln!(io::stderr(), "ttrace: error: writing to standard output");
                return ExitCode::from(2);
            }
            return code;
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            let _ = writeln!(
                io::stderr(),
                "ttrace: error: {}",
                ttrace::io::sanitize(&message)
            );
            ExitCode::from(2)
        }
    }
}

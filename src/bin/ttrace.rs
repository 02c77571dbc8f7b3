//! The `ttrace` command line: a thin layer over the library (parse, call, print).

use std::io::{self, BufRead, BufWriter, Write};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ttrace::{Format, Overflow};

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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Formats { json } => formats(json).map_err(|e| format!("writing output: {e}")),
        Command::Round { format, saturate } => round(format, saturate),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("ttrace: error: {message}");
            ExitCode::from(2)
        }
    }
}

//! `ttrace formats`: the constants of every number format.

use std::io::{self, Write};

use crate::Outcome;
use ttrace::Format;

/// The options of `ttrace formats`.
#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Print the table (or JSON).
pub fn run(a: Args) -> Result<Outcome, String> {
    print(a.json).map_err(|e| format!("writing output: {e}"))?;
    Ok(Outcome::Pass)
}

/// Shortest text that reads back as exactly `x`.
pub(crate) fn shortest(x: f64) -> String {
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

fn print(json: bool) -> io::Result<()> {
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

//! `ttrace round`: correct rounding of decimal text to a format.

use std::io::{self, BufRead, BufWriter, Write};

use ttrace::{Format, Overflow};

use crate::formats::shortest;
use crate::out::parse_format;
use crate::Outcome;

/// The options of `ttrace round`.
#[derive(clap::Args)]
pub struct Args {
    /// Target format: f64, f32, tf32, f16, bf16, e4m3, e5m2.
    #[arg(long, value_parser = parse_format)]
    pub format: Format,
    /// Clamp overflow to the largest finite value instead of inf (or NaN for e4m3).
    #[arg(long)]
    pub saturate: bool,
}

/// Round every line of standard input.
pub fn run(a: Args) -> Result<Outcome, String> {
    let Args { format, saturate } = a;
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
    out.flush().map_err(|e| format!("writing output: {e}"))?;
    Ok(Outcome::Pass)
}

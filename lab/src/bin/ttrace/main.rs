//! The `ttrace` command line: a thin layer over the library (parse, call, print), one module
//! per subcommand, each taking its options whole.

use std::io::{self, Write};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[macro_use]
mod out;
mod bugs;
mod check;
mod formats;
mod render;
mod round;
mod simulate;
mod threshold;
mod validate;

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
    Formats(formats::Args),
    /// Round numbers read from standard input (one per line) to a format, correctly.
    ///
    /// Each output line is the rounded value as shortest round-trip decimal text
    /// (NaN, inf, -inf and -0 included).
    Round(round::Args),
    /// Price the comparison threshold of an op between a reference and a candidate policy,
    /// for data with given statistics (planning; `ttrace::bounds` prices real tensors).
    ///
    /// A policy is written `in=bf16,acc=f32,out=bf16,order=ORDER[,products=exact|FMT]`;
    /// ORDER is `sequential`, `pairwise:B`, `blocked:B`, `blockfma:B`, or
    /// `splitk:P:FMT:COMBINE` with COMBINE `seq`, `tree` or `ring[:START]` (inner order
    /// sequential).
    Threshold(threshold::Args),
    /// The validation sweep: simulate sharded training steps (TP/SP/CP/DP) of a tiny GPT,
    /// merge the shards, and compare every traced tensor against the reference with our
    /// composed thresholds, the perturbation estimate and the folklore baselines.
    ///
    /// Default: TP in {1,2,4}, SP on/off, CP in {1,2}, DP in {1,2}, recipes fp32, bf16 and
    /// fp8-delayed, 2 seeds (120 runs). Exit code 1 if any of our thresholds raised a false
    /// alarm, 2 on an error.
    Validate(validate::Args),
    /// Check a candidate trace directory against a reference one (as `ttrace simulate --dump`
    /// writes them; format in papers/trace-format.md): merge the candidate's shards, compare
    /// every produced tensor with its threshold, report the first failing tensor in execution
    /// order. Exit code 0: all within thresholds; 1: a discrepancy; 2: unusable input.
    Check(check::Args),
    /// List the catalog of injectable silent bugs.
    Bugs(bugs::Args),
    /// Simulate one sharded training step (optionally with a bug), check it against the
    /// single-device reference and localize the first wrong module. Exit code 0: within the
    /// thresholds; 1: a discrepancy; 2: an error.
    Simulate(simulate::Args),
}

/// What a command found, mapped to the exit code: 0 for [`Outcome::Pass`], 1 for
/// [`Outcome::Fail`] (a discrepancy, a false alarm); an error is 2.
pub enum Outcome {
    /// Nothing to report.
    Pass,
    /// A discrepancy.
    Fail,
}

impl Outcome {
    /// `Pass` when `passed`.
    pub fn of(passed: bool) -> Outcome {
        if passed {
            Outcome::Pass
        } else {
            Outcome::Fail
        }
    }
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
    let result = match Cli::parse().command {
        Command::Formats(a) => formats::run(a),
        Command::Round(a) => round::run(a),
        Command::Threshold(a) => threshold::run(a),
        Command::Validate(a) => validate::run(a),
        Command::Check(a) => check::run(a),
        Command::Bugs(a) => bugs::run(a),
        Command::Simulate(a) => simulate::run(a),
    };
    // What is still buffered must reach standard output too, or the run failed.
    let result = result.and_then(|o| io::stdout().flush().map(|()| o).map_err(out::stdout_error));
    match result {
        Ok(Outcome::Pass) => ExitCode::SUCCESS,
        Ok(Outcome::Fail) => ExitCode::from(1),
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

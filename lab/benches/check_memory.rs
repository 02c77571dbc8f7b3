//! Peak memory of `ttrace check` against the size of the tensor pair it compares. Run with
//! `cargo bench --bench check_memory` (optionally `-- ELEMENTS`, default 16M per tensor).
//!
//! Each case writes a reference trace holding one tensor and a candidate trace holding it
//! sharded (in a child process: Linux counts the parent's resident set at the fork in a child's
//! peak, so the measuring process stays small), runs the `ttrace` binary on them in another
//! child and reads its peak resident set (`wait4`'s `ru_maxrss`). The baseline, measured in the same run, is the same
//! check on a pair of 8-element tensors: the process's fixed overhead. The figure reported is
//!
//! ```text
//! (peak − baseline peak) / (bytes of the reference tensor + bytes of the candidate tensor)
//! ```
//!
//! in the stored formats; the target is below 2 for every format and layout, FP8 included.
//! For scale, the same pair decoded to `f64` would be 16 bytes per element pair: a ratio of
//! 8 for BF16 and 16 for FP8 before any copy.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use ttrace::engine::SplitMix64;
use ttrace::io::write_trace_dir;
use ttrace::trace::{shard, Axis, Layout, Mesh, Placement};
use ttrace::Tensor;
use ttrace::{Format, Overflow};

fn values(n: usize, f: Format, seed: u64) -> Vec<f64> {
    let mut g = SplitMix64::for_name("bench-check-memory", seed);
    (0..n)
        .map(|_| f.round(4.0 * g.uniform() - 2.0, Overflow::Saturating))
        .collect()
}

/// Write the pair: the reference on one rank, the candidate (every 97th element one step
/// larger) on `mesh` under `layout`.
fn write_pair(dir: &Path, n: usize, f: Format, mesh: &Mesh, layout: Layout) {
    let id = "mlp.fc1|fwd.output.0".to_string();
    let shape = [n / 1024, 1024];
    let r = values(n, f, 1);
    let mut c = r.clone();
    for x in c.iter_mut().step_by(97) {
        *x = f.round(*x * (1.0 + f.machine_epsilon()), Overflow::Saturating);
    }
    let rt = Tensor::from_vec(&shape, r, f).unwrap();
    let ct = Tensor::from_vec(&shape, c, f).unwrap();
    // Under a partial layout: the value on rank 0, zeros on the others (a sum to take).
    let shards = shard(&ct, &layout, mesh, &id).unwrap();
    let (no_modules, no_thresholds) = (HashMap::new(), HashMap::new());
    write_trace_dir(
        &dir.join("reference"),
        &Mesh::single(),
        None,
        &[(id.clone(), Layout::replicated(), vec![rt])],
        &no_modules,
        &no_thresholds,
    )
    .unwrap();
    write_trace_dir(
        &dir.join("candidate"),
        mesh,
        None,
        &[(id, layout, shards)],
        &no_modules,
        &no_thresholds,
    )
    .unwrap();
}

/// Peak resident set of `program args` in bytes; whether it exited with code 2 (an error).
fn peak_rss(program: &Path, args: &[String]) -> (u64, bool) {
    let child = Command::new(program)
        .args(args)
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("run the child");
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: an all-zero `rusage` is a valid value; wait4 fills it for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our child, not yet waited for (the `Child` handle is never waited).
    let got = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(got, pid, "wait4");
    assert!(libc::WIFEXITED(status), "{program:?} did not exit normally");
    std::mem::forget(child);
    (
        usage.ru_maxrss as u64 * 1024,
        libc::WEXITSTATUS(status) == 2,
    )
}

/// Write a case's pair in a child process (this benchmark run with `--write`).
fn write_in_child(dir: &Path, n: usize, case: usize) {
    let me = std::env::current_exe().expect("the benchmark's path");
    let args = [
        "--write".to_string(),
        dir.display().to_string(),
        n.to_string(),
        case.to_string(),
    ];
    let (_, failed) = peak_rss(&me, &args);
    assert!(!failed, "writing the pair failed");
}

/// Peak resident set of `ttrace check` on the pair in `dir`, in bytes.
fn check_peak(dir: &Path) -> u64 {
    let args = ["check", "reference", "candidate"].map(|a| match a {
        "check" => a.to_string(),
        d => dir.join(d).display().to_string(),
    });
    let (peak, error) = peak_rss(Path::new(env!("CARGO_BIN_EXE_ttrace")), &args);
    // Exit 1 (a FAIL verdict) is expected for a candidate that differs; 2 is an error.
    assert!(!error, "ttrace check reported an error");
    peak
}

/// The cases: name, format, mesh, layout of the candidate.
fn cases() -> Vec<(&'static str, Format, Mesh, Layout)> {
    let tp2 = Mesh::megatron(2, 1, 1, false).unwrap();
    let dp2_tp2 = Mesh::megatron(2, 1, 2, false).unwrap();
    let split = Layout::replicated().with(Axis::TP, Placement::split(1));
    let partial = Layout::replicated().with(Axis::TP, Placement::Partial);
    vec![
        ("E4M3 TP2 split", Format::E4M3, tp2.clone(), split.clone()),
        (
            "E4M3 DP2xTP2 split+replica",
            Format::E4M3,
            dp2_tp2.clone(),
            split.clone(),
        ),
        (
            "E4M3 TP2 partial",
            Format::E4M3,
            tp2.clone(),
            partial.clone(),
        ),
        (
            "E4M3 DP2 split x TP2 partial",
            Format::E4M3,
            dp2_tp2.clone(),
            Layout::replicated()
                .with(Axis::DP, Placement::split(0))
                .with(Axis::TP, Placement::Partial),
        ),
        ("E5M2 TP2 split", Format::E5M2, tp2.clone(), split.clone()),
        ("BF16 TP2 split", Format::BF16, tp2.clone(), split.clone()),
        ("F16 TP2 split", Format::F16, tp2.clone(), split.clone()),
        ("F32 TP2 split", Format::F32, tp2.clone(), split.clone()),
    ]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, dir, n, case] = &args[..] {
        if flag == "--write" {
            let (n, case): (usize, usize) = (n.parse().unwrap(), case.parse().unwrap());
            let (_, f, mesh, layout) = cases().swap_remove(case);
            write_pair(Path::new(dir), n, f, &mesh, layout);
            return;
        }
    }
    // Cargo passes `--bench`; a number is the tensor size.
    let n: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(1 << 24);
    let n = n.div_ceil(4096) * 4096;
    let root = std::env::temp_dir().join(format!("ttrace-bench-memory-{}", std::process::id()));
    let tiny = root.join("tiny");
    write_in_child(&tiny, 4096, 0);
    let base = check_peak(&tiny);
    println!(
        "check_memory: {n} elements per tensor; baseline (fixed overhead, a 4096-element pair): \
         {:.1} MiB",
        base as f64 / 1048576.0
    );
    println!(
        "{:<30} {:>10} {:>10} {:>18}",
        "case", "pair MiB", "peak MiB", "(peak-base)/pair"
    );
    let mut worst: f64 = 0.0;
    for (k, (name, f, _, _)) in cases().into_iter().enumerate() {
        let dir = root.join(name.replace(' ', "_"));
        write_in_child(&dir, n, k);
        let pair = 2 * n as u64 * u64::from(f.bit_width().div_ceil(8));
        let peak = check_peak(&dir);
        let ratio = peak.saturating_sub(base) as f64 / pair as f64;
        worst = worst.max(ratio);
        println!(
            "{name:<30} {:>10.1} {:>10.1} {ratio:>18.2}",
            pair as f64 / 1048576.0,
            peak as f64 / 1048576.0
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
    println!("worst ratio {worst:.2} (target < 2)");
    let _ = std::fs::remove_dir_all(&root);
}

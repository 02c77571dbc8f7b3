//! What several of the lab's test binaries share: a simulated step of the default sweep's
//! model written as a reference and a candidate trace.

use std::path::PathBuf;

use ttrace::trace::Mesh;
use ttrace_lab::bugs::Bug;
use ttrace_lab::shard::Algorithm;
use ttrace_lab::validate::{dump_run, run_config_with_thresholds, RunConfig, SweepOptions};

/// A fresh directory for test `name` of binary `binary` (this process's own).
pub fn tmp(binary: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ttrace-{binary}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A simulated step of the default sweep's model (BF16, seed 1000) on `mesh`, with `bug`
/// planted in the candidate, written as `reference` and `candidate` below a fresh directory.
pub fn dumped(binary: &str, name: &str, mesh: Mesh, bug: Option<Bug>) -> PathBuf {
    let mut options = SweepOptions::default_sweep(1);
    options.simulation.samples = 4;
    options.perturbation_samples = 1;
    options.sensitivity_mesh = None;
    let run = RunConfig {
        mesh,
        recipe: "bf16".into(),
        seed: 1000,
        algorithm: Algorithm::Ring,
    };
    let (_, th) = run_config_with_thresholds(&options, &run).unwrap();
    let d = tmp(binary, name);
    dump_run(&options, &run, bug, &th, &d).unwrap();
    d
}

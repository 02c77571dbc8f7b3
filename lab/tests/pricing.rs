//! The local pricing model of `ttrace check` (thresholds from the manifest's metadata and the
//! data, no producer thresholds): correct sharded runs dumped by the simulator pass, every
//! catalog bug is found and localized to its module kind and pass. The full sweep of this
//! evaluation is `cargo test --release --test pricing -- --ignored --nocapture`.

use std::path::{Path, PathBuf};

use ttrace::check::Pricing;
use ttrace::check::{check_dirs, DirCheck, PricingMode};
use ttrace::io::TraceDir;
use ttrace_lab::bugs::Bug;
use ttrace_lab::shard::Algorithm;
use ttrace_lab::validate::{bug_meshes, dump_run, RunConfig, SweepOptions, Thresholds};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ttrace-pricing-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn options(seeds: u64) -> SweepOptions {
    let mut o = SweepOptions::default_sweep(seeds);
    o.perturbation_samples = 1;
    o.sensitivity_mesh = None;
    o
}

/// Dump one run (no producer thresholds) and check it with the local model.
fn local_check(options: &SweepOptions, run: &RunConfig, bug: Option<Bug>, dir: &Path) -> DirCheck {
    let _ = std::fs::remove_dir_all(dir);
    dump_run(options, run, bug, &Thresholds::default(), dir).unwrap();
    let mut r = TraceDir::open(&dir.join("reference")).unwrap();
    let mut c = TraceDir::open(&dir.join("candidate")).unwrap();
    let out = check_dirs(&mut r, &mut c, PricingMode::Local, &|| {}).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
    out
}

fn localized_right(bug: Bug, out: &DirCheck) -> bool {
    let site = bug.site();
    out.localization.as_ref().is_some_and(|l| {
        l.kind == Some(site.kind)
            && l.pass == Some(site.pass)
            && site.name_suffix.is_none_or(|s| l.module.ends_with(s))
    })
}

fn recipe_for(bug: Bug) -> &'static str {
    if bug == Bug::Fp8AmaxNotReduced {
        "fp8-delayed"
    } else {
        "bf16"
    }
}

/// Correct runs on a spread of meshes and recipes pass under the local model; every tensor is
/// priced by it (the manifests carry module kinds), and some thresholds are nonzero.
#[test]
fn correct_runs_pass_under_local_pricing() {
    let o = options(1);
    let d = tmp("clean");
    let picks = [0usize, 5, 11, 17, 23, 29, 35, 41, 47, 53, 59];
    for &i in &picks {
        let run = &o.runs[i % o.runs.len()];
        let out = local_check(&o, run, None, &d);
        assert!(
            out.fallback.is_empty(),
            "{}: fallbacks {:?}",
            run.mesh.label(),
            out.fallback
        );
        assert!(
            out.report.passed(),
            "{} {}: {:?}",
            run.mesh.label(),
            run.recipe,
            out.localization
        );
    }
}

/// Every catalog bug on the first mesh where it applies is detected from the files with local
/// pricing and localized to the module kind and pass the catalog names.
#[test]
fn every_bug_is_found_and_localized_under_local_pricing() {
    let o = options(1);
    let d = tmp("bugs");
    for bug in Bug::ALL {
        let recipe = recipe_for(bug);
        let mesh = bug_meshes(bug, recipe.starts_with("fp8"), o.model.batch, 1)[0].clone();
        let run = RunConfig {
            mesh: mesh.clone(),
            recipe: recipe.into(),
            seed: 1000,
            algorithm: Algorithm::Ring,
        };
        let out = local_check(&o, &run, Some(bug), &d);
        assert!(
            !out.report.passed(),
            "{bug} on {} not detected",
            mesh.label()
        );
        assert!(
            localized_right(bug, &out),
            "{bug} on {}: localized at {:?}",
            mesh.label(),
            out.localization
        );
    }
}

/// The whole default sweep (every clean configuration, every bug on 3 meshes × bf16 and
/// fp8-delayed) under local pricing, with its figures printed.
#[test]
#[ignore]
fn local_pricing_sweep() {
    let o = options(2);
    let d = tmp("sweep");
    let (mut tensors, mut differing, mut fa_tensors, mut fa_runs) = (0, 0, 0, 0);
    let mut carried = 0;
    let mut tight = vec![];
    let mut worst: (f64, String) = (0.0, String::new());
    let mut per_kind: std::collections::BTreeMap<String, f64> = Default::default();
    for run in &o.runs {
        let out = local_check(&o, run, None, &d);
        for (v, p) in out.report.verdicts.iter().zip(&out.pricing) {
            tensors += 1;
            if *p == Pricing::Carried {
                // A structural check (no more than the tensor it equals), not a round-off
                // threshold: counted for false alarms, not for tightness.
                carried += 1;
                fa_tensors += usize::from(!v.passed);
                continue;
            }
            if v.rel_error > 0.0 {
                differing += 1;
                tight.push(1.0 / v.ratio);
                let (m, what) = v.id.split_once('|').unwrap_or((&v.id, ""));
                let key = format!(
                    "{} {}",
                    m.split('.')
                        .filter(|p| p.parse::<u32>().is_err() && *p != "layers")
                        .collect::<Vec<_>>()
                        .join("."),
                    what
                );
                let e = per_kind.entry(key).or_default();
                *e = e.max(v.ratio);
                if !v.passed && v.ratio.is_finite() {
                    println!(
                        "  FA {} {} {} ratio {:.3} rel {:.3e} th {:.3e}",
                        run.mesh.label(),
                        run.recipe,
                        v.id,
                        v.ratio,
                        v.rel_error,
                        v.threshold
                    );
                }
                if v.ratio > worst.0 {
                    worst = (
                        v.ratio,
                        format!("{} {} {}", run.mesh.label(), run.recipe, v.id),
                    );
                }
            }
            if !v.passed {
                fa_tensors += 1;
            }
        }
        if !out.report.passed() {
            fa_runs += 1;
        }
    }
    tight.sort_by(f64::total_cmp);
    let q = |p: f64| tight[((tight.len() - 1) as f64 * p) as usize];
    println!(
        "clean: {} runs, {tensors} tensors ({carried} consumed tensors carried from their \
         producer, {differing} others differ): {fa_tensors} false alarms in {fa_runs} runs; \
         closest call {:.3} ({}); tightness median {:.2}, p90 {:.2}",
        o.runs.len(),
        worst.0,
        worst.1,
        q(0.5),
        q(0.9)
    );
    for (k, r) in &per_kind {
        println!("  max ratio {r:.3}  {k}");
    }
    let (mut runs, mut found, mut right) = (0, 0, 0);
    for (bug, i) in o.bug_runs() {
        let run = o.runs[i].clone();
        let out = local_check(&o, &run, Some(bug), &d);
        runs += 1;
        found += usize::from(!out.report.passed());
        let ok = localized_right(bug, &out);
        right += usize::from(ok);
        if !ok {
            println!(
                "  {bug} {} {}: {:?}",
                run.mesh.label(),
                run.recipe,
                out.localization.map(|l| (l.module, l.pass, l.ratio))
            );
        }
    }
    println!("bugs: {runs} runs, detected {found}, localized right {right}");
    // The README's figures (0 false alarms; 80 of 87 bug runs detected — 79 before the
    // bias-gradient element test found grad-allreduce-in-bf16 on tp2-sp-cp2-dp1 bf16 —
    // every detection localized to the right module kind and pass).
    assert_eq!(fa_tensors, 0);
    assert_eq!((runs, found, right), (87, 80, 80));
}

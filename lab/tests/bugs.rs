//! The bug catalog: every bug is detected and localized to the module it lives in, on at least
//! three meshes where it applies, in the BF16 and FP8 recipes, and the same configurations
//! without the bug raise no alarm (end-to-end or localizer).

use ttrace::trace::Mesh;
use ttrace_lab::bugs::Bug;
use ttrace_lab::shard::Algorithm;
use ttrace_lab::validate::{run_sweep, SweepOptions};

#[test]
fn every_bug_is_detected_and_localized_and_clean_runs_pass() {
    let mut options = SweepOptions::sweep(&["bf16", "fp8-delayed"], &[Algorithm::Ring], 1);
    options.simulation.samples = 8;
    options.perturbation_samples = 2;
    // Only the clean runs the bug runs need (and they are themselves checked).
    let needed: Vec<usize> = {
        let mut v: Vec<usize> = options.bug_runs().iter().map(|&(_, i)| i).collect();
        v.sort();
        v.dedup();
        v
    };
    let keep: Vec<_> = needed.iter().map(|&i| options.runs[i].clone()).collect();
    options.runs = keep;
    let report = run_sweep(&options, &|| {}).unwrap();
    assert_eq!(
        report.total.false_alarms, 0,
        "end-to-end false alarms on clean runs"
    );
    assert_eq!(
        report.localizer_false_alarms, 0,
        "localizer false alarms on clean runs"
    );
    for bug in Bug::ALL {
        for recipe in ["bf16", "fp8-delayed"] {
            let runs: Vec<_> = report
                .bugs
                .iter()
                .filter(|r| r.bug == Some(bug) && r.config.recipe == recipe)
                .collect();
            let applies = bug != Bug::Fp8AmaxNotReduced || recipe.starts_with("fp8");
            if !applies {
                assert!(runs.is_empty());
                continue;
            }
            assert!(
                runs.len() >= 3,
                "{bug} {recipe}: only {} configurations",
                runs.len()
            );
            let meshes: Vec<Mesh> = runs.iter().map(|r| r.config.mesh.clone()).collect();
            for r in &runs {
                assert!(
                    r.detected,
                    "{bug} {recipe} {}: not detected",
                    r.config.mesh.label()
                );
                assert!(
                    r.localized,
                    "{bug} {recipe} {}: localized at {:?}",
                    r.config.mesh.label(),
                    r.localization
                );
            }
            // Sorted first: dedup alone only drops adjacent repeats.
            let mut distinct: Vec<String> = meshes.iter().map(Mesh::label).collect();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), meshes.len(), "{bug}: repeated meshes");
        }
    }
}

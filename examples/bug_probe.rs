use ttrace::bugs::Bug;
use ttrace::validate::{bug_meshes, run_bug, run_config_cached, RunConfig, SweepOptions};
fn main() {
    let opts = SweepOptions::default_sweep(1);
    let args: Vec<String> = std::env::args().collect();
    let recipe = args.get(1).cloned().unwrap_or("bf16".into());
    let only = args.get(2).cloned();
    for bug in Bug::ALL {
        if let Some(o) = &only {
            if o != bug.name() {
                continue;
            }
        }
        for mesh in bug_meshes(bug, recipe.starts_with("fp8"), opts.model.batch, 3) {
            let run = RunConfig {
                mesh,
                recipe: recipe.clone(),
                seed: 1000,
                algorithm: ttrace::shard::Algorithm::Ring,
            };
            let (clean, th) = run_config_cached(&opts, &run).unwrap();
            let r = run_bug(&opts, &run, Some(bug), &th).unwrap();
            println!(
                "{:32} {:18} det {} loc {} ratio {:9.3e} first {:40} at {:?} clean-loc-FA {}",
                bug.name(),
                mesh.label(),
                r.detected,
                r.localized,
                r.max_ratio,
                r.first_failure.clone().unwrap_or_default(),
                r.localization
                    .as_ref()
                    .map(|l| format!("{} {:?} {} {}", l.module, l.pass, l.tensor, l.detail)),
                clean.localizer_false_alarm.is_some()
            );
        }
    }
}

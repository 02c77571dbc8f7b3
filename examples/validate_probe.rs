use ttrace::shard::Mesh;
use ttrace::validate::{run_config, RunConfig, SweepOptions};
fn main() {
    let opts = SweepOptions::default_sweep(1);
    let args: Vec<String> = std::env::args().collect();
    let recipe = args.get(1).cloned().unwrap_or("bf16".into());
    let (tp, cp, dp, sp) = (
        args[2].parse().unwrap(),
        args[3].parse().unwrap(),
        args[4].parse().unwrap(),
        args[5] == "1",
    );
    let t0 = std::time::Instant::now();
    let r = run_config(
        &opts,
        &RunConfig {
            mesh: Mesh { tp, cp, dp, sp },
            recipe,
            seed: args.get(6).map(|s| s.parse().unwrap()).unwrap_or(1000),
            algorithm: ttrace::shard::Algorithm::Ring,
        },
    )
    .unwrap();
    eprintln!("{:?}", t0.elapsed());
    for t in &r.tensors {
        if t.observed > 0.0 || t.threshold > 0.0 {
            println!("{:45} {:14} obs {:9.3e} th {:9.3e} exp {:9.3e} ratio {:6.2} pert {:9.3e} r {:8.1} {}", t.id, t.kind, t.observed, t.threshold, t.expected, t.threshold / t.observed, t.perturbation, t.effective_rank, if t.false_alarm() {"FALSE ALARM"} else {""});
        }
    }
}

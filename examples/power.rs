//! Detection power on large tensors (`papers/checking.md` §7): for synthetic tensors of 10⁴,
//! 10⁵ and 10⁶ elements whose difference is real round-off (a row-parallel linear's output, a
//! data-parallel weight gradient; FP32 and BF16), the smallest perturbation of each shape that
//! each rule detects with 99% power, in units of ε of the tensor's format.
//!
//! `cargo run --release --example power` (a few minutes; `-- --quick` for 10⁴ and 10⁵ only).

use ttrace::validate::{power_study, Perturbation};
use ttrace::Format;

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let sizes: &[usize] = if quick {
        &[10_000, 100_000]
    } else {
        &[10_000, 100_000, 1_000_000]
    };
    let shapes = Perturbation::ALL;
    let rows = power_study(&[Format::F32, Format::BF16], sizes, &shapes, 1);
    println!(
        "{:<5} {:<12} {:>9} {:>8} {:>8}  {:<13} {:>10} {:>10} {:>10} {:>10}",
        "fmt",
        "class",
        "elements",
        "obs (ε)",
        "thr (ε)",
        "perturbation",
        "ours",
        "norm only",
        "megatron",
        "torch"
    );
    for r in &rows {
        let eps = r.format.machine_epsilon();
        for (p, f) in &r.figures {
            let cell = |x: Option<f64>| match x {
                None => "FA".to_string(),
                Some(v) if v.is_infinite() => "inf".to_string(),
                Some(v) => format!("{:.3}", v / eps),
            };
            println!(
                "{:<5} {:<12} {:>9} {:>8.2} {:>8.2}  {:<13} {:>10} {:>10} {:>10} {:>10}",
                r.format.to_string(),
                r.class.name(),
                r.elements,
                r.observed_eps,
                r.threshold_eps,
                p.name(),
                cell(f.ours),
                cell(f.norm),
                cell(f.megatron),
                cell(f.torch)
            );
        }
    }
}

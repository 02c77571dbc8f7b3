//! Detection power on large tensors (`papers/checking.md` §7): for synthetic tensors of 10⁴,
//! 10⁵ and 10⁶ elements whose difference is real round-off (a row-parallel linear's output, a
//! data-parallel weight gradient; FP32 and BF16), the smallest perturbation of each shape that
//! each rule detects with 99% power, in units of ε of the tensor's format.
//!
//! Then, for the single-element rows, the round-off itself per element: its root mean square
//! relative to the element's scale max(|rᵢ|, rms of its row) (the scale the k-element
//! perturbation is measured in), and how many elements of the correct pair already differ by
//! 8 ε of that scale or more — elements no rule can tell from one corrupted by 8 ε.
//!
//! `cargo run --release --example power` (a few minutes; `-- --quick` for 10⁴ and 10⁵ only).

use ttrace::Format;
use ttrace_lab::validate::{power_study, synthetic_pair, Perturbation, SyntheticClass};

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
    println!();
    println!(
        "{:<5} {:<12} {:>9} {:>16} {:>22}",
        "fmt", "class", "elements", "rms per el. (ε)", "clean beyond 8 ε"
    );
    for format in [Format::F32, Format::BF16] {
        for class in [SyntheticClass::Activations, SyntheticClass::ParamGrads] {
            for &n in sizes {
                let (r, c) = synthetic_pair(class, n, format, 1);
                let (r, c, cols) = (r.values(), c.values(), r.shape()[1]);
                let eps = format.machine_epsilon();
                let (mut q, mut beyond) = (0.0, 0usize);
                for (rr, cc) in r.chunks(cols).zip(c.chunks(cols)) {
                    let rms = (rr.iter().map(|x| x * x).sum::<f64>() / cols as f64).sqrt();
                    for (a, b) in rr.iter().zip(cc) {
                        let e = (b - a).abs() / a.abs().max(rms) / eps;
                        q += e * e;
                        beyond += usize::from(e >= 8.0);
                    }
                }
                println!(
                    "{:<5} {:<12} {:>9} {:>16.2} {:>22}",
                    format.to_string(),
                    class.name(),
                    r.len(),
                    (q / r.len() as f64).sqrt(),
                    beyond
                );
            }
        }
    }
}

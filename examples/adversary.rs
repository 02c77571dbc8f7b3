//! An adversary for the thresholds (`tests/zoo/adversary.rs`): a hill climb over the data of
//! every (op, pair) of the data zoo from a few of its families at small shapes, keeping the
//! mutations that bring the difference closer to its guaranteed (even starts) or its
//! probabilistic (odd starts) threshold. A ratio above 1 is a violation.
//!
//! `cargo run --release --example adversary -- [steps] [filter] [starts] [seed]` (default
//! 300 steps from 3 starts per cell, filter a substring of "op pair", seed 0; about 10
//! minutes on one core at 1,500 steps from 6 starts). Prints each cell's closest calls, every violation with its
//! input, every input whose probabilistic request fell back to the guaranteed threshold
//! (`FALLBACK`: the engine's executions exceeded the model's threshold, a miss of the model
//! that the check caught), and the inputs whose guaranteed bound came within 10 % of the
//! difference (`CLOSE`).
#[path = "../tests/zoo/mod.rs"]
mod zoo;

use zoo::adversary::{climb, Calls};
use zoo::Op;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(300);
    let filter = args.get(2).cloned().unwrap_or_default();
    let starts: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(3);
    let seed: u64 = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(0);
    let ops: Vec<Op> = zoo::ops();
    let mut worst = Calls::default();
    let mut violations = 0usize;
    let mut fallbacks = 0usize;
    for op in ops {
        for pair in zoo::pairs(op) {
            let name = format!("{} {}", op.name(), pair.name);
            if !filter.is_empty() && !name.contains(&filter) {
                continue;
            }
            let mut cell = Calls::default();
            for c in climb(op, &pair, steps, starts, seed) {
                let (rows, k) = c.shape;
                let tag = if c.calls.violated() {
                    violations += 1;
                    Some("VIOLATION")
                } else if c.calls.fallback {
                    fallbacks += 1;
                    Some("FALLBACK")
                } else if c.guaranteed && c.calls.score(true) > 0.9 {
                    // A guaranteed bound within 10 % of its difference (not determined).
                    Some("CLOSE")
                } else {
                    None
                };
                if let Some(tag) = tag {
                    println!(
                        "{tag} {name} from {} [{rows}, {k}]: {:?}\n  x = {:?}\n  b = {:?}",
                        c.family.name(),
                        c.calls,
                        c.x,
                        c.b.values()
                    );
                }
                cell = cell.max(c.calls);
            }
            println!(
                "{name:<60} norm g {:.3} p {:.3}   element g {:.3} p {:.3}{}",
                cell.norm_g,
                cell.norm_p,
                cell.elem_g,
                cell.elem_p,
                if cell.fallback { "   fallback" } else { "" }
            );
            worst = worst.max(cell);
        }
    }
    println!("closest calls: {worst:?}; violations: {violations}; fallbacks: {fallbacks}");
}

//! The data-zoo sweep: every op family with a threshold, every data family, a set of policy
//! pairs, at several reduction lengths; writes a table of violations, closest calls and median
//! tightness.
//!
//! `cargo run --release --example zoo -- [trials] [out.md]` (default 100 trials; the documented
//! full sweep uses 10000, see docs/zoo.md).
#[path = "../tests/zoo/mod.rs"]
mod zoo;

fn main() -> ttrace::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let trials: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(100);
    let filter = args.get(2).cloned().unwrap_or_default();
    let shapes = [(2, 4), (64, 16), (1024, 16)];
    let rows = zoo::sweep(&zoo::ops(), &shapes, trials, &|op, fam, pair| {
        filter.is_empty() || format!("{} {} {}", op.name(), fam.name(), pair).contains(&filter)
    })?;
    let mut bad = 0;
    for r in &rows {
        let c = &r.cell;
        let flag = if c.failures() > 0 { "FAIL" } else { "" };
        if c.failures() > 0 {
            bad += 1;
        }
        println!(
            "{flag:4} {:<10} {:<20} {:<44} k={:<5} g={} p={} o={} nf={} ref={}/{} closest={:.3} med={:.3} exact={}",
            r.op.name(), r.family.name(), r.pair, r.k, c.guaranteed_violations, c.probabilistic_violations,
            c.oracle_violations, c.unflagged_non_finite, c.refused, c.refused_finite, c.closest(), c.median(), c.exact
        );
    }
    println!("{bad} failing cells of {}", rows.len());
    Ok(())
}

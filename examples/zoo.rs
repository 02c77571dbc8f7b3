//! The data-zoo sweep: every op family with a threshold, every data family, a set of policy
//! pairs, at several reduction lengths; prints each cell and writes a Markdown report of
//! violations, refusals, closest calls and median tightness per op and family.
//!
//! `cargo run --release --example zoo -- [trials] [filter] [report.md] [shapes]`
//! (default 100 trials per cell, every cell, no report, shapes
//! `2x1,64x16,1024x64,16384x4`; a shape may carry its own trial count, `64x16:1000`;
//! `docs/zoo.md` records the published run and its command). Cells run in parallel on all
//! cores.
#[path = "../tests/zoo/mod.rs"]
mod zoo;

use std::collections::BTreeMap;
use std::fmt::Write as _;

fn main() -> ttrace::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let trials: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(100);
    let filter = args.get(2).cloned().unwrap_or_default();
    let report = args.get(3).cloned();
    let spec = args
        .get(4)
        .cloned()
        .unwrap_or_else(|| "2x1,64x16,1024x64,16384x4".into());
    let shapes = parse_shapes(&spec, trials)?;
    let start = std::time::Instant::now();
    let rows = zoo::sweep(&zoo::ops(), &shapes, &|op, fam, pair| {
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
            "{flag:4} {:<22} {:<20} {:<40} k={:<5} g={} p={} o={} nf={} ref={}/{} closest={:.3} med={:.3} exact={} fallback={}",
            r.op.name(), r.family.name(), r.pair, r.k, c.guaranteed_violations, c.probabilistic_violations,
            c.oracle_violations, c.unflagged_non_finite, c.refused, c.refused_finite, c.closest(), c.median(), c.exact, c.model_fallbacks
        );
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{bad} failing cells of {} ({spec}, {secs:.0} s)",
        rows.len()
    );
    if let Some(path) = report.filter(|p| !p.is_empty()) {
        std::fs::write(&path, markdown(&rows, &spec, secs)).map_err(|e| ttrace::Error::File {
            path: path.clone(),
            reason: e.to_string(),
            io: Some(ttrace::IoError(std::sync::Arc::new(e))),
        })?;
    }
    Ok(())
}

/// `KxROWS[:TRIALS],…` → (k, rows, trials), `trials` where a shape names none.
fn parse_shapes(spec: &str, trials: usize) -> ttrace::Result<Vec<(usize, usize, usize)>> {
    let bad = || ttrace::Error::InvalidParameter {
        name: "shapes",
        reason: format!("expected KxROWS[:TRIALS],… (e.g. 2x1:10000,64x16), got {spec:?}"),
    };
    spec.split(',')
        .map(|s| {
            let (shape, t) = s.split_once(':').unwrap_or((s, ""));
            let (k, r) = shape.split_once('x').ok_or_else(bad)?;
            let t = if t.is_empty() {
                trials
            } else {
                t.parse().map_err(|_| bad())?
            };
            Ok((
                k.parse().map_err(|_| bad())?,
                r.parse().map_err(|_| bad())?,
                t,
            ))
        })
        .collect()
}

/// Per (op, family): cells, trials, violations, refusals, closest call and median tightness.
fn markdown(rows: &[zoo::Row], spec: &str, secs: f64) -> String {
    #[derive(Default)]
    struct Agg {
        cells: usize,
        trials: usize,
        g: usize,
        p: usize,
        oracle: usize,
        nonfinite: usize,
        refused: usize,
        exact: usize,
        fallbacks: usize,
        closest: f64,
        ratios: Vec<f64>,
    }
    let mut by: BTreeMap<(String, String), Agg> = BTreeMap::new();
    for r in rows {
        let a = by
            .entry((r.op.name(), r.family.name()))
            .or_insert_with(|| Agg {
                closest: f64::INFINITY,
                ..Agg::default()
            });
        let c = &r.cell;
        a.cells += 1;
        a.trials += c.trials;
        a.g += c.guaranteed_violations;
        a.p += c.probabilistic_violations;
        a.oracle += c.oracle_violations;
        a.nonfinite += c.unflagged_non_finite;
        a.refused += c.refused;
        a.exact += c.exact;
        a.fallbacks += c.model_fallbacks;
        a.closest = a.closest.min(c.closest());
        a.ratios.extend(c.ratios.iter().copied());
    }
    let cells: usize = by.values().map(|a| a.cells).sum();
    let total: usize = by.values().map(|a| a.trials).sum();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{cells} cells (shapes K×outputs:trials {spec}), {total} trials, δ = 1e-6, {secs:.0} s on this machine.\n"
    );
    let _ = writeln!(
        s,
        "| op | family | cells | trials | guaranteed violations | probabilistic violations | oracle violations | unflagged non-finite | refused | both sides exact | model fallbacks | closest call min(τ/d) | median τ/d |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for ((op, fam), a) in &mut by {
        a.ratios.sort_by(|x, y| x.total_cmp(y));
        let med = a
            .ratios
            .get(a.ratios.len() / 2)
            .copied()
            .unwrap_or(f64::NAN);
        let show = |v: f64| {
            if v.is_finite() {
                format!("{v:.2}")
            } else {
                "—".into()
            }
        };
        let _ = writeln!(
            s,
            "| {op} | {fam} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            a.cells,
            a.trials,
            a.g,
            a.p,
            a.oracle,
            a.nonfinite,
            a.refused,
            a.exact,
            a.fallbacks,
            show(a.closest),
            show(med)
        );
    }
    s
}

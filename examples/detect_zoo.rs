//! The data zoo for the tests beyond the norm: every structured data family of
//! `tests/zoo` through the ops that make matrices (matmul, softmax, LayerNorm, RMSNorm, the
//! elementwise ops, attention, the cross-entropy gradient), each pair of correct policies, and the scale, bias and sparse tests
//! ([`ttrace::check::Detection`]) on the two results — which differ by round-off only, so any
//! test that fires is a false alarm. Prints the closest call of each test per op and family,
//! and every false alarm.
//!
//! With `--power`, each pair also gets the smallest perturbation its tests detect, per data
//! family (`papers/checking.md` §7, power by data class): a scale 1 + ρ of the candidate
//! (rounded to its format: for BF16 outputs a scale after the final rounding, which rounds
//! back below half an ulp) found by the scale test, and one element × (1 + ρ) found by the
//! sparse test, ρ in ε of the output format (bisection on the realized pair: the detection
//! point of that pair, not a power over draws). Medians per op and family.
//!
//! `cargo run --release --example detect_zoo -- [trials] [filter] [--priced] [--power]`
//! (default 3 trials per cell, about 47 minutes on one core with attention at k = 1,024;
//! `docs/zoo.md` records the published run). Outputs are
//! [256, 64] (matmul: A [256, k] from the family, B [k, 64] Gaussian) or [256, k], at k = 64
//! and 1024. The norm's threshold is half the reference's norm (below it, so that the tests
//! beyond the norm apply; far above these differences), or with `--priced` the pair's priced
//! threshold (the norm judged too; slow: about an hour per trial).
#[path = "../tests/zoo/mod.rs"]
mod zoo;

use std::collections::BTreeMap;

use ttrace::bounds::Confidence;
use ttrace::check::{compare_tensor_with, Detection, Detector};
use ttrace::{Format, Tensor};
use zoo::{Family, Op, FAMILIES};

/// Per detector: (applied, fired, closest ratio) — one (op, family) cell of the table.
type Cell = BTreeMap<Detector, (usize, usize, f64)>;

const ROWS: usize = 256;
const COLS: usize = 64;

/// The inputs of one trial: x [ROWS, k] from the family and the second operand (B [k, COLS]
/// Gaussian for a matmul, attention's K and V [ROWS, 2k], a Gaussian [ROWS, k] for `add`,
/// unused otherwise).
fn inputs(op: Op, family: Family, k: usize, seed: u64, pair: &zoo::Pair) -> (Tensor, Tensor) {
    let input = pair.reference.input();
    let acc = pair.reference.accumulator();
    if let Op::Attention(_) = op {
        return zoo::attention_operands(family, ROWS, k, seed, input, acc).expect("zoo data");
    }
    let x = zoo::generate(family, ROWS, k, seed, input, acc);
    let x = Tensor::from_vec(&[ROWS, k], x, input).expect("zoo data");
    let b = match op {
        Op::Matmul => {
            let bt = zoo::generate(Family::Gaussian, COLS, k, seed ^ 0x5eed, input, acc);
            let mut bv = vec![0.0; k * COLS];
            for j in 0..COLS {
                for p in 0..k {
                    bv[p * COLS + j] = bt[j * k + p];
                }
            }
            Tensor::from_vec(&[k, COLS], bv, input).expect("zoo data")
        }
        _ => {
            let y = zoo::generate(Family::Gaussian, ROWS, k, seed ^ 0x5eed, input, acc);
            Tensor::from_vec(&[ROWS, k], y, input).expect("zoo data")
        }
    };
    (x, b)
}

fn main() -> ttrace::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let priced = args.iter().any(|a| a == "--priced");
    let power = args.iter().any(|a| a == "--power");
    let args: Vec<String> = args
        .into_iter()
        .filter(|a| a != "--priced" && a != "--power")
        .collect();
    // Per (op, family): the detection points of the scale and the one-element perturbations.
    let mut points: BTreeMap<(String, String), (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    let trials: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    let filter = args.get(2).cloned().unwrap_or_default();
    let ops: Vec<Op> = zoo::ops()
        .into_iter()
        // Ops that make matrices: not the reductions, nor the loss (one value).
        .filter(|o| !matches!(o, Op::Sum | Op::Mean | Op::AllReduce | Op::CrossEntropy))
        .collect();
    let mut table: BTreeMap<(String, String), Cell> = BTreeMap::new();
    let mut alarms = vec![];
    let mut pairs_run = 0usize;
    let mut norm_alarms = 0usize;
    let mut skipped = 0usize;
    for op in &ops {
        for family in FAMILIES {
            for pair in zoo::pairs(*op) {
                let name = format!("{} {} {}", op.name(), family.name(), pair.name);
                if !filter.is_empty() && !name.contains(&filter) {
                    continue;
                }
                for k in [64usize, 1024] {
                    for seed in 0..trials {
                        let (x, b) = inputs(*op, family, k, seed, &pair);
                        let (op_r, op_c) = match op {
                            Op::Softmax(_) | Op::LayerNorm(_) | Op::RmsNorm | Op::Attention(_) => {
                                (pair.ref_op, pair.cand_op)
                            }
                            _ => (*op, *op),
                        };
                        let cols = if *op == Op::Matmul { COLS } else { k };
                        let run = |o: Op, p: &ttrace::Policy| -> ttrace::Result<Tensor> {
                            let v = zoo::execute(o, &x, &b, p)?;
                            Tensor::from_vec(&[ROWS, cols], v, p.output)
                        };
                        let (r, c) = match (run(op_r, &pair.reference), run(op_c, &pair.candidate))
                        {
                            (Ok(r), Ok(c)) => (r, c),
                            // Overflow and the like: the norm's business (refused there).
                            _ => continue,
                        };
                        if r.values().iter().chain(c.values()).any(|v| !v.is_finite()) {
                            continue;
                        }
                        pairs_run += 1;
                        let acc = [pair.reference.accumulator(), pair.candidate.accumulator()]
                            .into_iter()
                            .min_by_key(|f| f.precision())
                            .unwrap_or(Format::F32);
                        let detection = Detection::default().accumulated_in(acc);
                        let eps = pair.reference.output.machine_epsilon();
                        // The norm's threshold: priced for the pair (its probabilistic threshold
                        // at its share of δ; slow at k = 1024), or half the reference's norm —
                        // below it, as any useful threshold is, so that the tests beyond the
                        // norm apply, and far above these pairs' differences.
                        let rn = r.values().iter().map(|v| v * v).sum::<f64>().sqrt();
                        let th = if priced {
                            let th = zoo::threshold(
                                op_r,
                                op_c,
                                &x,
                                &b,
                                &pair,
                                Confidence::Probabilistic {
                                    delta: 1e-6 * ttrace::check::NORM_SHARE,
                                },
                            );
                            let Ok(th) = th else {
                                continue;
                            };
                            th.abs_frobenius
                        } else {
                            0.5 * rn
                        };
                        let v = compare_tensor_with("zoo|fwd.output.0", &r, &c, th, eps, detection);
                        if v.ratio > 1.0 {
                            if !priced {
                                // A difference beyond half the reference (a candidate that
                                // lost its values to underflow): only its priced threshold
                                // can judge it, and where that allows as much as the
                                // reference, no systematic test runs.
                                skipped += 1;
                                continue;
                            }
                            norm_alarms += 1;
                            alarms.push(format!("{name} k={k} seed={seed}: norm {:.2}x", v.ratio));
                        }
                        if power {
                            let p = points.entry((op.name(), family.name())).or_default();
                            let found = |d: Detector, bad: &Tensor| {
                                compare_tensor_with("zoo|fwd.output.0", &r, bad, th, eps, detection)
                                    .findings
                                    .iter()
                                    .any(|f| f.detector == d && f.fired)
                            };
                            let out = pair.candidate.output;
                            let scaled = |rho: f64| {
                                let v = c
                                    .values()
                                    .iter()
                                    .map(|x| {
                                        out.round(
                                            x * (1.0 + rho * eps),
                                            ttrace::Overflow::NonSaturating,
                                        )
                                    })
                                    .collect();
                                Tensor::from_vec(&[ROWS, cols], v, out).ok()
                            };
                            p.0.push(detection_point(|rho| {
                                scaled(rho).is_some_and(|t| found(Detector::Scale, &t))
                            }));
                            // One element at a seeded place of at least the median magnitude.
                            let mut mags: Vec<f64> = r.values().iter().map(|v| v.abs()).collect();
                            mags.sort_by(f64::total_cmp);
                            let median = mags[mags.len() / 2];
                            let start = (seed as usize * 7919 + 17) % r.len();
                            let at = (0..r.len())
                                .map(|k| (start + k) % r.len())
                                .find(|&k| r.values()[k].abs() >= median && r.values()[k] != 0.0);
                            if let Some(at) = at {
                                let element = |rho: f64| {
                                    let mut v = c.values().to_vec();
                                    v[at] = out.round(
                                        v[at] * (1.0 + rho * eps),
                                        ttrace::Overflow::NonSaturating,
                                    );
                                    Tensor::from_vec(&[ROWS, cols], v, out).ok()
                                };
                                p.1.push(detection_point(|rho| {
                                    element(rho).is_some_and(|t| found(Detector::Sparse, &t))
                                }));
                            }
                        }
                        let cell = table.entry((op.name(), family.name())).or_default();
                        for f in &v.findings {
                            let e = cell.entry(f.detector).or_insert((0, 0, 0.0));
                            e.0 += 1;
                            e.1 += usize::from(f.fired);
                            e.2 = e.2.max(f.ratio);
                            if f.fired {
                                alarms.push(format!(
                                    "{name} k={k} seed={seed}: {} {:.3} against {:.3} ({:.2}x)",
                                    f.detector.name(),
                                    f.estimate,
                                    f.threshold,
                                    f.ratio
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    println!("| op | family | scale: applied / fired / closest | bias | sparse |");
    println!("|---|---|---|---|---|");
    let mut worst: BTreeMap<Detector, f64> = BTreeMap::new();
    for ((op, fam), cell) in &table {
        let show = |d: Detector| {
            cell.get(&d)
                .map_or("-".to_string(), |(n, f, m)| format!("{n} / {f} / {m:.2}"))
        };
        for (d, (_, _, m)) in cell {
            let w = worst.entry(*d).or_insert(0.0);
            *w = w.max(*m);
        }
        println!(
            "| {op} | {fam} | {} | {} | {} |",
            show(Detector::Scale),
            show(Detector::Bias),
            show(Detector::Sparse)
        );
    }
    println!();
    println!(
        "{pairs_run} pairs compared; false alarms: {} ({norm_alarms} of the norm); {skipped} \
         pairs differ by more than half the reference (judged only with --priced)",
        alarms.len()
    );
    for (d, m) in &worst {
        println!("closest {}: {m:.3}", d.name());
    }
    for a in &alarms {
        println!("FALSE ALARM {a}");
    }
    if power {
        println!();
        println!("Detection points (ε of the output format; median over the pairs, inf: not found by 10⁴ ε)");
        println!("| op | family | scale | 1 element |");
        println!("|---|---|---|---|");
        let mut by_family: BTreeMap<String, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
        for ((op, fam), (sc, el)) in &points {
            println!("| {op} | {fam} | {:.3} | {:.1} |", median(sc), median(el));
            let e = by_family.entry(fam.clone()).or_default();
            e.0.extend(sc);
            e.1.extend(el);
        }
        println!();
        println!("| family | scale | 1 element |");
        println!("|---|---|---|");
        for (fam, (sc, el)) in &by_family {
            println!("| {fam} | {:.3} | {:.1} |", median(sc), median(el));
        }
    }
    Ok(())
}

/// The median of `v` (∞ when empty).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::INFINITY)
}

/// The smallest ρ (in ε) at which `fires` holds, to 2% by bisection after doubling from
/// 10⁻⁴; ∞ when it does not hold at 10⁴.
fn detection_point(fires: impl Fn(f64) -> bool) -> f64 {
    let mut hi = 1e-4;
    while !fires(hi) {
        hi *= 2.0;
        if hi > 1e4 {
            return f64::INFINITY;
        }
    }
    let mut lo = hi / 2.0;
    while hi / lo > 1.02 {
        let mid = (lo * hi).sqrt();
        if fires(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

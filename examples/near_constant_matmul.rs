//! Reproducer of an open finding (issue 34): near-constant FP32 products whose outputs share
//! an A row make correlated undetermined errors, which the tensor threshold adds as
//! independent. A = c + small integers in one element of eight (c from 250 to 60,000), B the
//! same around 0.913; sequential against the given order, FP32 accumulation.
//!
//! `cargo run --release --example near_constant_matmul -- M K N ORDER SEED`, e.g.
//! `-- 32 256 32 blocked:16 3`: per output the walk's model (determined mean, standard
//! deviation of the rest) against the engine's errors, z = (rest of the difference)/σ, and how
//! the z's of one row and of one column move together (independent outputs: variance of a
//! row's mean z ≈ 1/N). Measured on 2026-11-27: variance of row means 0.25–0.48 against 0.031
//! (ρ ≈ 0.3–0.45 within a row; columns near independent), and in 10 trials of each shape
//! τ/d down to 0.961 (32 × 256 × 32, blocked(16)), 0.968 (32 × 1024 × 32), 0.996–0.999
//! (8 × 1024 × 8; pairwise(8)).
use ttrace::bounds::reduction_error;
use ttrace::{dot, exact_sum, Accumulation, Format, Order, Overflow, Tensor};

fn main() -> ttrace::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let parse = |s: String| -> usize { s.parse().unwrap_or(32) };
    let (m, k, n) = (
        parse(arg(1, "32")),
        parse(arg(2, "256")),
        parse(arg(3, "32")),
    );
    let order: Order = arg(4, "blocked:16").parse()?;
    let seed: u64 = arg(5, "3").parse().unwrap_or(3);
    let fmt = Format::F32;
    let mut g = ttrace::engine::SplitMix64::for_name("nc", seed);
    let mut draw = |len: usize, c: f64| -> Vec<f64> {
        (0..len)
            .map(|_| {
                if g.next_u64() % 8 == 0 {
                    c + (1 + g.next_u64() % 4) as f64
                } else {
                    c
                }
            })
            .collect()
    };
    let c0 = [250.0, 1000.0, 3e4][(seed % 3) as usize] * (1.0 + (seed as f64 * 0.137).fract());
    let a = Tensor::rounded(&[m, k], draw(m * k, c0), fmt, Overflow::Saturating)?;
    let b = Tensor::rounded(&[k, n], draw(k * n, 0.913), fmt, Overflow::Saturating)?;
    let ar = Accumulation::new(fmt, Format::F32, Order::Sequential);
    let ac = Accumulation::new(fmt, Format::F32, order);
    let mut zs = vec![0.0; m * n];
    let (mut sum_r2, mut sum_h) = (0.0, 0.0);
    for i in 0..m {
        for j in 0..n {
            let x: Vec<f64> = (0..k).map(|p| a.values()[i * k + p]).collect();
            let y: Vec<f64> = (0..k).map(|p| b.values()[p * n + j]).collect();
            let terms: Vec<f64> = x.iter().zip(&y).map(|(p, q)| p * q).collect();
            let exact = exact_sum(&terms);
            let (er, ec) = (
                reduction_error(&terms, &ar, true)?,
                reduction_error(&terms, &ac, true)?,
            );
            let (sr, sc) = (dot(&x, &y, &ar)? - exact, dot(&x, &y, &ac)? - exact);
            let rest = (sc - ec.mean) - (sr - er.mean);
            let h = er.variance + ec.variance;
            zs[i * n + j] = if h > 0.0 { rest / h.sqrt() } else { 0.0 };
            sum_r2 += rest * rest;
            sum_h += h;
            if i < 2 && j < 4 {
                println!(
                    "({i},{j}) reference error {sr:e} (model mean {:e}, sd {:e}); candidate {sc:e} ({:e}, {:e})",
                    er.mean,
                    er.variance.sqrt(),
                    ec.mean,
                    ec.variance.sqrt()
                );
            }
        }
    }
    let var = |v: &[f64]| {
        let mu = v.iter().sum::<f64>() / v.len() as f64;
        v.iter().map(|x| (x - mu).powi(2)).sum::<f64>() / v.len() as f64
    };
    let rows: Vec<f64> = (0..m)
        .map(|i| (0..n).map(|j| zs[i * n + j]).sum::<f64>() / n as f64)
        .collect();
    let cols: Vec<f64> = (0..n)
        .map(|j| (0..m).map(|i| zs[i * n + j]).sum::<f64>() / m as f64)
        .collect();
    println!(
        "variance of a row's mean z {:.4} (independent: {:.4}), of a column's {:.4} ({:.4}); \
         Σ rest² / Σ σ² = {:.3}",
        var(&rows),
        1.0 / n as f64,
        var(&cols),
        1.0 / m as f64,
        sum_r2 / sum_h
    );
    Ok(())
}

//! Reference GEMM order versus a tensor-parallel split-K order on the same BF16 data:
//! how far apart they land, and what Higham's depth bound allows each of them.
//!
//! Run with `cargo run --release --example split_k`.

use ttrace::{dot, exact_dot, Accumulation, Combine, Format, Order, Overflow, Products};

fn main() -> ttrace::Result<()> {
    let k = 4096;
    // Deterministic BF16 inputs in [-1, 1).
    let mut state = 0x2545F4914F6CDD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        Format::BF16.round(
            (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0,
            Overflow::NonSaturating,
        )
    };
    let x: Vec<f64> = (0..k).map(|_| next()).collect();
    let y: Vec<f64> = (0..k).map(|_| next()).collect();
    let exact = exact_dot(&x, &y)?;
    let scale: f64 = x.iter().zip(&y).map(|(a, b)| (a * b).abs()).sum();

    let policies = [
        (
            "reference: FP32 FMA chain",
            Accumulation::new(Format::BF16, Format::F32, Order::Sequential),
        ),
        (
            "tensor core: FP32, 32-wide block FMA",
            Accumulation::new(
                Format::BF16,
                Format::F32,
                Order::Blocked {
                    block: 32,
                    inner: ttrace::BlockSum::Fused,
                },
            ),
        ),
        (
            "TP=8 row-parallel: BF16 partials, ring all-reduce",
            Accumulation::new(
                Format::BF16,
                Format::F32,
                Order::SplitK {
                    parts: 8,
                    inner: Box::new(Order::Sequential),
                    partial: Format::BF16,
                    combine: Combine::ring_for_chunk(0, 8)?,
                },
            ),
        ),
        (
            "BF16 accumulator, products rounded to BF16",
            Accumulation::new(Format::BF16, Format::BF16, Order::Pairwise { base: 8 })
                .with_products(Products::Rounded(Format::BF16)),
        ),
    ];
    println!("K = {k}, exact dot = {exact:.9e}, sum |x_i y_i| = {scale:.4e}\n");
    println!(
        "{:<52} {:>16} {:>12} {:>12} {:>8}",
        "order", "result", "|error|", "bound", "depth"
    );
    for (name, policy) in &policies {
        let value = dot(&x, &y, policy)?;
        let depths = policy.dot_depths(k)?;
        let bound = x
            .iter()
            .zip(&y)
            .zip(&depths)
            .map(|((a, b), d)| (a * b).abs() * d.relative_error_bound())
            .sum::<f64>();
        let max_depth = depths.iter().map(|d| d.total()).max().unwrap_or(0);
        println!(
            "{name:<52} {value:>16.9e} {:>12.3e} {bound:>12.3e} {max_depth:>8}",
            (value - exact).abs()
        );
    }
    Ok(())
}

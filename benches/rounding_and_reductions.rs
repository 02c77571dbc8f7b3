//! Rounding throughput beside the `half` crate, and emulated dot products beside a native
//! `f32` loop, measured in the same run. Run with `cargo bench --bench rounding_and_reductions`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use half::slice::HalfFloatSliceExt;
use rand::{Rng, SeedableRng};
use ttrace::{dot, Accumulation, BlockSum, Format, Order, Overflow, Products};

fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-4.0f32..4.0)).collect()
}

fn rounding(c: &mut Criterion) {
    let n = 1 << 20;
    let src32 = random_f32(n, 1);
    let src64: Vec<f64> = src32.iter().map(|&x| x as f64).collect();
    let mut g = c.benchmark_group("round_1M");
    g.throughput(Throughput::Elements(n as u64));
    g.measurement_time(Duration::from_secs(3)).sample_size(20);

    let mut out_bf16 = vec![half::bf16::ZERO; n];
    g.bench_function("half_bf16_from_f32_slice", |b| {
        b.iter(|| out_bf16.convert_from_f32_slice(black_box(&src32)))
    });
    let mut out_f16 = vec![half::f16::ZERO; n];
    g.bench_function("half_f16_from_f32_slice", |b| {
        b.iter(|| out_f16.convert_from_f32_slice(black_box(&src32)))
    });
    let mut bits16 = vec![0u16; n];
    for f in [Format::BF16, Format::F16] {
        g.bench_function(format!("ttrace_{}_round_f32_to_bits", f.name()), |b| {
            b.iter(|| {
                f.round_f32_to_bits(black_box(&src32), &mut bits16, Overflow::NonSaturating)
                    .unwrap()
            })
        });
    }
    let mut buf = src64.clone();
    for f in [
        Format::BF16,
        Format::F16,
        Format::E4M3,
        Format::E5M2,
        Format::F32,
    ] {
        // The copy that restores the input is setup, not measured (iter_batched_ref).
        g.bench_function(format!("ttrace_{}_round_slice", f.name()), |b| {
            b.iter_batched_ref(
                || src64.clone(),
                |buf| f.round_slice(black_box(buf), Overflow::Saturating),
                BatchSize::LargeInput,
            )
        });
    }
    g.bench_function("copy_only_baseline", |b| {
        b.iter(|| buf.copy_from_slice(black_box(&src64)))
    });
    g.finish();
}

fn dots(c: &mut Criterion) {
    let n = 4096;
    let x32: Vec<f32> = random_f32(n, 2)
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    let y32: Vec<f32> = random_f32(n, 3)
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    let x: Vec<f64> = x32.iter().map(|&v| v as f64).collect();
    let y: Vec<f64> = y32.iter().map(|&v| v as f64).collect();
    let mut g = c.benchmark_group("dot_4096_bf16_inputs");
    g.throughput(Throughput::Elements(n as u64));
    g.measurement_time(Duration::from_secs(3)).sample_size(20);

    g.bench_function("native_f32_loop", |b| {
        b.iter(|| {
            let (x, y) = (black_box(&x32), black_box(&y32));
            let mut s = 0.0f32;
            for i in 0..x.len() {
                s += x[i] * y[i];
            }
            s
        })
    });
    let cases = [
        (
            "f32_acc_sequential_rounded_products",
            Format::F32,
            Order::Sequential,
            Products::Rounded(Format::F32),
        ),
        (
            "f32_acc_sequential_fma",
            Format::F32,
            Order::Sequential,
            Products::Exact,
        ),
        (
            "f32_acc_pairwise8_fma",
            Format::F32,
            Order::Pairwise { base: 8 },
            Products::Exact,
        ),
        (
            "f32_acc_block32_fused",
            Format::F32,
            Order::Blocked {
                block: 32,
                inner: BlockSum::Fused,
            },
            Products::Exact,
        ),
        (
            "bf16_acc_sequential_fma",
            Format::BF16,
            Order::Sequential,
            Products::Exact,
        ),
        (
            "f16_acc_sequential_fma",
            Format::F16,
            Order::Sequential,
            Products::Exact,
        ),
    ];
    for (name, acc, order, products) in cases {
        let policy = Accumulation::new(Format::BF16, acc, order).with_products(products);
        g.bench_function(name, |b| {
            b.iter(|| dot(black_box(&x), black_box(&y), &policy).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, rounding, dots);
criterion_main!(benches);

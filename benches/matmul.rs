//! Emulated matmul throughput beside ndarray's own f32 matmul (matrixmultiply), in one run.
//! Run with `cargo bench --bench matmul`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ndarray::Array2;
use ttrace::engine::{matmul, Policy, Tensor};
use ttrace::{BlockSum, Format, Order, Overflow, Products};

fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut g = ttrace::engine::init::SplitMix64::for_name("bench", seed);
    (0..n)
        .map(|_| Format::BF16.round(2.0 * g.uniform() - 1.0, Overflow::NonSaturating))
        .collect()
}

fn bench_size(c: &mut Criterion, n: usize, generic: bool) {
    let a = values(n * n, 1);
    let b = values(n * n, 2);
    let mut g = c.benchmark_group(format!("matmul_{n}"));
    g.throughput(Throughput::Elements((n * n * n) as u64)); // multiply-adds
    g.measurement_time(Duration::from_secs(4)).sample_size(10);
    let a32 = Array2::from_shape_vec((n, n), a.iter().map(|&x| x as f32).collect()).unwrap();
    let b32 = Array2::from_shape_vec((n, n), b.iter().map(|&x| x as f32).collect()).unwrap();
    g.bench_function("ndarray_f32_dot", |bch| {
        bch.iter(|| black_box(&a32).dot(black_box(&b32)))
    });
    let ta = Tensor::from_vec(&[n, n], a.clone(), Format::BF16).unwrap();
    let tb = Tensor::from_vec(&[n, n], b.clone(), Format::BF16).unwrap();
    let mut cases = vec![
        (
            "bf16_in_f32_acc_sequential_fma",
            Policy::new(Format::BF16, Format::F32, Format::F32),
        ),
        (
            "bf16_in_f32_acc_blocked64",
            Policy::new(Format::BF16, Format::F32, Format::F32).with_order(Order::Blocked {
                block: 64,
                inner: BlockSum::Sequential,
            }),
        ),
        (
            "f32_in_f32_acc_rounded_products",
            Policy::new(Format::F32, Format::F32, Format::F32)
                .with_products(Products::Rounded(Format::F32)),
        ),
    ];
    if generic {
        cases.push((
            "bf16_acc_generic",
            Policy::new(Format::BF16, Format::BF16, Format::BF16),
        ));
        cases.push((
            "f16_acc_generic",
            Policy::new(Format::BF16, Format::F16, Format::F16),
        ));
        cases.push((
            "f32_acc_block_fma32",
            Policy::new(Format::BF16, Format::F32, Format::F32).with_order(Order::Blocked {
                block: 32,
                inner: BlockSum::Fused,
            }),
        ));
    }
    for (name, policy) in cases {
        g.bench_function(name, |bch| {
            bch.iter(|| matmul(black_box(&ta), black_box(&tb), &policy).unwrap())
        });
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench_size(c, 128, true);
    bench_size(c, 512, false);
}

criterion_group!(matmul_benches, benches);
criterion_main!(matmul_benches);

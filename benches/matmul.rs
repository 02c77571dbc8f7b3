//! Emulated matmul throughput beside ndarray's own f32 matmul (matrixmultiply), in one run.
//! Run with `MATMUL_NUM_THREADS=1 cargo bench --bench matmul -- threads1` (single thread: the
//! baseline with one thread, ttrace in a one-thread pool) and `MATMUL_NUM_THREADS=2 cargo bench
//! --bench matmul -- threads2` (all cores of a 2-core machine; matrixmultiply reads the variable
//! once per process, hence two runs).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ndarray::Array2;
use ttrace::engine::matmul;
use ttrace::{BlockSum, Format, Order, Overflow, Products};
use ttrace::{Policy, Tensor};

fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut g = ttrace::engine::SplitMix64::for_name("bench", seed);
    (0..n)
        .map(|_| Format::BF16.round(2.0 * g.uniform() - 1.0, Overflow::NonSaturating))
        .collect()
}

fn bench_size(c: &mut Criterion, n: usize, generic: bool, slow: bool, threads: usize) {
    let a = values(n * n, 1);
    let b = values(n * n, 2);
    let mut g = c.benchmark_group(format!("matmul_{n}_threads{threads}"));
    g.throughput(Throughput::Elements((n * n * n) as u64)); // multiply-adds
    g.measurement_time(Duration::from_secs(4)).sample_size(10);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let a32 = Array2::from_shape_vec((n, n), a.iter().map(|&x| x as f32).collect()).unwrap();
    let b32 = Array2::from_shape_vec((n, n), b.iter().map(|&x| x as f32).collect()).unwrap();
    let mm = std::env::var("MATMUL_NUM_THREADS").unwrap_or_else(|_| "default".into());
    g.bench_function(format!("ndarray_f32_dot_MATMUL_NUM_THREADS={mm}"), |bch| {
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
    }
    if slow {
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
            bch.iter(|| pool.install(|| matmul(black_box(&ta), black_box(&tb), &policy).unwrap()))
        });
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    // Generic accumulators at 128³ (with the slow blocked-FMA order) and 512³.
    bench_size(c, 128, true, true, 1);
    for threads in [1, 2] {
        bench_size(c, 512, true, false, threads);
        bench_size(c, 1024, false, false, threads);
    }
}

criterion_group!(matmul_benches, benches);
criterion_main!(matmul_benches);

//! What a threshold costs beside the op it prices (issue 34's target: a matmul threshold
//! within 5× one BLAS GEMM of the same shape and threads, median over the shapes, 10× at
//! worst; sum, softmax and norm thresholds within 5× the op), measured in the same run, one
//! thread each:
//! * matmul: `matmul_threshold_priced` (BF16 operands, FP32 accumulation, sequential vs
//!   split-K 8) with `Pricing::Fast` (guaranteed — two GEMMs — and probabilistic) and, for
//!   shapes up to 2²² multiply-adds, `Pricing::Walk` ÷ ndarray's f32 matmul (matrixmultiply) of
//!   the same shape;
//! * sum, softmax, LayerNorm: the threshold (sequential vs pairwise 8) ÷ a native f32 loop
//!   computing the op on the same rows (sums and LayerNorm priced both ways, `Pricing::Walk`
//!   and `Pricing::Fast`, sums guaranteed too), and the floor of a sum threshold priced from its executions' roundings
//!   (`sum_floor`).
//!
//! Run with `MATMUL_NUM_THREADS=1 cargo bench --bench pricing`. `PRICING_SHAPES` lists the
//! matmul shapes as m×k×n (default 64³ to 1024³; `PRICING_SHAPES=4096x4096x4096` adds
//! issue 34's largest shape, about two minutes).

use std::hint::black_box;
use std::time::Instant;

use ndarray::Array2;
use ttrace::bounds::{
    matmul_threshold_priced, norm_threshold_priced, softmax_threshold, sum_threshold_priced,
    Confidence, NormData, NormOp, NormSide, Pricing,
};
use ttrace::engine::{AttentionImpl, SplitMix64, Variance};
use ttrace::{Combine, Format, Order, Overflow, Policy, Tensor};

/// Median wall time of `runs` calls of `f` (one warm-up call first), in seconds.
fn median<R>(runs: usize, mut f: impl FnMut() -> R) -> f64 {
    black_box(f());
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            black_box(f());
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn bf16(n: usize, seed: u64) -> Vec<f64> {
    rounded(Format::BF16, n, seed)
}

/// `n` standard normal values rounded to `f`.
fn rounded(f: Format, n: usize, seed: u64) -> Vec<f64> {
    let mut g = SplitMix64::for_name("pricing", seed);
    (0..n)
        .map(|_| f.round(g.normal(), Overflow::NonSaturating))
        .collect()
}

/// The op a sum threshold is measured against: native `f32` sums of the rows of length `k`.
fn row_sums(x: &[f32], k: usize) -> Vec<f32> {
    x.chunks(k).map(|r| r.iter().sum::<f32>()).collect()
}

/// `runs` pairs of `op` then `th` (one warm-up pair first), each timed: the medians of each
/// and of the pairs' ratios, printed as a row.
fn series(name: &str, runs: usize, op: &dyn Fn(), th: &dyn Fn()) {
    op();
    th();
    let mut ops = vec![];
    let mut ths = vec![];
    let mut ratios = vec![];
    for _ in 0..runs {
        let s = Instant::now();
        op();
        let o = s.elapsed().as_secs_f64();
        let s = Instant::now();
        th();
        let t = s.elapsed().as_secs_f64();
        ops.push(o);
        ths.push(t);
        ratios.push(t / o);
    }
    let mid = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "{name:<24} {:>12.3e} {:>14.3e} {:>10.1}",
        mid(&mut ops),
        mid(&mut ths),
        mid(&mut ratios)
    );
}

fn shapes() -> Vec<(usize, usize, usize)> {
    let spec = std::env::var("PRICING_SHAPES").unwrap_or_else(|_| {
        "64x64x64,16x1024x16,64x1024x64,128x128x128,256x256x256,512x512x512,1024x1024x1024".into()
    });
    spec.split(',')
        .map(|s| {
            let d: Vec<usize> = s.split('x').map(|v| v.trim().parse().unwrap()).collect();
            (d[0], d[1], d[2])
        })
        .collect()
}

/// Rows and columns of the floor kernel's register tile (3 × 16 `f32`: 6 accumulators and 6
/// statistic vectors of 8 lanes, with B's two vectors and A's broadcast, in AVX2's 16
/// registers).
const FR: usize = 3;
const FC: usize = 16;

/// The floor of any threshold priced from the roundings of an execution: C = A·B in the
/// sequential FMA order, and per output Σₚ ŝₚ's spacing², the least statistic a rounding model
/// gathers (the scale of each rounding's error), in register tiles — three vector operations
/// per multiply-add and 8 lanes (the FMA, the exponent mask, the FMA of the square) beside the
/// GEMM microkernel's one per 16 (two FMA ports). `a` is [m, k], `b` [k, n], n a multiple of
/// `FC`, m of `FR`. Returns Σ of the outputs and statistics (kept live).
fn floor_kernel(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn fast(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> f32 {
            floor_tiles(a, b, m, k, n)
        }
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { fast(a, b, m, k, n) };
    }
    floor_tiles(a, b, m, k, n)
}

#[inline(always)]
fn floor_tiles(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> f32 {
    let mut total = 0.0f32;
    for i in (0..m).step_by(FR) {
        for j in (0..n).step_by(FC) {
            let mut acc = [[0.0f32; FC]; FR];
            let mut spacing = [[0.0f32; FC]; FR];
            for p in 0..k {
                let bv: &[f32; FC] = b[p * n + j..p * n + j + FC].try_into().unwrap();
                for r in 0..FR {
                    let av = a[(i + r) * k + p];
                    for l in 0..FC {
                        let s = av.mul_add(bv[l], acc[r][l]);
                        let e = f32::from_bits(s.to_bits() & 0x7f80_0000);
                        spacing[r][l] = e.mul_add(e, spacing[r][l]);
                        acc[r][l] = s;
                    }
                }
            }
            for r in 0..FR {
                for l in 0..FC {
                    total += acc[r][l] + spacing[r][l];
                }
            }
        }
    }
    total
}

/// Lanes of the sums' floor: 8 rows at a time, one per `f32` lane of an AVX2 vector.
const SL: usize = 8;

/// The floor of a sum threshold priced from the roundings of its executions: each row of `x`
/// ([rows, k], k a power of two and at least 8, rows a multiple of [`SL`]) summed in the two
/// orders the bench prices — sequential, and pairwise(8) (blocks of 8 summed in order, then
/// the block sums halved pairwise) — gathering per row Σ spacing² of every rounded partial
/// sum (the exponent mask and one FMA per rounding), 8 rows in the lanes of one vector after
/// a transposition into row panels (counted). Returns Σ of the sums and statistics.
fn sum_floor(x: &[f32], rows: usize, k: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn fast(x: &[f32], rows: usize, k: usize) -> f32 {
            sum_floor_lanes(x, rows, k)
        }
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { fast(x, rows, k) };
    }
    sum_floor_lanes(x, rows, k)
}

#[inline(always)]
fn sum_floor_lanes(x: &[f32], rows: usize, k: usize) -> f32 {
    let spacing = |s: f32| f32::from_bits(s.to_bits() & 0x7f80_0000);
    let mut panel = vec![[0.0f32; SL]; k];
    let mut blocks = vec![[0.0f32; SL]; k / 8];
    let mut total = 0.0f32;
    for i in (0..rows).step_by(SL) {
        for (p, lanes) in panel.iter_mut().enumerate() {
            for (l, v) in lanes.iter_mut().enumerate() {
                *v = x[(i + l) * k + p];
            }
        }
        let (mut seq, mut stat) = ([0.0f32; SL], [0.0f32; SL]);
        for lanes in &panel {
            for l in 0..SL {
                seq[l] += lanes[l];
                let e = spacing(seq[l]);
                stat[l] = e.mul_add(e, stat[l]);
            }
        }
        for (b, chunk) in blocks.iter_mut().zip(panel.chunks_exact(8)) {
            *b = chunk[0];
            for lanes in &chunk[1..] {
                for l in 0..SL {
                    b[l] += lanes[l];
                    let e = spacing(b[l]);
                    stat[l] = e.mul_add(e, stat[l]);
                }
            }
        }
        let mut len = blocks.len();
        while len > 1 {
            for j in 0..len / 2 {
                for l in 0..SL {
                    let s = blocks[2 * j][l] + blocks[2 * j + 1][l];
                    let e = spacing(s);
                    stat[l] = e.mul_add(e, stat[l]);
                    blocks[j][l] = s;
                }
            }
            len /= 2;
        }
        for l in 0..SL {
            total += seq[l] + blocks[0][l] + stat[l];
        }
    }
    total
}

fn matmuls(pool: &rayon::ThreadPool) -> (Vec<f64>, Vec<f64>) {
    let r = Policy::new(Format::BF16, Format::F32, Format::F32);
    let c = r
        .clone()
        .with_order(Order::split_k(8, Format::F32, Combine::Tree));
    println!(
        "{:<16} {:>10} {:>12} {:>8} {:>12} {:>8} {:>12} {:>8} {:>8}",
        "matmul m×k×n",
        "GEMM s",
        "fast g. s",
        "ratio",
        "fast p. s",
        "ratio",
        "walk p. s",
        "ratio",
        "floor"
    );
    let (mut guaranteed, mut probabilistic) = (vec![], vec![]);
    for (m, k, n) in shapes() {
        let (a, b) = (bf16(m * k, 1), bf16(k * n, 2));
        let a32 = Array2::from_shape_vec((m, k), a.iter().map(|&x| x as f32).collect()).unwrap();
        let b32 = Array2::from_shape_vec((k, n), b.iter().map(|&x| x as f32).collect()).unwrap();
        let gemm = median(5, || a32.dot(&b32));
        // The floor: two executions (the two sides' orders) with their spacings, on shapes
        // padded to the tile.
        let (mp, np) = (m.div_ceil(FR) * FR, n.div_ceil(FC) * FC);
        let mut fa = vec![0.0f32; mp * k];
        fa[..m * k].copy_from_slice(a32.as_slice().unwrap());
        let mut fb = vec![0.0f32; k * np];
        for p in 0..k {
            fb[p * np..p * np + n].copy_from_slice(&b32.as_slice().unwrap()[p * n..(p + 1) * n]);
        }
        let floor = 2.0 * median(5, || floor_kernel(&fa, &fb, mp, k, np));
        let ta = Tensor::from_vec(&[m, k], a, Format::BF16).unwrap();
        let tb = Tensor::from_vec(&[k, n], b, Format::BF16).unwrap();
        let runs = if m * k * n >= 1 << 30 { 1 } else { 3 };
        let price = |conf, pricing| {
            pool.install(|| {
                median(runs, || {
                    matmul_threshold_priced(&ta, &tb, None, &r, &c, conf, pricing).unwrap()
                })
            })
        };
        let g = price(Confidence::Guaranteed, Pricing::Fast);
        let p = price(Confidence::default_probabilistic(), Pricing::Fast);
        // The walk only where it takes seconds, not hours.
        let walk = (m * k * n <= 1 << 22)
            .then(|| price(Confidence::default_probabilistic(), Pricing::Walk));
        let (ws, wr) = walk.map_or(("-".to_string(), "-".to_string()), |w| {
            (format!("{w:.3e}"), format!("{:.0}", w / gemm))
        });
        println!(
            "{:<16} {gemm:>10.3e} {g:>12.3e} {:>8.1} {p:>12.3e} {:>8.1} {ws:>12} {wr:>8} {:>8.1}",
            format!("{m}x{k}x{n}"),
            g / gemm,
            p / gemm,
            floor / gemm
        );
        guaranteed.push(g / gemm);
        probabilistic.push(p / gemm);
    }
    (guaranteed, probabilistic)
}

fn row_ops(pool: &rayon::ThreadPool) {
    let (rows, k) = (64, 1024);
    let x = bf16(rows * k, 3);
    let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let t = Tensor::from_vec(&[rows, k], x, Format::BF16).unwrap();
    let r = Policy::new(Format::BF16, Format::F32, Format::F32);
    let c = r.clone().with_order(Order::Pairwise { base: 8 });
    let conf = Confidence::default_probabilistic();
    let w = Tensor::from_vec(&[k], vec![1.0; k], Format::BF16).unwrap();
    let beta = Tensor::zeros(&[k], Format::BF16);
    // Native f32 loops: the op itself.
    let softmax_op = || {
        xf.chunks(k)
            .flat_map(|r| {
                let m = r.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let e: Vec<f32> = r.iter().map(|v| (v - m).exp()).collect();
                let s: f32 = e.iter().sum();
                e.into_iter().map(move |v| v / s)
            })
            .collect::<Vec<_>>()
    };
    let norm_op = || {
        xf.chunks(k)
            .flat_map(|r| {
                let mu = r.iter().sum::<f32>() / k as f32;
                let var = r.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / k as f32;
                let rs = 1.0 / (var + 1e-5).sqrt();
                r.iter().map(move |v| (v - mu) * rs)
            })
            .collect::<Vec<_>>()
    };
    let price_sum = |pricing| sum_threshold_priced(&t, &r, &c, false, conf, pricing).unwrap();
    let price_softmax = || {
        softmax_threshold(
            &t,
            &r,
            AttentionImpl::Standard,
            &c,
            AttentionImpl::Standard,
            conf,
        )
        .unwrap()
    };
    let price_norm = |pricing| {
        let data = NormData {
            x: &t,
            weight: &w,
            bias: Some(&beta),
            eps: 1e-5,
        };
        let side = |policy| NormSide {
            op: NormOp::LayerNorm(Variance::TwoPass),
            policy,
        };
        norm_threshold_priced(&data, side(&r), side(&c), conf, pricing).unwrap()
    };
    println!(
        "\n{:<24} {:>12} {:>14} {:>10}",
        format!("rows {rows}×{k}"),
        "op s",
        "threshold s",
        "ratio"
    );
    // Each threshold timed right after its op, pair by pair, so that both see the same state
    // of a shared machine (its speed drifts by ±20 % over seconds): the medians of each and
    // the median of the pairs' ratios.
    // Both run on the pool's thread (one `install` for the whole series: handing each call
    // to the pool would add its wake-up to every threshold).
    let report = |name: &str, runs: usize, op: &(dyn Fn() + Sync), th: &(dyn Fn() + Sync)| {
        pool.install(|| series(name, runs, op, th))
    };
    let sum_op = || {
        black_box(row_sums(&xf, k));
    };
    report("sum (walk)", 5, &sum_op, &|| {
        black_box(price_sum(Pricing::Walk));
    });
    report("sum (fast)", 51, &sum_op, &|| {
        black_box(price_sum(Pricing::Fast));
    });
    // The same rows' values in FP16 and FP32 (their sums are exact less often: FP32 never).
    for f in [Format::F16, Format::F32] {
        let v = rounded(f, rows * k, 3);
        let vf: Vec<f32> = v.iter().map(|&v| v as f32).collect();
        let tf = Tensor::from_vec(&[rows, k], v, f).unwrap();
        let (rf, cf) = (
            Policy::new(f, Format::F32, Format::F32),
            Policy::new(f, Format::F32, Format::F32).with_order(Order::Pairwise { base: 8 }),
        );
        let op = || {
            black_box(row_sums(&vf, k));
        };
        report(&format!("sum (fast), {f}"), 51, &op, &|| {
            black_box(sum_threshold_priced(&tf, &rf, &cf, false, conf, Pricing::Fast).unwrap());
        });
    }
    // A guaranteed sum threshold: Σ|x|·w per row (two GEMMs, here matrix-vector products).
    report("sum, guaranteed", 51, &sum_op, &|| {
        black_box(
            sum_threshold_priced(&t, &r, &c, false, Confidence::Guaranteed, Pricing::Auto).unwrap(),
        );
    });
    report("sum floor", 51, &sum_op, &|| {
        black_box(sum_floor(black_box(&xf), rows, k));
    });
    report(
        "softmax",
        11,
        &|| {
            black_box(softmax_op());
        },
        &|| {
            black_box(price_softmax());
        },
    );
    for (name, pricing) in [
        ("layernorm (walk)", Pricing::Walk),
        ("layernorm (fast)", Pricing::Fast),
    ] {
        report(
            name,
            11,
            &|| {
                black_box(norm_op());
            },
            &|| {
                black_box(price_norm(pricing));
            },
        );
    }
}

fn main() {
    // `cargo bench` passes --bench; this target takes no other arguments.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let (guaranteed, probabilistic) = matmuls(&pool);
    for (name, mut ratios) in [("guaranteed", guaranteed), ("probabilistic", probabilistic)] {
        ratios.sort_by(f64::total_cmp);
        if let (Some(mid), Some(worst)) = (ratios.get(ratios.len() / 2), ratios.last()) {
            println!(
                "matmul {name} threshold ÷ GEMM: median {mid:.1}×, worst {worst:.1}× \
                 (target 5×, 10×)"
            );
        }
    }
    row_ops(&pool);
}

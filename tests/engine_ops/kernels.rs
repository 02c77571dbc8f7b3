//! The native kernels against the generic path: the same bits for every policy they take, any thread count, midpoints broken by the exact error.

use super::*;

/// The native f32 kernel and the generic per-element path give identical bits on a matmul big
/// enough to use the kernel, including values at the edge of the product range.
#[test]
fn native_kernel_matches_generic_path() {
    let (m, k, n) = (9, 70, 37); // 4×16 tiles, 1×16 tiles for row 8, 1×1 tiles for columns 32..37
    let mut a: Vec<f64> = seeded(m * k, 11, 2.0).into_iter().map(bf16).collect();
    let b: Vec<f64> = seeded(k * n, 12, 2.0).into_iter().map(bf16).collect();
    a[3] = 2f64.powi(61);
    a[4] = -2f64.powi(-61);
    for order in [
        Order::Sequential,
        Order::Blocked {
            block: 16,
            inner: BlockSum::Sequential,
        },
    ] {
        for products in [Products::Exact, Products::Rounded(Format::F32)] {
            let fast = Policy::new(Format::BF16, Format::F32, Format::F32)
                .with_order(order.clone())
                .with_products(products);
            // Saturating overflow disables the native kernel; nothing overflows here.
            let mut slow = fast.clone();
            slow.accumulation.overflow = Overflow::Saturating;
            let ta = t(&[m, k], a.clone(), Format::BF16);
            let tb = t(&[k, n], b.clone(), Format::BF16);
            let c1 = matmul(&ta, &tb, &fast).unwrap();
            let c2 = matmul(&ta, &tb, &slow).unwrap();
            assert_eq!(c1.values(), c2.values(), "{order:?} {products:?}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// The native kernel (packed operands, 6×16 register tiles, FMA for exact products, AVX2
    /// when available) gives the generic per-element path's bits for every shape, order and
    /// product mode, including signed zeros (zero operands) and FP32 inputs with rounded
    /// products; reductions up to 700 long cross the kernel's 256-step chunks inside and at
    /// the ends of blocks.
    #[test]
    fn native_kernel_is_the_generic_path(
        (m, k, n) in prop_oneof![
            (1usize..20, 1usize..80, 1usize..40),
            (1usize..14, 200usize..700, 1usize..34),
        ],
        seed in any::<u64>(),
        block in prop_oneof![1usize..40, 200usize..400],
        blocked in any::<bool>(), exact in any::<bool>(), f32_in in any::<bool>(),
        zeros in 0usize..5)
    {
        let input = if f32_in { Format::F32 } else { Format::BF16 };
        let mut a = seeded(m * k, seed, 2.0);
        let b = seeded(k * n, seed ^ 1, 2.0);
        let len = a.len();
        for i in 0..zeros.min(len) {
            a[(i * 7) % len] = if i % 2 == 0 { 0.0 } else { -0.0 };
        }
        let order = if blocked {
            Order::Blocked { block, inner: BlockSum::Sequential }
        } else {
            Order::Sequential
        };
        let products = if exact { Products::Exact } else { Products::Rounded(Format::F32) };
        let fast = Policy::new(input, Format::F32, Format::F32)
            .with_order(order)
            .with_products(products);
        let mut slow = fast.clone();
        slow.accumulation.overflow = Overflow::Saturating;
        let ta = t(&[m, k], a, input);
        let tb = t(&[k, n], b, input);
        let c1 = matmul(&ta, &tb, &fast).unwrap();
        let c2 = matmul(&ta, &tb, &slow).unwrap();
        let same = c1.values().iter().zip(c2.values()).all(|(x, y)| x.to_bits() == y.to_bits());
        prop_assert!(same, "{m}x{k}x{n} {:?} {:?} {input}", fast.accumulation.order, products);
    }
}

/// A product large enough for the kernel to split rows over threads gives the same bits with
/// 1, 2 and 3 threads.
#[test]
fn parallel_kernel_does_not_depend_on_the_thread_count() {
    let (m, k, n) = (101, 300, 150); // 4.5M multiply-adds: split into bands of 48 rows
    let a = t(&[m, k], seeded(m * k, 21, 2.0), Format::BF16);
    let b = t(&[k, n], seeded(k * n, 22, 2.0), Format::BF16);
    // FP32 accumulation (the packed kernel), BF16 and FP16 accumulators (the f32-lane kernel).
    for acc in [Format::F32, Format::BF16, Format::F16] {
        let p = Policy::new(Format::BF16, acc, acc);
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| matmul(&a, &b, &p).unwrap())
        };
        let one = run(1);
        for threads in [2, 3] {
            let c = run(threads);
            assert!(
                one.values()
                    .iter()
                    .zip(c.values())
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{acc} accumulator, {threads} threads"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// The column-vectorized kernels for generic accumulators (every addition rounded to
    /// BF16, FP16, TF32, FP8 or FP32, exact products, sequential order) — the f32-lane one
    /// (BF16, TF32, FP16 accumulators, inputs of at most 12 bits) and the exact-error one
    /// behind it — give, element for element, the bits of the plain emulated dot product,
    /// including double-rounding midpoints, signed zeros, and blocks that overflow or go
    /// subnormal and fall back.
    #[test]
    fn lanes_kernel_is_the_generic_path(
        m in 1usize..20, k in 1usize..60, n in 1usize..40, seed in any::<u64>(),
        acc_pick in 0usize..6, in_pick in 0usize..3,
        scale_pow in prop_oneof![-12i32..12, -66i32..-56, 55i32..64],
        sat in any::<bool>(), zeros in 0usize..4, integers in any::<bool>())
    {
        let accs = [Format::BF16, Format::F16, Format::TF32, Format::E4M3, Format::E5M2, Format::F32];
        let accf = accs[acc_pick];
        let input = [Format::F32, Format::BF16, Format::F16][in_pick];
        let scale = 2f64.powi(scale_pow);
        // Small integers make exact midpoints of the accumulator frequent (sums like 257 in
        // BF16); tiny and huge scales reach subnormal and overflowing sums.
        let gen = |len: usize, seed: u64| -> Vec<f64> {
            let v = seeded(len, seed, 1.0);
            if integers {
                v.iter().map(|x| (x * 24.0).round()).collect()
            } else {
                v.iter().map(|x| x * scale).collect()
            }
        };
        let mut a = gen(m * k, seed);
        let len = a.len();
        for i in 0..zeros.min(len) {
            a[(i * 5) % len] = if i % 2 == 0 { 0.0 } else { -0.0 };
        }
        let b = gen(k * n, seed ^ 7);
        let mut p = Policy::new(input, accf, accf);
        p.accumulation.overflow = if sat { Overflow::Saturating } else { Overflow::NonSaturating };
        let ta = t(&[m, k], a, input);
        let tb = t(&[k, n], b, input);
        let c = matmul(&ta, &tb, &p).unwrap();
        for i in 0..m {
            for j in 0..n {
                let col: Vec<f64> = (0..k).map(|kk| tb.values()[kk * n + j]).collect();
                let want = ttrace::dot(&ta.values()[i * k..(i + 1) * k], &col, &p.accumulation).unwrap();
                let want = accf.round(want, p.accumulation.overflow);
                let got = c.values()[i * n + j];
                prop_assert!(want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()),
                    "{accf} {input} ({i},{j}): dot {want:e} vs matmul {got:e}");
            }
        }
    }
}

/// The one case double rounding would get wrong: a running sum far below a product that is
/// exactly a BF16 midpoint ((1 + 2^-4)² = 1.00100001₂), whose f64 sum rounds back onto the
/// midpoint; the exact error must break the tie (upward for a positive tiny sum, downward for a
/// negative one), in the vectorized kernel (8 columns) as in the plain dot product.
#[test]
fn lanes_kernel_breaks_midpoints_by_the_exact_error() {
    let q = 1.0 + 2f64.powi(-4);
    for tiny in [2f64.powi(-30), -(2f64.powi(-30))] {
        let a = t(&[1, 2], vec![tiny, q], Format::BF16);
        let b = t(
            &[2, 8],
            [vec![2f64.powi(-30); 8], vec![q; 8]].concat(),
            Format::BF16,
        );
        let p = Policy::new(Format::BF16, Format::BF16, Format::BF16);
        let c = matmul(&a, &b, &p).unwrap();
        // q² = 1 + 2^-3 + 2^-8 is the midpoint of 1 + 2^-3 and 1 + 2^-3 + 2^-7; ± 2^-60 decides.
        let want = if tiny > 0.0 {
            1.0 + 2f64.powi(-3) + 2f64.powi(-7)
        } else {
            1.0 + 2f64.powi(-3)
        };
        for &v in c.values() {
            assert_eq!(v, want, "tiny = {tiny:e}");
        }
        let col = vec![2f64.powi(-30), q];
        let d = ttrace::dot(a.values(), &col, &p.accumulation).unwrap();
        assert_eq!(d, want);
    }
}

/// Double rounding in FP16's subnormal range, where the f32-lane kernel's midpoint test (at
/// FP16's normal rounding bit) does not see the midpoint: s = 513·2^-24 (subnormal, odd) plus
/// p = 1025·2^-23 · 1023·2^-22 = 2^-25 − 2^-45. fl32(s + p) = s + 2^-25 is a midpoint whose
/// even neighbour is above, but the exact sum lies below it: the answer is s.
#[test]
fn fp16_subnormal_midpoints_are_not_double_rounded() {
    let s = 513.0 * 2f64.powi(-24);
    let (u, v) = (1025.0 * 2f64.powi(-23), 1023.0 * 2f64.powi(-22));
    let a = t(&[1, 2], vec![513.0 * 2f64.powi(-12), u], Format::F16);
    let b = t(
        &[2, 8],
        [vec![2f64.powi(-12); 8], vec![v; 8]].concat(),
        Format::F16,
    );
    let p = Policy::new(Format::F16, Format::F16, Format::F16);
    let c = matmul(&a, &b, &p).unwrap();
    for &x in c.values() {
        assert_eq!(x, s);
    }
    let d = ttrace::dot(a.values(), &[2f64.powi(-12), v], &p.accumulation).unwrap();
    assert_eq!(d, s);
}

/// The FP16-accumulator midpoint in the normal range: s = ±2^-24 (FP16's smallest subnormal)
/// then p = (1 + 2^-5)(1 + 2^-6) = 1 + 2^-5 + 2^-6 + 2^-11, an FP16 midpoint; fl32(s + p) = p
/// (an f32 tie, to even), so only the exact error knows the sum is above (s > 0) or below
/// (s < 0) the midpoint.
#[test]
fn fp16_midpoints_are_broken_by_the_exact_error() {
    let (q1, q2) = (1.0 + 2f64.powi(-5), 1.0 + 2f64.powi(-6));
    let base = 1.0 + 2f64.powi(-5) + 2f64.powi(-6);
    for sign in [1.0, -1.0] {
        let a = t(&[1, 2], vec![sign * 2f64.powi(-12), q1], Format::BF16);
        let b = t(
            &[2, 8],
            [vec![2f64.powi(-12); 8], vec![q2; 8]].concat(),
            Format::BF16,
        );
        let p = Policy::new(Format::BF16, Format::F16, Format::F16);
        let want = if sign > 0.0 {
            base + 2f64.powi(-10)
        } else {
            base
        };
        let c = matmul(&a, &b, &p).unwrap();
        for &x in c.values() {
            assert_eq!(x, want, "sign {sign}");
        }
        let d = ttrace::dot(a.values(), &[2f64.powi(-12), q2], &p.accumulation).unwrap();
        assert_eq!(d, want);
    }
}

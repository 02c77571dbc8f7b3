//! Bounds validated against the engine: guaranteed bounds never violated; probabilistic
//! thresholds violated no more often than δ allows; identical arithmetic priced at zero.

#[path = "../common/mod.rs"]
mod common;

use common::frob;
use proptest::prelude::*;
use statrs::distribution::{Binomial, DiscreteCDF};
use ttrace::bounds::baselines_for;
use ttrace::bounds::{
    matmul_threshold, reduction_error, sum_threshold, Confidence, NormData, NormSide,
};
use ttrace::engine::{matmul, SplitMix64};
use ttrace::{exact_sum, sum, Accumulation, BlockSum, Combine, Format, Order, Overflow, Products};
use ttrace::{Policy, Scaling, Tensor};

mod attention;
mod ops;
mod pricing;

/// Input distributions: Gaussian, uniform, all-positive, heavy-tailed, and offset data whose
/// dot products cancel.
fn data(n: usize, seed: u64, kind: u8, format: Format) -> Vec<f64> {
    let mut g = SplitMix64::for_name("bounds-test", seed);
    (0..n)
        .map(|i| {
            let v = match kind {
                0 => g.normal(),
                1 => 2.0 * g.uniform() - 1.0,
                2 => g.uniform(),
                3 => g.normal() / g.uniform().max(1e-6).sqrt(),
                _ => (if i % 2 == 0 { 100.0 } else { -100.0 }) + g.normal(),
            };
            format.round(v, Overflow::Saturating)
        })
        .collect()
}

fn orders() -> Vec<Order> {
    vec![
        Order::Sequential,
        Order::Pairwise { base: 8 },
        Order::Blocked {
            block: 16,
            inner: BlockSum::Sequential,
        },
        Order::Blocked {
            block: 32,
            inner: BlockSum::Fused,
        },
        Order::SplitK {
            parts: 4,
            inner: Box::new(Order::Sequential),
            partial: Format::BF16,
            combine: Combine::Ring { start: 1 },
        },
        Order::SplitK {
            parts: 8,
            inner: Box::new(Order::Pairwise { base: 4 }),
            partial: Format::F32,
            combine: Combine::Tree,
        },
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// The guaranteed threshold holds for every element and for the tensor, for every pair of
    /// orders, formats and input distribution.
    #[test]
    fn guaranteed_matmul_thresholds_hold(
        k in 1usize..300, ri in 0usize..6, ci in 0usize..6, kind in 0u8..5, seed in 0u64..10_000,
        out_bf16 in any::<bool>(), acc_bf16 in any::<bool>(), rounded in any::<bool>()
    ) {
        let (m, n) = (3, 3);
        let out = if out_bf16 { Format::BF16 } else { Format::F32 };
        let acc = if acc_bf16 && k < 32 { Format::BF16 } else { Format::F32 };
        let products = if rounded { Products::Rounded(Format::F32) } else { Products::Exact };
        let reference = Policy::new(Format::BF16, acc, out).with_order(orders()[ri].clone()).with_products(products);
        let candidate = Policy::new(Format::BF16, Format::F32, out).with_order(orders()[ci].clone());
        let a = Tensor::from_vec(&[m, k], data(m * k, seed, kind, Format::BF16), Format::BF16).unwrap();
        let b = Tensor::from_vec(&[k, n], data(k * n, seed + 1, kind, Format::BF16), Format::BF16).unwrap();
        let r = matmul(&a, &b, &reference).unwrap();
        let c = matmul(&a, &b, &candidate).unwrap();
        let th = matmul_threshold(&a, &b, None, &reference, &candidate, Confidence::Guaranteed).unwrap();
        let max_diff = r.values().iter().zip(c.values()).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        prop_assert!(max_diff <= th.per_element, "max |D| {:e} > {:e}", max_diff, th.per_element);
        prop_assert!(frob(r.values(), c.values()) <= th.abs_frobenius);
    }

    /// Sums under every order: the introduced error against the exact sum is within the
    /// guaranteed bound of `reduction_error`, for all input distributions.
    #[test]
    fn guaranteed_sum_error_holds(n in 1usize..500, oi in 0usize..6, kind in 0u8..5, seed in 0u64..10_000) {
        let xs = data(n, seed, kind, Format::BF16);
        let acc = Accumulation::new(Format::BF16, Format::F32, orders()[oi].clone());
        let e = reduction_error(&xs, &acc, false).unwrap();
        let err = (sum(&xs, &acc).unwrap() - exact_sum(&xs)).abs();
        prop_assert!(err <= e.guaranteed, "{:e} > {:e}", err, e.guaranteed);
    }
}

/// Probabilistic thresholds at δ = 1e-6: no violation over many trials of every pair of
/// orders, output format and data distribution; at δ = 0.2 the number of violations is not
/// significantly above δ·trials (binomial tail, p-value > 1e-6).
#[test]
fn probabilistic_thresholds_hold_at_their_delta() {
    let mut trials = 0u64;
    let mut viol_strict = 0u64;
    let mut viol_loose = 0u64;
    let reference_orders = [Order::Sequential, Order::Pairwise { base: 8 }];
    for (case, cand_order) in orders().into_iter().enumerate() {
        for ref_order in &reference_orders {
            if *ref_order == cand_order {
                continue;
            }
            for out in [Format::BF16, Format::F32] {
                for kind in 0..5u8 {
                    for t in 0..12u64 {
                        let k = [64, 256, 1024][(t % 3) as usize];
                        let (m, n) = (4, 4);
                        let seed = 1000 * case as u64 + 100 * kind as u64 + t;
                        let a = Tensor::from_vec(
                            &[m, k],
                            data(m * k, seed, kind, Format::BF16),
                            Format::BF16,
                        )
                        .unwrap();
                        let b = Tensor::from_vec(
                            &[k, n],
                            data(k * n, seed + 7, kind, Format::BF16),
                            Format::BF16,
                        )
                        .unwrap();
                        let rp = Policy::new(Format::BF16, Format::F32, out)
                            .with_order(ref_order.clone());
                        let cp = Policy::new(Format::BF16, Format::F32, out)
                            .with_order(cand_order.clone());
                        let d = frob(
                            matmul(&a, &b, &rp).unwrap().values(),
                            matmul(&a, &b, &cp).unwrap().values(),
                        );
                        let strict = matmul_threshold(
                            &a,
                            &b,
                            None,
                            &rp,
                            &cp,
                            Confidence::Probabilistic { delta: 1e-6 },
                        )
                        .unwrap();
                        let loose = matmul_threshold(
                            &a,
                            &b,
                            None,
                            &rp,
                            &cp,
                            Confidence::Probabilistic { delta: 0.2 },
                        )
                        .unwrap();
                        trials += 1;
                        viol_strict += u64::from(d > strict.abs_frobenius);
                        viol_loose += u64::from(d > loose.abs_frobenius);
                    }
                }
            }
        }
    }
    eprintln!("{trials} trials: {viol_strict} violations at δ = 1e-6, {viol_loose} at δ = 0.2");
    assert_eq!(
        viol_strict, 0,
        "violations at δ = 1e-6 over {trials} trials"
    );
    // P(Binomial(trials, 0.2) ≥ observed) must not be tiny.
    let binom = Binomial::new(0.2, trials).unwrap();
    let p_value = if viol_loose == 0 {
        1.0
    } else {
        binom.sf(viol_loose - 1)
    };
    assert!(
        p_value > 1e-6,
        "{viol_loose} violations at δ = 0.2 over {trials} trials (p = {p_value:e})"
    );
}

/// FP8 with per-tensor current scaling on both sides: the quantized operands are identical,
/// only the accumulation order differs; and FP8 versus BF16 inputs: a deterministic offset the
/// threshold must include.
#[test]
fn fp8_thresholds_hold() {
    for t in 0..60u64 {
        let k = 256;
        let a = Tensor::from_vec(
            &[4, k],
            data(4 * k, t, (t % 5) as u8, Format::BF16),
            Format::BF16,
        )
        .unwrap();
        let b = Tensor::from_vec(
            &[k, 4],
            data(k * 4, t + 9, (t % 5) as u8, Format::BF16),
            Format::BF16,
        )
        .unwrap();
        let fp8 = Policy::new(Format::E4M3, Format::F32, Format::BF16)
            .with_scaling(Scaling::PerTensorCurrent { margin: 0 });
        let fp8_tp = fp8.clone().with_order(Order::SplitK {
            parts: 4,
            inner: Box::new(Order::Sequential),
            partial: Format::BF16,
            combine: Combine::Tree,
        });
        let bf16 = Policy::new(Format::BF16, Format::F32, Format::BF16);
        for (rp, cp) in [(&fp8, &fp8_tp), (&bf16, &fp8)] {
            let d = frob(
                matmul(&a, &b, rp).unwrap().values(),
                matmul(&a, &b, cp).unwrap().values(),
            );
            let p = matmul_threshold(&a, &b, None, rp, cp, Confidence::default_probabilistic())
                .unwrap();
            let g = matmul_threshold(&a, &b, None, rp, cp, Confidence::Guaranteed).unwrap();
            assert!(
                d <= p.abs_frobenius,
                "trial {t}: {d:e} > {:e}",
                p.abs_frobenius
            );
            assert!(d <= g.abs_frobenius);
            assert!(p.abs_frobenius <= g.abs_frobenius);
        }
    }
}

#[test]
fn identical_arithmetic_is_priced_at_zero() {
    let a = Tensor::from_vec(&[3, 50], data(150, 1, 0, Format::BF16), Format::BF16).unwrap();
    let b = Tensor::from_vec(&[50, 2], data(100, 2, 0, Format::BF16), Format::BF16).unwrap();
    let p = Policy::new(Format::BF16, Format::F32, Format::BF16)
        .with_order(Order::Pairwise { base: 4 });
    let th = matmul_threshold(&a, &b, None, &p, &p, Confidence::default_probabilistic()).unwrap();
    assert!(th.identical);
    assert_eq!(th.abs_frobenius, 0.0);
    assert_eq!(matmul(&a, &b, &p).unwrap(), matmul(&a, &b, &p).unwrap());
}

#[test]
fn sum_and_mean_thresholds_hold() {
    for t in 0..100u64 {
        let n = [10, 100, 1000][(t % 3) as usize];
        let x = Tensor::from_vec(
            &[6, n],
            data(6 * n, t, (t % 5) as u8, Format::BF16),
            Format::BF16,
        )
        .unwrap();
        let rp = Policy::new(Format::BF16, Format::F32, Format::BF16);
        let cp = rp.clone().with_order(Order::SplitK {
            parts: 4,
            inner: Box::new(Order::Sequential),
            partial: Format::BF16,
            combine: Combine::Ring { start: 3 },
        });
        for mean in [false, true] {
            let th =
                sum_threshold(&x, &rp, &cp, mean, Confidence::default_probabilistic()).unwrap();
            let g = sum_threshold(&x, &rp, &cp, mean, Confidence::Guaranteed).unwrap();
            let run = |p: &Policy| -> Vec<f64> {
                x.values()
                    .chunks(n)
                    .map(|row| {
                        let s = sum(row, &p.accumulation).unwrap();
                        let s = if mean {
                            Format::F32.round(s / n as f64, Overflow::NonSaturating)
                        } else {
                            s
                        };
                        Format::BF16.round(s, Overflow::NonSaturating)
                    })
                    .collect()
            };
            let d = frob(&run(&rp), &run(&cp));
            assert!(
                d <= th.abs_frobenius,
                "trial {t} mean={mean}: {d:e} > {:e}",
                th.abs_frobenius
            );
            assert!(d <= g.abs_frobenius);
        }
    }
}

#[test]
fn bad_requests_are_errors() {
    assert!(matches!(
        Confidence::probabilistic(0.0),
        Err(ttrace::Error::InvalidParameter { .. })
    ));
    assert!(matches!(
        Confidence::probabilistic(1.0),
        Err(ttrace::Error::InvalidParameter { .. })
    ));
    assert!(matches!(
        Confidence::probabilistic(f64::NAN),
        Err(ttrace::Error::InvalidParameter { .. })
    ));
    let a = Tensor::zeros(&[2, 3], Format::BF16);
    let b = Tensor::zeros(&[4, 2], Format::BF16);
    let p = Policy::new(Format::BF16, Format::F32, Format::BF16);
    assert!(matches!(
        matmul_threshold(&a, &b, None, &p, &p, Confidence::Guaranteed),
        Err(ttrace::Error::ShapeMismatch { .. })
    ));
    // Kahan's order is priced on its own, not nested inside a split-K part.
    let kahan = Accumulation::new(Format::F32, Format::F32, Order::Kahan);
    assert!(reduction_error(&[1.0, 2.0], &kahan, false).is_ok());
    let nested = Accumulation::new(
        Format::F32,
        Format::F32,
        Order::SplitK {
            parts: 2,
            inner: Box::new(Order::Kahan),
            partial: Format::F32,
            combine: Combine::Tree,
        },
    );
    assert!(matches!(
        reduction_error(&[1.0, 2.0], &nested, false),
        Err(ttrace::Error::InvalidParameter { name: "order", .. })
    ));
    assert!(!baselines_for(Format::BF16, 1).is_empty());
}

//! Thresholds priced by the vectorized pass (`bounds::fast`, papers/bounds-reductions.md
//! §5.1) where its products are exact because one operand is all ones: sums of FP32 values and
//! softmax denominators. Each must hold against the engine's two executions and be as tight as
//! the walk that the pass replaces (which determines the same roundings).

mod common;

use common::frob;
use ttrace::bounds::{softmax_threshold, sum_threshold_priced, Confidence, Pricing};
use ttrace::engine::{softmax, AttentionImpl, SplitMix64};
use ttrace::{sum, Format, Order, Overflow, Policy, Tensor};

fn gaussian(n: usize, seed: u64, scale: f64, format: Format) -> Vec<f64> {
    let mut g = SplitMix64::for_name("fast_pricing", seed);
    (0..n)
        .map(|_| format.round(g.normal() * scale, Overflow::Saturating))
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Softmax, standard form on both sides, sequential vs pairwise(8) sums of the numerators,
/// FP32 output (the difference is the denominators' difference itself). Most roundings of
/// these sums are determined by the data: the walk priced them at a median τ/d of 1.6
/// (K = 1,024) and 1.2 (K = 4,096), the pass counting them as random at 3.0 and 2.9.
#[test]
fn softmax_denominators_priced_by_the_pass_hold_and_are_tight() {
    let seq = Policy::new(Format::BF16, Format::F32, Format::F32);
    let pw = seq.clone().with_order(Order::Pairwise { base: 8 });
    let std = AttentionImpl::Standard;
    for n in [1024, 4096] {
        let mut ratios = vec![];
        for t in 0..12u64 {
            let x = gaussian(8 * n, t, [1.0, 3.0][(t % 2) as usize], Format::BF16);
            let x = Tensor::from_vec(&[8, n], x, Format::BF16).unwrap();
            let d = frob(
                softmax(&x, &seq).unwrap().values(),
                softmax(&x, &pw).unwrap().values(),
            );
            let p = softmax_threshold(&x, &seq, std, &pw, std, Confidence::default_probabilistic())
                .unwrap();
            let g = softmax_threshold(&x, &seq, std, &pw, std, Confidence::Guaranteed).unwrap();
            assert!(
                d <= p.abs_frobenius,
                "n {n} trial {t}: {d:e} > {:e}",
                p.abs_frobenius
            );
            assert!(
                d <= g.abs_frobenius,
                "n {n} trial {t}: {d:e} > {:e}",
                g.abs_frobenius
            );
            assert!(d > 0.0);
            ratios.push(p.abs_frobenius / d);
        }
        let m = median(ratios);
        eprintln!("softmax n = {n}: median threshold / difference {m:.1}");
        assert!(m < 2.2, "n {n}: median τ/d {m:.1}");
    }
}

/// Row sums of FP32 values, sequential vs pairwise(8): the pass determines the roundings of
/// terms added onto a running value on the result's grid as the walk does (the ones of the
/// sum make every product exact), so its threshold stays within a small factor of the walk's
/// (0.99–1.01× measured; 3.1× when the pass counted those roundings as random).
#[test]
fn fp32_sums_priced_by_the_pass_are_as_tight_as_the_walk() {
    let seq = Policy::new(Format::F32, Format::F32, Format::F32);
    let pw = seq.clone().with_order(Order::Pairwise { base: 8 });
    let acc = |p: &Policy| {
        let mut a = p.accumulation.clone();
        a.input = Format::F32;
        a
    };
    for (t, scale) in [(0u64, 1.0), (1, 1e-3), (2, 1e4)] {
        let k = 2048;
        let v = gaussian(16 * k, t + 100, scale, Format::F32);
        let x = Tensor::from_vec(&[16, k], v.clone(), Format::F32).unwrap();
        let d: f64 = v
            .chunks(k)
            .map(|r| (sum(r, &acc(&pw)).unwrap() - sum(r, &acc(&seq)).unwrap()).powi(2))
            .sum::<f64>()
            .sqrt();
        let conf = Confidence::default_probabilistic();
        let fast = sum_threshold_priced(&x, &seq, &pw, false, conf, Pricing::Fast).unwrap();
        let walk = sum_threshold_priced(&x, &seq, &pw, false, conf, Pricing::Walk).unwrap();
        assert!(d <= fast.abs_frobenius && d <= walk.abs_frobenius);
        let r = fast.abs_frobenius / walk.abs_frobenius;
        eprintln!(
            "scale {scale:e}: fast / walk {r:.3}, τ/d fast {:.2}",
            fast.abs_frobenius / d
        );
        assert!(r < 1.5, "scale {scale:e}: fast {r:.2}× the walk");
    }
}

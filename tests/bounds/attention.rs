//! Attention thresholds against the engine's attention (`engine::attention`: standard and
//! online forms, any order), on one head of Q, K, V drawn from the bound tests' families
//! scaled to soft and peaked softmax rows: the observed ‖O_c − O_r‖_F never exceeds the
//! probabilistic threshold (δ = 10⁻⁶) nor the guaranteed one; identical executions are priced
//! at zero; mismatched sides and shapes are refused with their variants.

use super::*;
use ttrace::bounds::{attention_threshold, OpSide};
use ttrace::engine::attention;

/// The engine's attention of one head: qkv [1, n, 3d] from q, k, v [n, d].
fn run(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, side: &OpSide) -> Tensor {
    let (n, d) = (q.shape()[0], q.shape()[1]);
    let mut qkv = Vec::with_capacity(n * 3 * d);
    for i in 0..n {
        for t in [q, k, v] {
            qkv.extend_from_slice(&t.values()[i * d..(i + 1) * d]);
        }
    }
    let qkv = Tensor::from_vec(&[1, n, 3 * d], qkv, q.format()).unwrap();
    attention(&qkv, 1, causal, side.form, &side.policy)
        .unwrap()
        .0
}

fn side(text: &str) -> OpSide {
    text.parse().unwrap()
}

#[test]
fn attention_thresholds_hold_against_the_engine() {
    let pairs = [
        ("", "order=pairwise:8"),
        ("", "form=online:16"),
        ("order=pairwise:4,form=online:8", "form=online:32"),
        ("form=online:64", "order=blocked:16,form=online:16"),
    ];
    let (mut trials, mut worst, mut worst_g) = (0, 0.0f64, 0.0f64);
    for t in 0..48u64 {
        let n = [16, 64, 160][(t % 3) as usize];
        let d = [16, 64][((t / 3) % 2) as usize];
        let kind = (t % 5) as u8;
        // Scores of about ±1, ±4 and ±12 times the family's spread: soft to peaked rows.
        let gain = [1.0, 2.0, 3.5][((t / 6) % 3) as usize];
        let (formats, out) = if t % 4 == 3 {
            ("in=f32,acc=f32", "f32")
        } else if t % 2 == 0 {
            ("in=bf16,acc=f32", "bf16")
        } else {
            ("in=bf16,acc=f32", "f32")
        };
        let input = if formats.contains("bf16") {
            Format::BF16
        } else {
            Format::F32
        };
        let tensor = |s: u64, g: f64| {
            let v = data(n * d, 3 * t + s, kind, input)
                .into_iter()
                .map(|x| {
                    input.round(
                        x * g / if kind == 4 { 100.0 } else { 1.0 },
                        Overflow::Saturating,
                    )
                })
                .collect();
            Tensor::from_vec(&[n, d], v, input).unwrap()
        };
        let (q, k, v) = (tensor(0, gain), tensor(1, gain), tensor(2, 1.0));
        let causal = t % 2 == 1;
        for (r, c) in pairs {
            let r = side(&format!("{formats},out={out},{r}"));
            let c = side(&format!("{formats},out={out},{c}"));
            let obs = frob(
                run(&q, &k, &v, causal, &r).values(),
                run(&q, &k, &v, causal, &c).values(),
            );
            let p = attention_threshold(
                &q,
                &k,
                &v,
                causal,
                &r,
                &c,
                Confidence::default_probabilistic(),
            )
            .unwrap();
            let g =
                attention_threshold(&q, &k, &v, causal, &r, &c, Confidence::Guaranteed).unwrap();
            assert!(
                obs <= p.abs_frobenius,
                "trial {t} n={n} d={d} kind={kind} gain={gain} {r} vs {c}: {obs:e} > {:e}",
                p.abs_frobenius
            );
            assert!(
                obs <= g.abs_frobenius,
                "guaranteed: {obs:e} > {:e}",
                g.abs_frobenius
            );
            assert!(p.abs_frobenius <= g.abs_frobenius * (1.0 + 1e-12));
            if p.abs_frobenius > 0.0 {
                worst = worst.max(obs / p.abs_frobenius);
                worst_g = worst_g.max(obs / g.abs_frobenius);
            }
            trials += 1;
        }
    }
    eprintln!(
        "attention: {trials} comparisons, largest observed / threshold = {worst:.3} \
         (guaranteed {worst_g:.3})"
    );
    // Tight enough to be useful: some comparison uses a tenth of its threshold.
    assert!(worst > 0.1, "{worst}");
}

#[test]
fn identical_attention_is_priced_at_zero_and_bad_sides_are_refused() {
    let x = |s: u64| Tensor::from_vec(&[8, 4], data(32, s, 0, Format::BF16), Format::BF16).unwrap();
    let (q, k, v) = (x(1), x(2), x(3));
    let s = side("in=bf16,acc=f32,out=bf16,form=online:4");
    let conf = Confidence::default_probabilistic();
    let t = attention_threshold(&q, &k, &v, true, &s, &s, conf).unwrap();
    assert!(t.identical && t.abs_frobenius == 0.0);
    let other = side("in=bf16,acc=f32,out=f32");
    assert!(matches!(
        attention_threshold(&q, &k, &v, false, &s, &other, conf),
        Err(ttrace::Error::InvalidParameter { .. })
    ));
    let wide = side("in=bf16,acc=f64,out=bf16");
    assert!(matches!(
        attention_threshold(&q, &k, &v, false, &wide, &wide.clone(), conf),
        Err(ttrace::Error::InvalidParameter { .. })
    ));
    let short = Tensor::from_vec(&[4, 4], data(16, 9, 0, Format::BF16), Format::BF16).unwrap();
    assert!(matches!(
        attention_threshold(&q, &short, &v, false, &s, &s, conf),
        Err(ttrace::Error::ShapeMismatch { .. })
    ));
    let mut bad = q.values().to_vec();
    bad[5] = f64::NAN;
    let bad = Tensor::from_vec(&[8, 4], bad, Format::F64).unwrap();
    assert!(matches!(
        attention_threshold(&bad, &k, &v, false, &s, &s, conf),
        Err(ttrace::Error::NonFinite { .. })
    ));
}

/// Narrow accumulators (found by a probe of policies the zoo does not hold): FP16 dot
/// products of 300 values near 30 reach 2.7·10⁵ before the scale multiplies them, and the
/// engine's scores are infinite — the threshold refuses with `Overflow` (it priced them finite,
/// checking only the scaled magnitudes with a 1 % margin); BF16 accumulation over 300 keys has
/// no Higham bound (n·u ≥ 1) — refused with `NoFiniteBound` (the bounds came out negative or
/// NaN and the per-element threshold 0 for differences of 0.2). Smaller products of the same
/// policies stay priced and hold against the engine.
#[test]
fn narrow_accumulators_refuse_what_they_cannot_bound() {
    let tensor = |n: usize, d: usize, seed: u64, mean: f64, f: Format| {
        let v = data(n * d, seed, 0, f)
            .into_iter()
            .map(|x| f.round(mean + x, Overflow::Saturating))
            .collect();
        Tensor::from_vec(&[n, d], v, f).unwrap()
    };
    let conf = Confidence::default_probabilistic();
    // FP16: the scores overflow in the engine.
    let (q, k, v) = (
        tensor(4, 300, 1, 30.0, Format::F16),
        tensor(4, 300, 2, 30.0, Format::F16),
        tensor(4, 300, 3, 0.0, Format::F16),
    );
    let r = side("in=f16,acc=f16,out=f16");
    let c = side("in=f16,acc=f16,out=f16,order=pairwise:8");
    assert!(run(&q, &k, &v, false, &r)
        .values()
        .iter()
        .any(|x| !x.is_finite()));
    for conf in [conf, Confidence::Guaranteed] {
        assert!(matches!(
            attention_threshold(&q, &k, &v, false, &r, &c, conf),
            Err(ttrace::Error::Overflow { .. })
        ));
    }
    // BF16 accumulation over 300 keys.
    let (q, k, v) = (
        tensor(300, 16, 4, 0.0, Format::BF16),
        tensor(300, 16, 5, 0.0, Format::BF16),
        tensor(300, 16, 6, 0.0, Format::BF16),
    );
    let r = side("in=bf16,acc=bf16,out=bf16");
    let c = side("in=bf16,acc=bf16,out=bf16,order=pairwise:8");
    for conf in [conf, Confidence::Guaranteed] {
        assert!(matches!(
            attention_threshold(&q, &k, &v, false, &r, &c, conf),
            Err(ttrace::Error::NoFiniteBound { .. })
        ));
    }
    // The same policies on 8 keys: priced, and holding.
    let (q, k, v) = (
        tensor(8, 16, 7, 0.0, Format::BF16),
        tensor(8, 16, 8, 0.0, Format::BF16),
        tensor(8, 16, 9, 0.0, Format::BF16),
    );
    let obs = frob(
        run(&q, &k, &v, false, &r).values(),
        run(&q, &k, &v, false, &c).values(),
    );
    let p = attention_threshold(&q, &k, &v, false, &r, &c, conf).unwrap();
    let g = attention_threshold(&q, &k, &v, false, &r, &c, Confidence::Guaranteed).unwrap();
    assert!(obs <= p.abs_frobenius && p.abs_frobenius <= g.abs_frobenius);
    assert!(g.per_element > 0.0 && g.per_element.is_finite());
}

/// Split-K partial results in a format that does not hold the accumulator's values (BF16
/// partials of an FP32 accumulator, the tensor-parallel all-reduce of a row-parallel layer;
/// FP16 partials of a BF16 accumulator) are refused: the model prices every rounding at the
/// accumulator's precision and range, and a probe found guaranteed bounds exceeded up to 100
/// times and infinite outputs priced finite. Partials in the accumulator's own format, and a
/// vendor kernel's family of orders, stay priced.
#[test]
fn partials_outside_the_accumulator_are_refused() {
    let x =
        |s: u64| Tensor::from_vec(&[16, 8], data(128, s, 0, Format::BF16), Format::BF16).unwrap();
    let (q, k, v) = (x(1), x(2), x(3));
    let conf = Confidence::default_probabilistic();
    for (r, c) in [
        (
            "in=bf16,acc=f32,out=bf16",
            "in=bf16,acc=f32,out=bf16,order=splitk:4:bf16:ring:1",
        ),
        (
            "in=bf16,acc=bf16,out=bf16,order=splitk:2:f16:seq",
            "in=bf16,acc=bf16,out=bf16",
        ),
    ] {
        let (r, c) = (side(r), side(c));
        assert!(
            matches!(
                attention_threshold(&q, &k, &v, true, &r, &c, conf),
                Err(ttrace::Error::InvalidParameter { .. })
            ),
            "{r} vs {c}"
        );
    }
    for c in [
        "in=bf16,acc=f32,out=bf16,order=splitk:4:f32:tree",
        "in=bf16,acc=f32,out=bf16,order=any",
    ] {
        let (r, c) = (side("in=bf16,acc=f32,out=bf16"), side(c));
        let obs = frob(
            run(&q, &k, &v, true, &r).values(),
            run(&q, &k, &v, true, &c).values(),
        );
        let p = attention_threshold(&q, &k, &v, true, &r, &c, conf).unwrap();
        assert!(obs <= p.abs_frobenius, "{c}");
    }
}

/// Scores of 10⁹ and more (BF16 queries and keys near 6·10⁴): the model priced the threshold
/// as ∞ — a threshold every difference passes — where the engine's outputs are finite (found
/// by a probe of every op on hostile data, 2026-12-08). No op returns a threshold that is not
/// finite: refused with `NoFiniteBound`, guaranteed and probabilistic, while ordinary scores
/// of the same shape are priced.
#[test]
fn huge_scores_are_refused_not_priced_infinite() {
    let (m, d) = (8, 17);
    let big = |seed: usize, scale: f64| {
        let v = (0..m * d)
            .map(|i| scale * (((i * 37 + seed) % 29) as f64 / 14.0 - 1.0))
            .collect();
        Tensor::rounded(&[m, d], v, Format::BF16, Overflow::Saturating).unwrap()
    };
    let v = big(5, 1.0);
    let r = side("in=bf16,acc=f32,out=f32,order=blocked:16");
    let c = side("in=bf16,acc=f32,out=f32,order=pairwise:8");
    for (scale, refused) in [(6e4, true), (1.0, false)] {
        let (q, k) = (big(1, scale), big(3, scale));
        let (yr, yc) = (run(&q, &k, &v, false, &r), run(&q, &k, &v, false, &c));
        assert!(yr.values().iter().chain(yc.values()).all(|x| x.is_finite()));
        for conf in [Confidence::Guaranteed, Confidence::default_probabilistic()] {
            match attention_threshold(&q, &k, &v, false, &r, &c, conf) {
                Err(ttrace::Error::NoFiniteBound { .. }) if refused => {}
                Ok(t) if !refused => {
                    assert!(t.abs_frobenius.is_finite());
                    assert!(t.check(&yr, &yc).passed);
                }
                other => panic!("scale {scale} {conf:?}: {other:?}"),
            }
        }
    }
}

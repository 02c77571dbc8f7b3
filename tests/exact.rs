//! The exact accumulator against big-integer arithmetic.

mod common;

use common::{exact, ldexp, spec, Dy};
use proptest::prelude::*;
use ttrace::{exact_dot, exact_sum, ExactAccumulator, Format, Overflow};

const NAMES: [&str; 7] = ["f64", "f32", "tf32", "f16", "bf16", "e4m3", "e5m2"];

/// f64 values spread over the whole exponent range, with exact cancellations likely.
fn wide_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        (any::<bool>(), 0u64..(1 << 52), -1074i32..1000).prop_map(|(neg, frac, e)| {
            let v = ldexp(1.0 + frac as f64 / (1u64 << 52) as f64, e.max(-1022));
            if neg {
                -v
            } else {
                v
            }
        }),
        (-1000i64..1000).prop_map(|k| k as f64),
        Just(0.0),
        Just(-0.0),
        Just(f64::MAX),
        Just(-f64::MAX),
        Just(f64::from_bits(1)),
    ]
}

fn same(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()) || (a == 0.0 && b == 0.0)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn sums_round_like_big_integers(xs in prop::collection::vec(wide_f64(), 0..40)) {
        let mut acc = ExactAccumulator::new();
        acc.add_all(&xs);
        let oracle = exact(&xs);
        for name in NAMES {
            let f: Format = name.parse().unwrap();
            for sat in [false, true] {
                let ov = if sat { Overflow::Saturating } else { Overflow::NonSaturating };
                let ours = acc.round(f, ov);
                let theirs = oracle.round(spec(name), sat);
                prop_assert!(same(ours, theirs), "{} sat={}: {:e} vs {:e}", name, sat, ours, theirs);
            }
        }
    }

    #[test]
    fn sums_with_cancellation(xs in prop::collection::vec(wide_f64(), 1..30), tiny in wide_f64()) {
        // x_1 + ... + x_n + tiny - x_n - ... - x_1 = tiny exactly.
        let mut all = xs.clone();
        all.push(tiny);
        all.extend(xs.iter().rev().map(|x| -x));
        prop_assert!(same(exact_sum(&all), tiny));
    }

    #[test]
    fn dots_round_like_big_integers(
        pairs in prop::collection::vec((wide_f64(), wide_f64()), 0..30)
    ) {
        let (x, y): (Vec<f64>, Vec<f64>) = pairs.into_iter().unzip();
        let oracle = x.iter().zip(&y).fold(Dy::zero(), |acc, (&a, &b)| {
            acc.add(&Dy::from_f64(a).mul(&Dy::from_f64(b)))
        });
        let mut acc = ExactAccumulator::new();
        for (&a, &b) in x.iter().zip(&y) {
            acc.add_product(a, b);
        }
        for name in NAMES {
            let f: Format = name.parse().unwrap();
            prop_assert!(same(acc.round(f, Overflow::NonSaturating), oracle.round(spec(name), false)), "{}", name);
        }
        prop_assert!(same(exact_dot(&x, &y).unwrap(), oracle.round(spec("f64"), false)));
    }
}

#[test]
fn specials_follow_ieee() {
    let mut a = ExactAccumulator::new();
    assert_eq!(a.to_f64().to_bits(), 0.0f64.to_bits(), "empty sum is +0");
    a.add(-0.0);
    a.add(-0.0);
    assert!(
        a.to_f64() == 0.0 && a.to_f64().is_sign_negative(),
        "-0 + -0 = -0"
    );
    a.add(0.0);
    assert!(a.to_f64().is_sign_positive(), "-0 + +0 = +0");
    a.add(f64::INFINITY);
    assert_eq!(a.to_f64(), f64::INFINITY);
    assert!(a.round(Format::E4M3, Overflow::NonSaturating).is_nan());
    assert_eq!(a.round(Format::E4M3, Overflow::Saturating), 448.0);
    a.add(f64::NEG_INFINITY);
    assert!(a.to_f64().is_nan(), "inf - inf = NaN");
    let mut b = ExactAccumulator::new();
    b.add_product(f64::INFINITY, 0.0);
    assert!(b.to_f64().is_nan(), "inf * 0 = NaN");
    let mut c = ExactAccumulator::new();
    c.add(f64::MAX);
    c.add(f64::MAX);
    assert_eq!(c.to_f64(), f64::INFINITY, "overflow of the rounded result");
    c.add(-f64::MAX);
    assert_eq!(c.to_f64(), f64::MAX, "but not of the exact sum");
    assert!(matches!(
        exact_dot(&[1.0], &[1.0, 2.0]),
        Err(ttrace::Error::LengthMismatch { .. })
    ));
}

#[test]
fn clear_resets_to_zero() {
    let mut a = ExactAccumulator::new();
    a.add(-3.5);
    a.add_product(1e300, 1e300);
    a.clear();
    assert!(a.is_empty());
    a.add(2.0);
    assert_eq!(a.to_f64(), 2.0);
}

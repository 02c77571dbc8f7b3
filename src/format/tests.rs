//! The formats' tests: largest finite values, u against ε, names, vacuous γ, exponents of
//! subnormals.
#![cfg(test)]

use super::*;

#[test]
fn max_finite_matches_the_formula() {
    for f in Format::ALL {
        let p = f.precision() as i32;
        let expected = if f == Format::E4M3 {
            // S.1111.110: (2 - 2^(2-p)) * 2^emax
            (2.0 - pow2(2 - p)) * pow2(f.emax())
        } else {
            (2.0 - pow2(1 - p)) * pow2(f.emax())
        };
        assert_eq!(f.max_finite(), expected, "{f}");
    }
}

#[test]
fn u_is_half_of_epsilon() {
    for f in Format::ALL {
        assert_eq!(f.machine_epsilon(), 2.0 * f.unit_roundoff());
        assert_eq!(
            1.0 + f.machine_epsilon(),
            f.round(1.0 + f.machine_epsilon(), Overflow::NonSaturating)
        );
    }
    assert_eq!(Format::BF16.machine_epsilon(), 0.0078125);
    assert_eq!(Format::F32.machine_epsilon(), f32::EPSILON as f64);
    assert_eq!(Format::F64.machine_epsilon(), f64::EPSILON);
}

#[test]
fn names_parse_back() {
    for f in Format::ALL {
        assert_eq!(f.name().parse::<Format>().unwrap(), f);
        assert_eq!(f.name().to_uppercase().parse::<Format>().unwrap(), f);
    }
    assert!(matches!(
        "fp7".parse::<Format>(),
        Err(Error::UnknownFormat(_))
    ));
}

#[test]
fn gamma_is_none_when_vacuous() {
    assert_eq!(Format::BF16.gamma(256), None);
    assert!(Format::BF16.gamma(255).is_some());
    let g = Format::F32.gamma(10).unwrap();
    let u = Format::F32.unit_roundoff();
    assert_eq!(g, 10.0 * u / (1.0 - 10.0 * u));
}

#[test]
fn exponent_of_subnormals() {
    assert_eq!(exponent_of(f64::from_bits(1)), -1074);
    assert_eq!(exponent_of(f64::MIN_POSITIVE), -1022);
    assert_eq!(exponent_of(f64::MIN_POSITIVE / 2.0), -1023);
    assert_eq!(exponent_of(1.5), 0);
}

/// FP32 sums of FP32 values (`add_rounded`, TwoSum and one rounding) are the exact sums rounded
/// once, as the long accumulator rounds them: random pairs over the whole exponent range,
/// subnormals, exact ties (1 + 2⁻²⁴ and its neighbours), cancellations, signed zeros and
/// overflow under both policies.
#[test]
fn fp32_sums_are_the_exact_sums_rounded_once() {
    use crate::engine::SplitMix64;
    use crate::exact::ExactAccumulator;
    let oracle = |a: f64, b: f64, ov: Overflow| {
        let mut acc = ExactAccumulator::new();
        acc.add(a);
        acc.add(b);
        acc.round(Format::F32, ov)
    };
    let mut g = SplitMix64::for_name("fp32 sums", 7);
    let mut values: Vec<f64> = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        2f64.powi(-24),
        -(2f64.powi(-24)),
        3.0 * 2f64.powi(-25),
        f64::from(f32::MAX),
        -f64::from(f32::MAX),
        f64::from(f32::MIN_POSITIVE),
        2f64.powi(-149),
        -(2f64.powi(-149)),
        1.0 + 2f64.powi(-23),
    ];
    for _ in 0..4000 {
        let bits = g.next_u64() as u32;
        let v = f32::from_bits(bits);
        if v.is_finite() {
            values.push(f64::from(v));
        }
        // Nearby magnitudes, where ties and cancellation happen.
        values.push(f64::from((g.normal() * 1e3) as f32));
    }
    let mut checked = 0;
    for pair in values.chunks(2).chain(values.windows(2).take(4000)) {
        let (a, b) = (pair[0], pair[pair.len() - 1]);
        for (x, y) in [(a, b), (b, a), (a, -b), (1.0, b), (a, 2f64.powi(-24))] {
            for ov in [Overflow::NonSaturating, Overflow::Saturating] {
                let got = Format::F32.add_rounded(x, y, ov);
                let want = oracle(x, y, ov);
                assert!(
                    got.to_bits() == want.to_bits() || (got == 0.0 && want == 0.0 && x + y == 0.0),
                    "{x:e} + {y:e}: {got:e} against {want:e}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 40_000);
}

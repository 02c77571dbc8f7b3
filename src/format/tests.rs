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

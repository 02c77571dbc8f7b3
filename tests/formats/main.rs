//! Formats: exhaustive bit-pattern round trips, agreement with the `half` crate, FP8 against
//! the OCP OFP8 value tables, and rounding against the exact oracle.

#[path = "../common/mod.rs"]
mod common;

use common::{ldexp, spec, Dy};
use proptest::prelude::*;
use ttrace::{Error, Format, Overflow};

mod against_half;
mod bulk;
mod ocp;

const NARROW: [Format; 5] = [
    Format::TF32,
    Format::F16,
    Format::BF16,
    Format::E4M3,
    Format::E5M2,
];

fn same_bits_or_nan(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn every_pattern_decodes_and_reencodes_to_itself() {
    for f in NARROW {
        let n = 1u64 << f.bit_width();
        for bits in 0..n {
            let v = f.decode(bits).unwrap();
            assert!(f.is_representable(v), "{f} {bits:#x} -> {v}");
            assert_eq!(
                f.encode(v).unwrap(),
                bits,
                "{f} pattern {bits:#x} (value {v})"
            );
        }
        assert!(matches!(f.decode(n), Err(Error::BitPatternTooWide { .. })));
    }
}

#[test]
fn f32_patterns_sampled_round_trip() {
    // Every 4099th pattern plus the specials: 2^32 is too many for a unit test.
    let mut bits = 0u64;
    while bits < 1 << 32 {
        let v = Format::F32.decode(bits).unwrap();
        assert!(same_bits_or_nan(v, f32::from_bits(bits as u32) as f64));
        if !v.is_nan() {
            assert_eq!(Format::F32.encode(v).unwrap(), bits);
        }
        bits += 4099;
    }
}

#[test]
fn specials_and_signed_zero() {
    for f in Format::ALL {
        for ov in [Overflow::NonSaturating, Overflow::Saturating] {
            assert!(f.round(f64::NAN, ov).is_nan());
            let z = f.round(-0.0, ov);
            assert!(z == 0.0 && z.is_sign_negative(), "{f}: -0 must stay -0");
            let tiny = f.round(-f.min_subnormal() / 4.0, ov);
            assert!(
                tiny == 0.0 && tiny.is_sign_negative(),
                "{f}: underflow keeps the sign"
            );
        }
        let inf = f.round(f64::INFINITY, Overflow::NonSaturating);
        if f.has_infinity() {
            assert_eq!(inf, f64::INFINITY);
        } else {
            assert!(inf.is_nan());
        }
        assert_eq!(
            f.round(f64::NEG_INFINITY, Overflow::Saturating),
            -f.max_finite()
        );
        assert_eq!(
            f.round(f.max_finite() * 4.0, Overflow::Saturating),
            f.max_finite()
        );
        // Half the smallest subnormal is a tie between 0 (even) and min_subnormal.
        assert_eq!(
            f.round(f.min_subnormal() / 2.0, Overflow::NonSaturating),
            0.0
        );
        assert_eq!(
            f.round(f.min_subnormal() * 0.75, Overflow::NonSaturating),
            f.min_subnormal()
        );
    }
}

#[test]
fn encode_rejects_unrepresentable_values() {
    assert!(matches!(
        Format::BF16.encode(0.1),
        Err(Error::NotRepresentable { .. })
    ));
    assert!(matches!(
        Format::E4M3.encode(f64::INFINITY),
        Err(Error::NotRepresentable { .. })
    ));
    assert_eq!(Format::E4M3.encode(f64::NAN).unwrap(), 0x7F);
    assert_eq!(Format::E4M3.encode(-f64::NAN).unwrap(), 0xFF);
    assert_eq!(Format::E5M2.encode(f64::NEG_INFINITY).unwrap(), 0xFC);
    assert_eq!(Format::E4M3.encode(448.0).unwrap(), 0x7E);
    assert_eq!(Format::E4M3.encode(-0.0).unwrap(), 0x80);
}

#[test]
fn subset_relation_matches_brute_force() {
    for a in NARROW {
        for b in Format::ALL {
            let brute = (0..1u64 << a.bit_width()).all(|bits| {
                let v = a.decode(bits).unwrap();
                !v.is_finite() || b.is_representable(v)
            });
            assert_eq!(a.is_subset_of(b), brute, "{a} ⊆ {b}");
        }
    }
}

/// `half` 2.7 converts f64 to bf16 by dropping the low 32 bits first (and f64 to f16 through
/// f32 on x86 with F16C), which rounds twice. Here is an input where that matters and the
/// exact answer, derived by hand: 1 + 2^-8 + 2^-40 is above the midpoint 1 + 2^-8.
#[test]
fn f64_inputs_are_rounded_once() {
    let x = 1.0 + ldexp(1.0, -8) + ldexp(1.0, -40);
    assert_eq!(
        Format::BF16.round(x, Overflow::NonSaturating),
        1.0 + ldexp(1.0, -7)
    );
    let y = 1.0 + ldexp(1.0, -11) + ldexp(1.0, -40);
    assert_eq!(
        Format::F16.round(y, Overflow::NonSaturating),
        1.0 + ldexp(1.0, -10)
    );
}

fn format_names() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec!["f32", "tf32", "f16", "bf16", "e4m3", "e5m2"])
}

/// Any finite f64 with an exponent anywhere near the narrow formats' ranges.
fn finite_f64() -> impl Strategy<Value = f64> {
    (any::<bool>(), 0u64..(1 << 52), -160i32..140).prop_map(|(neg, frac, e)| {
        let v = ldexp(1.0 + frac as f64 / (1u64 << 52) as f64, e);
        if neg {
            -v
        } else {
            v
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20_000))]

    #[test]
    fn rounding_matches_the_exact_oracle(name in format_names(), x in finite_f64(), sat in any::<bool>()) {
        let f: Format = name.parse().unwrap();
        let ov = if sat { Overflow::Saturating } else { Overflow::NonSaturating };
        let ours = f.round(x, ov);
        let expected = Dy::from_f64(x).round(spec(name), sat);
        prop_assert!(same_bits_or_nan(ours, expected) || (ours == 0.0 && expected == 0.0),
            "{} round({:e}) = {:e}, oracle {:e}", name, x, ours, expected);
    }

    #[test]
    fn add_rounded_is_one_correct_rounding(name in format_names(), a in finite_f64(), b in finite_f64()) {
        let f: Format = name.parse().unwrap();
        let a = f.round(a, Overflow::Saturating);
        let b = f.round(b, Overflow::Saturating) * 1.000244140625; // b needs more bits than f has
        let ours = f.add_rounded(a, b, Overflow::NonSaturating);
        let expected = Dy::from_f64(a).add(&Dy::from_f64(b)).round(spec(name), false);
        prop_assert!(same_bits_or_nan(ours, expected) || (ours == 0.0 && expected == 0.0),
            "{}: {:e} + {:e} -> {:e}, oracle {:e}", name, a, b, ours, expected);
    }

    #[test]
    fn decimal_text_just_off_a_midpoint_rounds_the_right_way(
        name in format_names(), raw in any::<u64>(), side in 0u8..3
    ) {
        let f: Format = name.parse().unwrap();
        let code = raw % ((1u64 << (f.bit_width() - 1)) - 2) + 1;
        let lo = f.decode(code).unwrap();
        let hi = f.decode(code + 1).unwrap();
        prop_assume!(lo.is_finite() && hi.is_finite());
        let mid = (lo + hi) / 2.0;
        // Exact decimal expansion of the midpoint (Rust prints the exact digits).
        let exact = format!("{mid:.400}");
        let exact = exact.trim_end_matches('0');
        let (text, expected) = match side {
            0 => (format!("{exact}000000000000000000001"), hi),
            1 => {
                // Decrement the last digit and append nines: just below the midpoint.
                let mut digits: Vec<u8> = exact.bytes().collect();
                if digits.last() == Some(&b'.') {
                    digits.push(b'0');
                }
                for d in digits.iter_mut().rev() {
                    match *d {
                        b'.' => continue,
                        b'0' => *d = b'9',
                        _ => {
                            *d -= 1;
                            break;
                        }
                    }
                }
                (format!("{}99999999999999999999", String::from_utf8(digits).unwrap()), lo)
            }
            _ => (exact.trim_end_matches('.').to_string(), if code % 2 == 0 { lo } else { hi }),
        };
        let ours = f.round_decimal(&text, Overflow::NonSaturating).unwrap();
        prop_assert_eq!(ours, expected, "{} '{}'", name, text);
    }
}

#[test]
fn decimal_text_just_below_a_midpoint_rounds_down() {
    // 1 + 2^-8 = 1.00390625 is the BF16 midpoint between 1 and 1 + 2^-7.
    let r = Format::BF16.round_decimal("1.00390624999999999999999", Overflow::NonSaturating);
    assert_eq!(r.unwrap(), 1.0);
    let r = Format::E4M3.round_decimal("464.00000000000000000001", Overflow::NonSaturating);
    assert!(r.unwrap().is_nan());
    let r = Format::E4M3.round_decimal("463.99999999999999999999", Overflow::NonSaturating);
    assert_eq!(r.unwrap(), 448.0);
    assert!(Format::F16
        .round_decimal("twelve", Overflow::NonSaturating)
        .err()
        .is_some_and(|e| matches!(e, ttrace::Error::InvalidParameter { .. })));
}

#[test]
fn first_unrepresentable_agrees_with_is_representable() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for f in Format::ALL {
        let mut xs: Vec<f64> = (0..2000)
            .map(|_| f.round(rng.random_range(-500.0..500.0), Overflow::Saturating))
            .collect();
        xs.extend([f64::NAN, 0.0, -0.0, f.max_finite(), -f.min_subnormal()]);
        if f.has_infinity() {
            xs.push(f64::NEG_INFINITY);
        }
        assert_eq!(f.first_unrepresentable(&xs), None, "{f}");
        for bad in [0.1f64.next_up(), f64::INFINITY, f.max_finite() * 3.0] {
            if f.is_representable(bad) {
                continue;
            }
            let mut ys = xs.clone();
            ys.insert(777, bad);
            assert_eq!(f.first_unrepresentable(&ys), Some(777), "{f} {bad}");
        }
    }
}

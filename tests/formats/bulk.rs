//! Slice rounding and f32 bit encoding: per element, refusals, the overflow threshold.

use super::*;

/// Adversarial values for a format: ties and near-ties at normal, subnormal and overflow
/// boundaries, zeros, NaN, infinities, plus random magnitudes.
fn adversarial(f: Format, pick: u64, scale: i32, frac: f64) -> f64 {
    let max = f.max_finite();
    let tiny = f.min_subnormal();
    let v = match pick % 12 {
        0 => 0.0,
        1 => -0.0,
        2 => f64::NAN,
        3 => f64::INFINITY,
        4 => max * (1.0 + frac / 8.0),
        5 => max,
        6 => tiny * (0.5 + frac),
        7 => f.min_normal() * (1.0 - frac / 4.0),
        8 => {
            (1.0 + (2 * (pick % 5) + 1) as f64 * 2f64.powi(-(f.precision() as i32)))
                * 2f64.powi(scale % 8)
        }
        _ => (1.0 + frac) * 2f64.powi(scale),
    };
    if pick % 2 == 1 {
        -v
    } else {
        v
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// `round_slice` (its branch-free 8-element blocks and its fallback) is bit-identical to
    /// `round` on every element, for every format and overflow mode, on slices mixing normal
    /// values with the cases the fast path must hand over (subnormals, overflow, NaN, ±∞).
    #[test]
    fn round_slice_is_round_per_element(
        picks in prop::collection::vec((any::<u64>(), -150i32..150, 0.0f64..1.0), 0..70),
        which in 0usize..7, sat in any::<bool>(), clean in any::<bool>())
    {
        let f = Format::ALL[which];
        let overflow = if sat { Overflow::Saturating } else { Overflow::NonSaturating };
        let xs: Vec<f64> = picks.iter().map(|&(p, s, fr)| {
            if clean { (1.0 + fr) * 2f64.powi(s % 10) * if p % 2 == 0 { 1.0 } else { -1.0 } }
            else { adversarial(f, p, s, fr) }
        }).collect();
        let mut fast = xs.clone();
        f.round_slice(&mut fast, overflow);
        for (x, r) in xs.iter().zip(&fast) {
            let want = f.round(*x, overflow);
            prop_assert!(want.to_bits() == r.to_bits() || (want.is_nan() && r.is_nan()),
                "{f}: round({x:e}) = {want:e}, round_slice gave {r:e}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// `round_f32_to_bits` (BF16 carry trick, F16C conversion, element-wise blocks for NaN and
    /// saturation) gives `encode(round(x))` for every element: normal, subnormal, overflowing,
    /// infinite and NaN inputs, both overflow modes.
    #[test]
    fn round_f32_to_bits_is_encode_of_round(
        bits in prop::collection::vec(any::<u32>(), 0..60),
        tame in prop::collection::vec(-70000.0f32..70000.0, 0..60),
        ties in prop::collection::vec(any::<u32>(), 0..30),
        f16 in any::<bool>(), sat in any::<bool>())
    {
        // Exact midpoints of the target format: BF16 drops 16 bits, F16 (normal range) 13.
        let tie = |r: u32| if f16 {
            let e = 103 + (r >> 24) % 40; // exponents around F16's range
            f32::from_bits((r & 0x8000_0000) | (e << 23) | ((r & 0x3ff) << 13) | 0x1000)
        } else {
            f32::from_bits((r & 0xffff_0000) | 0x8000)
        };
        let f = if f16 { Format::F16 } else { Format::BF16 };
        let overflow = if sat { Overflow::Saturating } else { Overflow::NonSaturating };
        let src: Vec<f32> = bits
            .iter()
            .map(|b| f32::from_bits(*b))
            .chain(tame)
            .chain(ties.iter().map(|r| tie(*r)))
            .collect();
        let mut dst = vec![0u16; src.len()];
        f.round_f32_to_bits(&src, &mut dst, overflow).unwrap();
        for (x, got) in src.iter().zip(&dst) {
            let want = f.encode(f.round(f64::from(*x), overflow)).unwrap() as u16;
            prop_assert!(want == *got || (x.is_nan() && f.decode(u64::from(*got)).unwrap().is_nan()),
                "{f} {overflow:?}: {x:e} ({:#010x}) -> {got:#06x}, want {want:#06x}", x.to_bits());
        }
    }
}

#[test]
fn round_f32_to_bits_rejects_other_formats_and_length_mismatches() {
    let mut dst = [0u16; 2];
    assert!(Format::E4M3
        .round_f32_to_bits(&[1.0, 2.0], &mut dst, Overflow::NonSaturating)
        .err()
        .is_some_and(|e| matches!(e, ttrace::Error::InvalidParameter { .. })));
    assert!(Format::BF16
        .round_f32_to_bits(&[1.0], &mut dst, Overflow::NonSaturating)
        .err()
        .is_some_and(|e| matches!(e, ttrace::Error::LengthMismatch { .. })));
}

/// The overflow threshold of the bulk 16-bit rounding, in both overflow modes: the midpoint
/// between the largest finite value and infinity rounds (to even) up, so saturation must catch
/// it, and the largest value below it stays finite. (The BF16 threshold was once f32::MAX, so a
/// block holding exactly 0x7f7f8000 became infinity under saturation; found by the proptest.)
#[test]
fn bulk_rounding_overflow_threshold_is_the_midpoint() {
    for (f, mid) in [
        (Format::BF16, f32::from_bits(0x7f7f_8000)),
        (Format::F16, 65520.0f32),
    ] {
        let below = f32::from_bits(mid.to_bits() - 1);
        for sat in [Overflow::Saturating, Overflow::NonSaturating] {
            for x in [mid, -mid, below, -below, f32::MAX, f32::INFINITY] {
                let src = [x; 8];
                let mut dst = [0u16; 8];
                f.round_f32_to_bits(&src, &mut dst, sat).unwrap();
                let want = f.encode(f.round(f64::from(x), sat)).unwrap() as u16;
                assert!(
                    dst.iter().all(|&d| d == want),
                    "{f} {sat:?} {x:e}: {:#x} vs {want:#x}",
                    dst[0]
                );
            }
        }
    }
}

//! BF16 and F16 against the `half` crate: decoding, every tie and neighbour, random f32.

use super::*;

#[test]
fn decode_agrees_with_half() {
    for bits in 0..=u16::MAX {
        let ours = Format::BF16.decode(bits as u64).unwrap();
        let theirs = half::bf16::from_bits(bits).to_f64();
        assert!(
            same_bits_or_nan(ours, theirs),
            "bf16 {bits:#x}: {ours} vs {theirs}"
        );
        let ours = Format::F16.decode(bits as u64).unwrap();
        let theirs = half::f16::from_bits(bits).to_f64();
        assert!(
            same_bits_or_nan(ours, theirs),
            "f16 {bits:#x}: {ours} vs {theirs}"
        );
    }
}

/// Every midpoint between consecutive values of a 16-bit format, as f32, with both f32
/// neighbours: the cases where a rounding routine can go wrong.
fn midpoints_and_neighbours(f: Format) -> Vec<f32> {
    let mut out = vec![];
    for bits in 0..0x7FFFu64 {
        let a = f.decode(bits).unwrap();
        let b = f.decode(bits + 1).unwrap();
        if !a.is_finite() || !b.is_finite() {
            continue;
        }
        let mid = ((a + b) / 2.0) as f32;
        assert_eq!(mid as f64, (a + b) / 2.0, "midpoints are f32 values");
        for m in [mid, -mid] {
            out.extend([
                m,
                f32::from_bits(m.to_bits() + 1),
                f32::from_bits(m.to_bits() - 1),
            ]);
        }
    }
    out
}

#[test]
fn bf16_rounding_agrees_with_half_on_every_tie_and_neighbour() {
    for x in midpoints_and_neighbours(Format::BF16) {
        let ours = Format::BF16.round(x as f64, Overflow::NonSaturating);
        let theirs = half::bf16::from_f32(x).to_f64();
        assert!(
            same_bits_or_nan(ours, theirs),
            "bf16({x:e}): {ours} vs half {theirs}"
        );
    }
}

#[test]
fn f16_rounding_agrees_with_half_on_every_tie_and_neighbour() {
    for x in midpoints_and_neighbours(Format::F16) {
        let ours = Format::F16.round(x as f64, Overflow::NonSaturating);
        let theirs = half::f16::from_f32(x).to_f64();
        assert!(
            same_bits_or_nan(ours, theirs),
            "f16({x:e}): {ours} vs half {theirs}"
        );
    }
}

#[test]
fn rounding_agrees_with_half_on_random_f32() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x7_7ace);
    for _ in 0..2_000_000 {
        let x = f32::from_bits(rng.random::<u32>());
        let b = Format::BF16.round(x as f64, Overflow::NonSaturating);
        assert!(
            same_bits_or_nan(b, half::bf16::from_f32(x).to_f64()),
            "bf16({x:e})"
        );
        let h = Format::F16.round(x as f64, Overflow::NonSaturating);
        assert!(
            same_bits_or_nan(h, half::f16::from_f32(x).to_f64()),
            "f16({x:e})"
        );
    }
}

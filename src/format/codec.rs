//! Values of a format as little-endian bytes, the way tensor files store them (safetensors,
//! `.npy`): one element per `ceil(bits / 8)` bytes, F64 as its own bits, every other format
//! as its bit pattern ([`Format::encode`] / [`Format::decode`]). Published through
//! [`io::safetensors`](crate::io::safetensors); the trace vocabulary's stored tensors and the
//! readers all go through it.

use crate::error::{Error, Result};
use crate::format::Format;

/// Bytes per element of a format as stored.
pub fn element_size(f: Format) -> usize {
    f.bit_width().div_ceil(8) as usize
}

/// Encode values of `f` as little-endian bytes.
pub fn encode_values(values: &[f64], f: Format, what: &str) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    encode_values_into(values, f, what, &mut out)?;
    Ok(out)
}

/// [`encode_values`] appended to `out`. An F32 or BF16 value is encoded through `f32` when it
/// converts there and back unchanged (and, for BF16, its `f32` pattern's low half is zero):
/// exactly the values of the format, whose patterns these are; NaNs and anything else go
/// through [`Format::encode`] (which keeps NaN payloads and refuses values off the grid).
pub fn encode_values_into(values: &[f64], f: Format, what: &str, out: &mut Vec<u8>) -> Result<()> {
    let size = element_size(f);
    out.reserve(values.len() * size);
    let slow = |v: f64| {
        f.encode(v).map_err(|e| Error::InvalidParameter {
            name: "tensor",
            reason: format!("{what}: {e}"),
        })
    };
    for &v in values {
        let narrow = v as f32;
        let bits = match f {
            Format::F64 => v.to_bits(),
            Format::F32 if f64::from(narrow) == v || v.is_infinite() => u64::from(narrow.to_bits()),
            Format::BF16
                if (f64::from(narrow) == v || v.is_infinite())
                    && narrow.to_bits() & 0xffff == 0 =>
            {
                u64::from(narrow.to_bits() >> 16)
            }
            _ => slow(v)?,
        };
        out.extend_from_slice(&bits.to_le_bytes()[..size]);
    }
    Ok(())
}

/// Decode little-endian bytes of `f` into values (finite F32 and BF16 through `f32`, exactly;
/// everything else through [`Format::decode`]).
pub fn decode_values(bytes: &[u8], f: Format) -> Result<Vec<f64>> {
    let mut out = Vec::new();
    decode_values_into(bytes, f, &mut out)?;
    Ok(out)
}

/// [`decode_values`] into `out` (cleared first; its capacity is reused, so a buffer kept from
/// an earlier tensor of the same size costs no fresh pages).
pub fn decode_values_into(bytes: &[u8], f: Format, out: &mut Vec<f64>) -> Result<()> {
    out.clear();
    match f {
        Format::F64 => out.extend(
            bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])),
        ),
        // Every value through f32 (exact for non-NaNs, and vectorizable); then NaNs again
        // through the format's own decoder, which keeps their payload (an f32 → f64
        // conversion would quiet a signalling NaN).
        Format::F32 | Format::BF16 => {
            let size = element_size(f);
            let bits = |c: &[u8]| {
                if size == 4 {
                    u32::from_le_bytes([c[0], c[1], c[2], c[3]])
                } else {
                    // A BF16 pattern is the top half of the FP32 pattern of its value.
                    u32::from(u16::from_le_bytes([c[0], c[1]])) << 16
                }
            };
            // The widening flags NaN patterns as it goes: NaNs are rare.
            if widen_f32_patterns(bytes, size, out) {
                for (x, c) in out.iter_mut().zip(bytes.chunks_exact(size)) {
                    if x.is_nan() {
                        let raw = bits(c) >> (32 - 8 * size as u32);
                        *x = f.decode(u64::from(raw))?;
                    }
                }
            }
        }
        // Every pattern's value from a table (built once): no decoding per element.
        Format::E4M3 | Format::E5M2 => {
            let table = pattern_table(f);
            out.extend(bytes.iter().map(|&b| table[usize::from(b)]));
        }
        Format::F16 => {
            let table = pattern_table(f);
            out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| table[usize::from(u16::from_le_bytes([c[0], c[1]]))]),
            );
        }
        _ => {
            let size = element_size(f);
            for c in bytes.chunks_exact(size) {
                let mut b = [0u8; 8];
                b[..size].copy_from_slice(c);
                out.push(f.decode(u64::from_le_bytes(b))?);
            }
        }
    }
    Ok(())
}

/// The value of every bit pattern of a format of at most 16 bits, by pattern (built on first
/// use: 2 KiB for an FP8 format, 512 KiB for F16).
fn pattern_table(f: Format) -> &'static [f64] {
    use std::sync::OnceLock;
    debug_assert!(matches!(f, Format::E4M3 | Format::E5M2 | Format::F16));
    static TABLES: [OnceLock<Vec<f64>>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let slot = match f {
        Format::E4M3 => 0,
        Format::E5M2 => 1,
        _ => 2,
    };
    TABLES[slot].get_or_init(|| {
        (0..1u64 << f.bit_width())
            // Every pattern of the format's width decodes.
            .map(|b| f.decode(b).unwrap_or(f64::NAN))
            .collect()
    })
}

/// Append the values of little-endian F32 (`size` 4) or BF16 (`size` 2) patterns to `out`,
/// widened through `f32` (exact for every non-NaN; the caller fixes NaN payloads), and say
/// whether some pattern is a NaN. Written straight into `out`'s spare capacity in blocks of 8
/// that compile to vector conversions (AVX2 when the CPU has it): the same values as
/// `f64::from(f32::from_bits(pattern))` one by one (test `widening_is_elementwise`).
fn widen_f32_patterns(bytes: &[u8], size: usize, out: &mut Vec<f64>) -> bool {
    crate::arch::dispatch!(
        // SAFETY: `dispatch!` runs this only on a CPU with AVX2.
        Avx2 => unsafe { widen_avx2(bytes, size, out) },
        widen_body(bytes, size, out),
    )
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn widen_avx2(bytes: &[u8], size: usize, out: &mut Vec<f64>) -> bool {
    widen_body(bytes, size, out)
}

#[inline(always)]
fn widen_body(bytes: &[u8], size: usize, out: &mut Vec<f64>) -> bool {
    let n = bytes.len() / size;
    out.reserve(n);
    let start = out.len();
    let dst = &mut out.spare_capacity_mut()[..n];
    let nan = if size == 4 {
        widen_into::<4>(bytes, dst)
    } else {
        widen_into::<2>(bytes, dst)
    };
    // SAFETY: `widen_into` wrote every one of the `n` slots after `start`.
    unsafe { out.set_len(start + n) };
    nan
}

/// Write the values of the `dst.len()` patterns of `SIZE` bytes in `bytes` into `dst` (every
/// slot), and say whether one is a NaN.
#[inline(always)]
fn widen_into<const SIZE: usize>(bytes: &[u8], dst: &mut [std::mem::MaybeUninit<f64>]) -> bool {
    let pattern = |c: &[u8]| {
        if SIZE == 4 {
            u32::from_le_bytes([c[0], c[1], c[2], c[3]])
        } else {
            // A BF16 pattern is the top half of the FP32 pattern of its value.
            u32::from(u16::from_le_bytes([c[0], c[1]])) << 16
        }
    };
    let mut nan = 0u32;
    let mut one = |d: &mut std::mem::MaybeUninit<f64>, c: &[u8]| {
        let p = pattern(c);
        nan |= u32::from(p & 0x7fff_ffff > 0x7f80_0000);
        d.write(f64::from(f32::from_bits(p)));
    };
    let mut blocks = dst.chunks_exact_mut(8);
    let mut sources = bytes.chunks_exact(8 * SIZE);
    for (d, c) in (&mut blocks).zip(&mut sources) {
        for (l, x) in d.iter_mut().enumerate() {
            one(x, &c[l * SIZE..]);
        }
    }
    for (x, c) in blocks
        .into_remainder()
        .iter_mut()
        .zip(sources.remainder().chunks_exact(SIZE))
    {
        one(x, c);
    }
    nan != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every pattern of the table-decoded formats gives [`Format::decode`]'s bits.
    #[test]
    fn tables_decode_every_pattern() {
        for f in [Format::E4M3, Format::E5M2, Format::F16] {
            let size = element_size(f);
            let bytes: Vec<u8> = (0..1u32 << f.bit_width())
                .flat_map(|b| b.to_le_bytes()[..size].to_vec())
                .collect();
            let got = decode_values(&bytes, f).unwrap();
            for (b, x) in got.iter().enumerate() {
                assert_eq!(
                    x.to_bits(),
                    f.decode(b as u64).unwrap().to_bits(),
                    "{f} {b:#x}"
                );
            }
        }
    }

    proptest! {
        /// The F32 and BF16 encodings through `f32` give [`Format::encode`]'s patterns, and
        /// refuse what it refuses: values of the format (of every binade, subnormals, zeros
        /// and infinities) and values off its grid.
        #[test]
        fn fast_encodings_are_the_formats(pattern in any::<u32>(), nudge in -2i64..=2, bf16 in any::<bool>()) {
            let f = if bf16 { Format::BF16 } else { Format::F32 };
            let on = f64::from(f32::from_bits(if bf16 { pattern & 0xffff_0000 } else { pattern }));
            let v = if on.is_finite() && nudge != 0 {
                f64::from_bits((on.to_bits() as i64 + nudge) as u64)
            } else {
                on
            };
            let got = encode_values(&[v], f, "x");
            match f.encode(v) {
                Ok(bits) if !v.is_nan() => {
                    let size = element_size(f);
                    prop_assert_eq!(got.unwrap(), bits.to_le_bytes()[..size].to_vec());
                }
                Ok(_) => prop_assert!(got.is_ok()),
                Err(_) => {
                    let refused = matches!(got, Err(Error::InvalidParameter { .. }));
                    prop_assert!(refused, "refused as encode refuses");
                }
            }
        }

        /// The blocked (vectorized) widening gives, pattern by pattern, the bits of the plain
        /// conversion — for every length (blocks of 8 and a tail) and any pattern, NaNs
        /// included.
        #[test]
        fn widening_is_elementwise(bytes in prop::collection::vec(any::<u8>(), 0..200), bf16 in any::<bool>()) {
            let size = if bf16 { 2 } else { 4 };
            let bytes = &bytes[..bytes.len() / size * size];
            let mut fast = vec![1.0];
            let nan = widen_f32_patterns(bytes, size, &mut fast);
            let plain: Vec<f64> = bytes
                .chunks_exact(size)
                .map(|c| {
                    let p = if size == 4 {
                        u32::from_le_bytes([c[0], c[1], c[2], c[3]])
                    } else {
                        u32::from(u16::from_le_bytes([c[0], c[1]])) << 16
                    };
                    f64::from(f32::from_bits(p))
                })
                .collect();
            prop_assert_eq!(fast[0], 1.0, "appends after existing values");
            prop_assert_eq!(fast.len(), plain.len() + 1);
            prop_assert!(fast[1..].iter().zip(&plain).all(|(a, b)| a.to_bits() == b.to_bits()));
            prop_assert_eq!(nan, plain.iter().any(|x| x.is_nan()), "says whether a NaN came");
        }
    }
}

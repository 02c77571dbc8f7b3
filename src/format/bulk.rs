//! The bulk rounding kernels behind [`Format::round_slice`] and
//! [`Format::round_f32_to_bits`]: blocks of 8 rounded branch-free on their bit patterns (AVX2
//! and F16C where the CPU has them), every other element through the scalar path —
//! bit-identical to [`Format::round`] per element (`tests/formats/`).

use super::*;

/// The loop of [`Format::round_slice`] with precision and e_min as constants.
///
/// Fast path: blocks of 8 elements are rounded branch-free on their bit patterns with the
/// normal-range formula of [`round_to_precision`] (add half an ulp minus one plus the last kept
/// bit, clear the dropped bits); a block is kept only when every element is zero or at least
/// 2^e_min in magnitude and its rounded magnitude does not exceed the largest finite value —
/// exactly the cases where [`round_to_precision`] takes that formula and no overflow policy
/// applies. Otherwise (subnormal results, overflow, NaN, infinities) the block goes through
/// the element-wise path. Bit-identical to [`Format::round`] per element
/// (`tests/formats/`, `round_slice_is_round_per_element`).
pub(super) fn round_slice_const<const P: u32, const EMIN: i32>(
    format: Format,
    xs: &mut [f64],
    overflow: Overflow,
) {
    debug_assert_eq!((format.precision(), format.emin()), (P, EMIN));
    let max = format.max_finite();
    let shift = 53 - P;
    let half_minus_one = (1u64 << (shift - 1)) - 1;
    let keep = !((1u64 << shift) - 1);
    let min_normal = ((EMIN + 1023) as u64) << 52;
    let max_bits = max.to_bits();
    let slow = |x: &mut f64| {
        let r = round_to_precision(*x, P, EMIN);
        *x = if r.abs() <= max {
            r
        } else {
            format.apply_overflow(r, *x, overflow)
        };
    };
    let consts = BlockConsts {
        shift,
        half_minus_one,
        keep,
        min_normal,
        max_bits,
    };
    let whole = xs.len() / 8 * 8;
    let mut failed = Vec::new();
    fast_blocks_dispatch(&mut xs[..whole], &consts, &mut failed);
    for b in failed {
        xs[b * 8..b * 8 + 8].iter_mut().for_each(slow);
    }
    xs[whole..].iter_mut().for_each(slow);
}

/// Whether a block of 8 may take a fast path: no NaN, and nothing saturation would change.
#[inline(always)]
fn plain_block(b: &[f32], sat: bool, limit: f32) -> bool {
    let mut ok = true;
    for x in b {
        ok &= !x.is_nan() & (!sat | (x.abs() < limit));
    }
    ok
}

/// The bulk conversion of [`Format::round_f32_to_bits`] on whole blocks of 8, noting the blocks
/// left to the element-wise path (NaN, saturation; F16 without F16C).
pub(super) fn bulk_16bit(
    f: Format,
    src: &[f32],
    dst: &mut [u16],
    sat: bool,
    limit: f32,
    redo: &mut Vec<usize>,
) {
    match f {
        Format::F16 => crate::arch::dispatch!(
            // SAFETY: `dispatch!` runs this only on a CPU with AVX and F16C.
            AvxF16c => unsafe { bulk_f16_f16c(src, dst, sat, limit, redo) },
            redo.extend(0..src.len() / 8),
        ),
        Format::BF16 => crate::arch::dispatch!(
            // SAFETY: `dispatch!` runs this only on a CPU with AVX2.
            Avx2 => unsafe { bulk_bf16_avx2(src, dst, sat, limit, redo) },
            bulk_bf16(src, dst, sat, limit, redo),
        ),
        _ => redo.extend(0..src.len() / 8),
    }
}

/// BF16 by the round-to-nearest-even carry on the `f32` pattern (BF16 is the top half of FP32,
/// subnormals and infinities included).
#[inline(always)]
fn bulk_bf16(src: &[f32], dst: &mut [u16], sat: bool, limit: f32, redo: &mut Vec<usize>) {
    for (i, (sb, db)) in src.chunks_exact(8).zip(dst.chunks_exact_mut(8)).enumerate() {
        if !plain_block(sb, sat, limit) {
            redo.push(i);
            continue;
        }
        for (x, o) in sb.iter().zip(db.iter_mut()) {
            let b = x.to_bits();
            *o = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn bulk_bf16_avx2(src: &[f32], dst: &mut [u16], sat: bool, limit: f32, redo: &mut Vec<usize>) {
    bulk_bf16(src, dst, sat, limit, redo)
}

/// F16 by the F16C conversion instruction (IEEE roundTiesToEven, gradual underflow, overflow to
/// infinity — what [`Format::round`] does without saturation).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
fn bulk_f16_f16c(src: &[f32], dst: &mut [u16], sat: bool, limit: f32, redo: &mut Vec<usize>) {
    use std::arch::x86_64::*;
    for (i, (sb, db)) in src.chunks_exact(8).zip(dst.chunks_exact_mut(8)).enumerate() {
        if !plain_block(sb, sat, limit) {
            redo.push(i);
            continue;
        }
        // SAFETY: 8 f32 read and 8 u16 (16 bytes) written, unaligned, within the blocks.
        unsafe {
            let v = _mm256_loadu_ps(sb.as_ptr());
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm_storeu_si128(db.as_mut_ptr() as *mut __m128i, h);
        }
    }
}

/// The constants of the branch-free block rounding of [`round_slice_const`].
struct BlockConsts {
    shift: u32,
    half_minus_one: u64,
    keep: u64,
    min_normal: u64,
    max_bits: u64,
}

/// Round 8 values in place by the normal-range formula when all 8 qualify (see
/// [`round_slice_const`]); returns false, leaving the block untouched, otherwise. Written with
/// integer masks only so that it compiles to vector instructions.
#[inline(always)]
fn round_block(block: &mut [f64; 8], c: &BlockConsts) -> bool {
    let mut out = [0u64; 8];
    let mut bad = 0u64;
    for (o, x) in out.iter_mut().zip(block.iter()) {
        let bits = x.to_bits();
        let mag = bits & !SIGN_BIT;
        let r = (mag + c.half_minus_one + ((mag >> c.shift) & 1)) & c.keep;
        // Zero (mag − 1 wraps to the top) or at least 2^e_min; no overflow after rounding.
        bad |= u64::from(mag.wrapping_sub(1) < c.min_normal - 1) | u64::from(r > c.max_bits);
        *o = (bits & SIGN_BIT) | r;
    }
    if bad != 0 {
        return false;
    }
    for (x, o) in block.iter_mut().zip(out) {
        *x = f64::from_bits(o);
    }
    true
}

/// [`round_block`] over every 8-element block of `xs` (a multiple of 8 long), noting the
/// blocks it left to the element-wise path.
#[inline(always)]
fn fast_blocks(xs: &mut [f64], c: &BlockConsts, failed: &mut Vec<usize>) {
    for (i, block) in xs.chunks_exact_mut(8).enumerate() {
        // (Always 8 long: chunks_exact_mut.)
        let Ok(block) = <&mut [f64; 8]>::try_from(block) else {
            failed.push(i);
            continue;
        };
        if !round_block(block, c) {
            failed.push(i);
        }
    }
}

/// [`fast_blocks`] compiled for AVX2 (4 × 64-bit lanes), same instructions' semantics: integer
/// adds, shifts, masks and compares give identical bits on any instruction set.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn fast_blocks_avx2(xs: &mut [f64], c: &BlockConsts, failed: &mut Vec<usize>) {
    fast_blocks(xs, c, failed)
}

/// Run [`fast_blocks`] with the widest vector instructions the CPU has.
fn fast_blocks_dispatch(xs: &mut [f64], c: &BlockConsts, failed: &mut Vec<usize>) {
    crate::arch::dispatch!(
        // SAFETY: `dispatch!` runs this only on a CPU with AVX2.
        Avx2 => unsafe { fast_blocks_avx2(xs, c, failed) },
        fast_blocks(xs, c, failed),
    )
}

//! A faster path for narrow accumulators (BF16, TF32, FP16) with exact products and sequential
//! order: 8 output columns per `f32` register, 8 rows of A per tile, each step
//! s ← fl_acc(s + a·b) computed as
//!
//! 1. p = a·b in `f32`, exact (inputs of at most 12 significant bits whose non-zero magnitudes
//!    lie in [2^-62, 2^62], so the product is a normal `f32` of at most 24 bits);
//! 2. t = fl32(s + p);
//! 3. s = RNE_acc of the exact s + p, from t:
//!    * BF16 and TF32 (binary32's exponent range): the round-to-nearest-even carry on t's bit
//!      pattern, which also rounds subnormals at the right place (their significands are cut
//!      at the same bit). Every midpoint M between neighbouring accumulator values is an
//!      `f32`, so rounding to nearest is monotonic around it (x < M ⇒ fl32(x) ≤ M, x > M ⇒
//!      fl32(x) ≥ M): RNE_acc(t) = RNE_acc(s + p) unless t lands exactly on a midpoint
//!      (double rounding). Those steps — the bits below the accumulator's precision equal one
//!      half, rare for most data — take a branch that computes the exact error of t by TwoSum
//!      (Knuth, TAOCP vol. 2, §4.2.2) and rounds toward its side ([`break_ties`]).
//!    * FP16: round-to-odd in `f32` from t and its TwoSum error, then F16C's
//!      round-to-nearest-even conversion — correct by Boldo & Melquiond, "Emulation of FMA
//!      and correctly rounded sums: proved algorithms using rounding to odd" (IEEE Trans.
//!      Computers 57(4), 2008, Theorem 1: 24 ≥ 11 + 2 bits), in FP16's subnormal range too
//!      (branch-free: midpoint candidates are frequent with FP16's short significand).
//!
//! Lanes that overflow come out infinite or NaN and stay so (inf + finite = inf; the carry
//! cannot reach the sign bit of a pattern whose low bits are cleared); the caller recomputes
//! every block with a non-finite value by the exact-error path, which also gives saturating
//! overflow its finite result.

/// Which rounding step 3 uses (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Narrow {
    /// BF16: 8 significant bits, binary32's exponent range.
    Bf16,
    /// TF32: 11 significant bits, binary32's exponent range.
    Tf32,
    /// FP16 (binary16), by rounding to odd and F16C.
    F16,
}

/// Rows of A per tile.
const R: usize = 8;

/// C's columns 0..n/8·8 into `out` (f64, row-major m×n) for the accumulator `narrow`, on the
/// fast path; lanes that overflow come out non-finite (see the module docs).
/// Returns false, writing nothing, when the CPU lacks the instructions (AVX2, and F16C for
/// FP16). The caller guarantees the preconditions: k ≥ 1, exact products in `f32` (see the
/// module docs).
pub(crate) fn narrow_kernel(
    a: &[f64],
    b: &[f64],
    m: usize,
    k: usize,
    n: usize,
    narrow: Narrow,
    out: &mut [f64],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::arch::{has, Isa};
        if !has(Isa::Avx2) || (narrow == Narrow::F16 && !has(Isa::Avx2F16c)) {
            return false;
        }
        let n8 = n / 8 * 8;
        if n8 == 0 || m == 0 {
            return true;
        }
        // B's columns in blocks of 8, each block step-major (contiguous: 32 bytes per step).
        let mut b32 = vec![0.0f32; k * n8];
        for (jb, blk) in b32.chunks_exact_mut(k * 8).enumerate() {
            for (kk, d) in blk.chunks_exact_mut(8).enumerate() {
                for (x, &v) in d.iter_mut().zip(&b[kk * n + jb * 8..kk * n + jb * 8 + 8]) {
                    *x = v as f32;
                }
            }
        }
        // One band of R rows: A's rows packed step-major (zeros past the last row), then every
        // 8-column block. Bands run on the rayon pool for large products; each element is
        // computed by the same instructions on any thread.
        let band = |(t, ob): (usize, &mut [f64])| {
            let i0 = t * R;
            let rows = ob.len() / n;
            let mut ap = vec![0.0f32; k * R];
            for kk in 0..k {
                for r in 0..rows {
                    ap[kk * R + r] = a[(i0 + r) * k + kk] as f32;
                }
            }
            let mut tile = [[0.0f32; 8]; R];
            for j in (0..n8).step_by(8) {
                // SAFETY: the CPU has AVX2 (and F16C for FP16), checked above.
                let bj = &b32[j * k..(j + 8) * k];
                unsafe {
                    match narrow {
                        Narrow::Bf16 => tile_carry::<16>(&ap, bj, k, &mut tile),
                        Narrow::Tf32 => tile_carry::<13>(&ap, bj, k, &mut tile),
                        Narrow::F16 => tile_f16(&ap, bj, k, &mut tile),
                    }
                }
                for (r, vals) in tile.iter().enumerate().take(rows) {
                    for (d, &v) in ob[r * n + j..r * n + j + 8].iter_mut().zip(vals) {
                        *d = f64::from(v);
                    }
                }
            }
        };
        let out = &mut out[..m * n];
        if m * n * k >= 1 << 20 && m > R && crate::parallel::threads() > 1 {
            crate::parallel::for_each_chunk_mut(out, R * n, band);
        } else {
            out.chunks_mut(R * n).enumerate().for_each(band);
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (a, b, m, k, n, narrow, out);
        false
    }
}

/// One 8×8 tile for an accumulator with binary32's exponent range and `24 − SHIFT`
/// significant bits (BF16: 16, TF32: 13): rows of `ap` (packed step-major, 8 per step) against
/// a block of 8 columns of B (`b`, packed step-major, 8 per step).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::needless_range_loop)]
fn tile_carry<const SHIFT: i32>(ap: &[f32], b: &[f32], k: usize, out: &mut [[f32; 8]; R]) {
    use std::arch::x86_64::*;
    assert!(ap.len() >= k * R && b.len() >= k * 8 && k >= 1);
    let low = _mm256_set1_epi32((1 << SHIFT) - 1);
    let half = _mm256_set1_epi32(1 << (SHIFT - 1));
    let half_m1 = _mm256_set1_epi32((1 << (SHIFT - 1)) - 1);
    let one = _mm256_set1_epi32(1);
    // Round-to-nearest-even of the pattern at bit SHIFT: add half − 1 plus the kept part's
    // last bit, then clear the low bits (the carry moves into the exponent when the
    // significand overflows, and to infinity past the largest finite value).
    let rne = |bits: __m256i| {
        let odd = _mm256_and_si256(_mm256_srli_epi32::<SHIFT>(bits), one);
        _mm256_andnot_si256(low, _mm256_add_epi32(_mm256_add_epi32(bits, half_m1), odd))
    };
    let (bp, app) = (b.as_ptr(), ap.as_ptr());
    // SAFETY: loads read b[kk·8 .. + 8] and ap[kk·R + r] for kk < k, inside the slices
    // (asserted above).
    let bv = unsafe { _mm256_loadu_ps(bp) };
    let mut acc = [_mm256_setzero_ps(); R];
    for r in 0..R {
        let av = unsafe { _mm256_broadcast_ss(&*app.add(r)) };
        // The first product is exact: one rounding, no midpoint hazard.
        acc[r] = _mm256_castsi256_ps(rne(_mm256_castps_si256(_mm256_mul_ps(av, bv))));
    }
    for kk in 1..k {
        let bv = unsafe { _mm256_loadu_ps(bp.add(kk * 8)) };
        for r in 0..R {
            let av = unsafe { _mm256_broadcast_ss(&*app.add(kk * R + r)) };
            let p = _mm256_mul_ps(av, bv);
            let tf = _mm256_add_ps(acc[r], p);
            let t = _mm256_castps_si256(tf);
            let tie = _mm256_cmpeq_epi32(_mm256_and_si256(t, low), half);
            let mut s = rne(t);
            if _mm256_movemask_epi8(tie) != 0 {
                s = break_ties::<SHIFT>(acc[r], p, tf, tie, s);
            }
            acc[r] = _mm256_castsi256_ps(s);
        }
    }
    for r in 0..R {
        // SAFETY: each row of `out` holds 8 values.
        unsafe { _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
    }
}

/// The rare step where some lane's `f32` sum t = fl32(s + p) is exactly a midpoint of the
/// accumulator (`tie`, lanes all ones): the exact error e = (s + p) − t by TwoSum (Knuth, TAOCP
/// vol. 2, §4.2.2; exact in binary arithmetic without overflow) says on which side the exact
/// sum lies — the larger magnitude when e has t's sign, the smaller when the opposite — and
/// round-to-nearest-even (already in `rounded`) stands when e = 0. Midpoints are at the bit
/// `SHIFT − 1` of t's pattern (the caller masks lanes where that is not so).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn break_ties<const SHIFT: i32>(
    s: std::arch::x86_64::__m256,
    p: std::arch::x86_64::__m256,
    t: std::arch::x86_64::__m256,
    tie: std::arch::x86_64::__m256i,
    rounded: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: only called from functions that enable AVX2 (these are plain AVX/AVX2
    // register operations).
    unsafe {
        let bb = _mm256_sub_ps(t, s);
        let err = _mm256_add_ps(_mm256_sub_ps(s, _mm256_sub_ps(t, bb)), _mm256_sub_ps(p, bb));
        let err_nz = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_NEQ_UQ>(err, _mm256_setzero_ps()));
        let ti = _mm256_castps_si256(t);
        // Sign bits equal: the exact magnitude is above the midpoint.
        let same = _mm256_cmpgt_epi32(
            _mm256_xor_si256(ti, _mm256_castps_si256(err)),
            _mm256_set1_epi32(-1),
        );
        let low = _mm256_set1_epi32((1 << SHIFT) - 1);
        let trunc = _mm256_andnot_si256(low, ti);
        let up = _mm256_add_epi32(trunc, _mm256_set1_epi32(1 << SHIFT));
        let toward = _mm256_blendv_epi8(trunc, up, same);
        _mm256_blendv_epi8(rounded, toward, _mm256_and_si256(tie, err_nz))
    }
}

/// One 8×8 tile for an FP16 accumulator, by rounding to odd (Boldo & Melquiond, IEEE TC 2008,
/// Theorem 1: rounding to odd in a format of p + 2 or more bits, then to nearest even in p
/// bits, is the correctly rounded result; 24 ≥ 11 + 2): the exact error e = (s + p) − t of
/// t = fl32(s + p) by TwoSum (exact), t's pattern moved one step toward zero when e has the
/// opposite sign and its last bit set when e ≠ 0 (that is round-to-odd of s + p), then F16C's
/// round-to-nearest-even conversion. No branches; covers FP16's subnormal range and overflow
/// (infinite lanes are left to the caller's non-finite check).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[allow(clippy::needless_range_loop)]
fn tile_f16(ap: &[f32], b: &[f32], k: usize, out: &mut [[f32; 8]; R]) {
    use std::arch::x86_64::*;
    assert!(ap.len() >= k * R && b.len() >= k * 8 && k >= 1);
    let zero = _mm256_setzero_ps();
    let one = _mm256_set1_epi32(1);
    let (bp, app) = (b.as_ptr(), ap.as_ptr());
    // SAFETY: as in `tile_carry`.
    let bv = unsafe { _mm256_loadu_ps(bp) };
    let mut acc = [_mm256_setzero_ps(); R];
    for r in 0..R {
        let av = unsafe { _mm256_broadcast_ss(&*app.add(r)) };
        // The first product is exact: one rounding.
        acc[r] = f16_round(_mm256_mul_ps(av, bv));
    }
    for kk in 1..k {
        let bv = unsafe { _mm256_loadu_ps(bp.add(kk * 8)) };
        for r in 0..R {
            let av = unsafe { _mm256_broadcast_ss(&*app.add(kk * R + r)) };
            let s = acc[r];
            let p = _mm256_mul_ps(av, bv);
            let t = _mm256_add_ps(s, p);
            let bb = _mm256_sub_ps(t, s);
            let err = _mm256_add_ps(_mm256_sub_ps(s, _mm256_sub_ps(t, bb)), _mm256_sub_ps(p, bb));
            let inexact = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_NEQ_OQ>(err, zero));
            let ti = _mm256_castps_si256(t);
            // −1 where e and t have opposite signs (and e ≠ 0): one step toward zero.
            let down = _mm256_and_si256(
                _mm256_srai_epi32::<31>(_mm256_xor_si256(ti, _mm256_castps_si256(err))),
                inexact,
            );
            let odd = _mm256_or_si256(_mm256_add_epi32(ti, down), _mm256_and_si256(inexact, one));
            acc[r] = f16_round(_mm256_castsi256_ps(odd));
        }
    }
    for r in 0..R {
        // SAFETY: each row of `out` holds 8 values.
        unsafe { _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
    }
}

/// Round-to-nearest-even to FP16 and back (F16C).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn f16_round(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: only called from functions that enable F16C.
    unsafe { _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x)) }
}

//! A and B packed for the kernel: each row of A and column of B scaled by a power of two
//! into [2^-62, 2) (exact), converted to `f32` with its lowest set bit, B in blocks of `W`
//! columns step-major, and the guaranteed bound's weights folded into |A|.

use super::kernel::{Packed, W};
use super::Right;

/// Pack A (rows scaled) and B (columns scaled) for the kernel, with the guaranteed bound's
/// weights folded into |A|; `None` when a scaled non-zero value would leave [2^-62, 2) (its
/// products could underflow `f32`), when the unscaled products could round below FP32's
/// normal range, or when a value is not finite.
pub(super) fn pack(
    a: &[f64],
    b: Right,
    m: usize,
    k: usize,
    n: usize,
    w: &[f64],
) -> Option<(Packed, Vec<i32>, Vec<i32>)> {
    // The kernel computes on scaled values; the engine on the values themselves, where a
    // rounding below FP32's normal range (2^-126) falls on the subnormal grid 2^-149 rather
    // than the scaled one. Every partial sum lies on its terms' grid, so when each product's
    // lowest bit is at least 2^-149 (the products of the lowest bits of A and of B, unscaled)
    // a value below 2^-126 is exact in FP32 and the two computations agree; otherwise the
    // walk decides. Scaling by a power of two is exact, so the least lowest bit unscaled is
    // the least scaled one divided by the scale.
    let (mut low_a, mut low_b) = (f64::INFINITY, f64::INFINITY);
    let mut row_exp = Vec::with_capacity(m);
    let mut pa = Vec::with_capacity(m * k);
    let mut la = Vec::with_capacity(m * k);
    let mut aw = Vec::with_capacity(m * k);
    for row in a[..m * k].chunks_exact(k) {
        let e = Extent::of(row.iter().copied()).exponent()?;
        let s = 2f64.powi(e);
        let mut low = u64::MAX;
        for (&x, &wp) in row.iter().zip(w) {
            let x = x * s;
            let bit = lowest_scaled(x);
            low = low.min(bit.to_bits());
            pa.push(x as f32);
            la.push(bit as f32 * 2f32.powi(23));
            aw.push((x.abs() * wp) as f32);
        }
        low_a = low_a.min(f64::from_bits(low) / s);
        row_exp.push(e);
    }
    // B's column scales first (in its storage order), then B packed a block of `W` columns
    // at a time, step-major, as the kernel reads it.
    let col_exp: Vec<i32> = match b {
        Right::Columns(x) => x[..n * k]
            .chunks_exact(k)
            .map(|col| Extent::of_line(col).exponent())
            .collect::<Option<_>>()?,
        Right::Rows(x) => {
            let mut cols = vec![Extent::default(); n];
            for row in x[..k * n].chunks_exact(n) {
                cols.iter_mut().zip(row).for_each(|(c, &v)| c.add(v));
            }
            cols.iter().map(Extent::exponent).collect::<Option<_>>()?
        }
    };
    let scales: Vec<f64> = col_exp.iter().map(|&e| 2f64.powi(e)).collect();
    let blocks = n.div_ceil(W);
    // Lanes past n are zero columns: 0 with an infinite lowest bit. (Columns fill every
    // lane of a full block, so only a narrow last block needs its lowest bits set first.)
    let mut pb = panel_buffer(blocks * k * W, 0.0);
    let mut lb = match b {
        Right::Columns(_) => {
            let mut lb = panel_buffer(blocks * k * W, 0.0);
            if n % W != 0 {
                lb[(blocks - 1) * k * W..].fill(f32::INFINITY);
            }
            lb
        }
        Right::Rows(_) => panel_buffer(blocks * k * W, f32::INFINITY),
    };
    let mut low = vec![u64::MAX; n];
    match b {
        Right::Columns(x) => {
            // Each column is a contiguous row of the tensor: scaled and its lowest bits taken
            // in one vectorizable pass into a scratch line, a block of `W` columns at a time;
            // then the block's lines are interleaved into its panel step by step, so that the
            // panel is written in order (spreading each line into its lane wrote every step's
            // cache line `W` times: a third of a fast-priced sum).
            // The scratch lines are `stride` apart, not k: k a multiple of 1,024 put all `W`
            // of them in one set of the L1 cache.
            let stride = k + 16;
            let (mut vals, mut bits) = (vec![0.0f32; W * stride], vec![0.0f32; W * stride]);
            for (jb, cols) in x[..n * k].chunks(W * k).enumerate() {
                let width = cols.len() / k;
                for (l, col) in cols.chunks_exact(k).enumerate() {
                    let j = jb * W + l;
                    let line = l * stride..l * stride + k;
                    low[j] = scaled_line(col, scales[j], &mut vals[line.clone()], &mut bits[line]);
                }
                let panel = &mut pb[jb * k * W..(jb + 1) * k * W];
                let lanes = &mut lb[jb * k * W..(jb + 1) * k * W];
                interleave(&vals, stride, width, panel);
                interleave(&bits, stride, width, lanes);
            }
        }
        Right::Rows(x) => {
            for jb in 0..blocks {
                let width = W.min(n - jb * W);
                let base = jb * k * W;
                for p in 0..k {
                    for l in 0..width {
                        let j = jb * W + l;
                        let x = x[p * n + j] * scales[j];
                        let bit = lowest_scaled(x);
                        low[j] = low[j].min(bit.to_bits());
                        pb[base + p * W + l] = x as f32;
                        lb[base + p * W + l] = bit as f32;
                    }
                }
            }
        }
    }
    for (&bits, &s) in low.iter().zip(&scales) {
        low_b = low_b.min(f64::from_bits(bits) / s);
    }
    if low_a * low_b < 2f64.powi(-149) {
        return None;
    }
    Some((
        Packed {
            m,
            k,
            blocks,
            a: pa,
            la,
            aw,
            b: pb,
            lb,
        },
        row_exp,
        col_exp,
    ))
}

thread_local! {
    /// Panel buffers given back by [`recycle`], for the next [`pack`] on this thread.
    static SPARE: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The most panel buffers a thread keeps, and the largest it keeps (in `f32`s: 4 MiB).
const SPARES: usize = 2;
const SPARE_LEN: usize = 1 << 20;

/// A buffer of `len` copies of `fill`, from a spare of this thread's where one is kept.
/// (Fresh buffers of a few hundred kilobytes come from pages the allocator returned to the
/// system after the previous call: their first touch faulted a fifth of a fast-priced sum.)
fn panel_buffer(len: usize, fill: f32) -> Vec<f32> {
    let mut v = SPARE
        .try_with(|s| s.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default();
    v.clear();
    v.resize(len, fill);
    v
}

/// Give a packed panel buffer back for the next [`pack`] on this thread (kept when small
/// enough and fewer than [`SPARES`] are).
pub(super) fn recycle(v: Vec<f32>) {
    if v.capacity() <= SPARE_LEN {
        let _ = SPARE.try_with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < SPARES {
                s.push(v);
            }
        });
    }
}

/// One line of B scaled by `scale` into `vals` (as `f32`) with each value's lowest set bit in
/// `bits` (∞ for 0); the bits of the least lowest bit (as `f64`, the form [`pack`] keeps).
/// Scaled values are zero or normal `f32` numbers, so both are exact in `f32`.
fn scaled_line(line: &[f64], scale: f64, vals: &mut [f32], bits: &mut [f32]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::arch::has(crate::arch::Isa::Avx2Fma) {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2(line: &[f64], scale: f64, vals: &mut [f32], bits: &mut [f32]) -> u32 {
                scaled_line_lanes(line, scale, vals, bits)
            }
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            let low = unsafe { avx2(line, scale, vals, bits) };
            return f64::from(f32::from_bits(low)).to_bits();
        }
    }
    f64::from(f32::from_bits(scaled_line_lanes(line, scale, vals, bits))).to_bits()
}

/// [`scaled_line`]'s loop, the least lowest bit as `f32` bits (non-negative `f32` values
/// order as their bits do, and an integer minimum vectorizes).
#[inline(always)]
fn scaled_line_lanes(line: &[f64], scale: f64, vals: &mut [f32], bits: &mut [f32]) -> u32 {
    let mut low = f32::INFINITY.to_bits();
    for ((&x, v), b) in line.iter().zip(vals.iter_mut()).zip(bits.iter_mut()) {
        let x = (x * scale) as f32;
        let bit = lowest_scaled_f32(x);
        low = low.min(bit.to_bits());
        *v = x;
        *b = bit;
    }
    low
}

/// [`lowest_scaled`] on a scaled value held as `f32` (exactly: a zero or normal `f32`).
#[inline(always)]
fn lowest_scaled_f32(x: f32) -> f32 {
    let bits = x.to_bits() & 0x7fff_ffff;
    let mant = (bits & 0x007f_ffff) | 0x0080_0000;
    let lsb = mant & mant.wrapping_neg();
    // 2^e times the lowest bit of the significand (both powers of two: exact).
    let g = f32::from_bits(bits & 0x7f80_0000) * (lsb as i32 as f32) * (1.0 / 8_388_608.0);
    if bits == 0 {
        f32::INFINITY
    } else {
        g
    }
}

/// The first `width` lines of `lines` (each `stride` apart) interleaved into `panel`, step
/// by step: `panel[p·W + l]` = line l's element p (lanes past `width` left as they are).
fn interleave(lines: &[f32], stride: usize, width: usize, panel: &mut [f32]) {
    let k = panel.len() / W;
    // Full blocks: eight steps of all `W` lines at a time; the rest step by step.
    let full = if width == W { k - k % 8 } else { 0 };
    if !interleave_vector(lines, stride, full, panel) {
        // Contiguous reads of each line, one panel block written in order.
        let mut block = [[0.0f32; 8]; W];
        for p0 in (0..full).step_by(8) {
            for (l, b) in block.iter_mut().enumerate() {
                b.copy_from_slice(&lines[l * stride + p0..l * stride + p0 + 8]);
            }
            let out = &mut panel[p0 * W..(p0 + 8) * W];
            for (q, step) in out.chunks_exact_mut(W).enumerate() {
                for (l, v) in step.iter_mut().enumerate() {
                    *v = block[l][q];
                }
            }
        }
    }
    for p in full..k {
        for l in 0..width {
            panel[p * W + l] = lines[l * stride + p];
        }
    }
}

/// [`interleave_avx2`] where the CPU has AVX2 (true), else nothing (false).
fn interleave_vector(lines: &[f32], stride: usize, full: usize, panel: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::arch::has(crate::arch::Isa::Avx2Fma) && W == 16 {
            // SAFETY: the CPU has AVX2 (checked above).
            unsafe { interleave_avx2(lines, stride, full, panel) };
            return true;
        }
    }
    let _ = (lines, stride, full, panel);
    false
}

/// [`interleave`] of all 16 lines over the first `full` steps (a multiple of 8), eight steps
/// at a time as two 8 × 8 transpositions in registers (unpack, shuffle, permute of 128-bit
/// halves).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn interleave_avx2(lines: &[f32], stride: usize, full: usize, panel: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(
        W == 16
            && full % 8 == 0
            && panel.len() >= full * 16
            && (full == 0 || lines.len() >= 15 * stride + full)
    );
    let (src, dst) = (lines.as_ptr(), panel.as_mut_ptr());
    for p0 in (0..full).step_by(8) {
        for half in 0..2 {
            // SAFETY: line `8·half + l` holds steps p0..p0 + 8 (asserted: 15·stride + full
            // values), and the panel block p0..p0 + 8 has 8·16 values.
            unsafe {
                let r: [__m256; 8] =
                    std::array::from_fn(|l| _mm256_loadu_ps(src.add((8 * half + l) * stride + p0)));
                let t0 = _mm256_unpacklo_ps(r[0], r[1]);
                let t1 = _mm256_unpackhi_ps(r[0], r[1]);
                let t2 = _mm256_unpacklo_ps(r[2], r[3]);
                let t3 = _mm256_unpackhi_ps(r[2], r[3]);
                let t4 = _mm256_unpacklo_ps(r[4], r[5]);
                let t5 = _mm256_unpackhi_ps(r[4], r[5]);
                let t6 = _mm256_unpacklo_ps(r[6], r[7]);
                let t7 = _mm256_unpackhi_ps(r[6], r[7]);
                let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                // Step q's eight lanes of this half.
                let steps = [
                    _mm256_permute2f128_ps::<0x20>(u0, u4),
                    _mm256_permute2f128_ps::<0x20>(u1, u5),
                    _mm256_permute2f128_ps::<0x20>(u2, u6),
                    _mm256_permute2f128_ps::<0x20>(u3, u7),
                    _mm256_permute2f128_ps::<0x31>(u0, u4),
                    _mm256_permute2f128_ps::<0x31>(u1, u5),
                    _mm256_permute2f128_ps::<0x31>(u2, u6),
                    _mm256_permute2f128_ps::<0x31>(u3, u7),
                ];
                for (q, v) in steps.into_iter().enumerate() {
                    _mm256_storeu_ps(dst.add((p0 + q) * 16 + 8 * half), v);
                }
            }
        }
    }
}

/// The lowest set bit of a scaled value (∞ for 0), without branches: scaled values are
/// finite and zero or normal (in [2^-62, 2) by [`Extent::exponent`]), so the bit is
/// 2^(exponent + trailing zeros of the significand) and normal too. Agrees with
/// `reduction::lowest_bit` there.
#[inline(always)]
fn lowest_scaled(x: f64) -> f64 {
    let bits = x.to_bits() & !(1u64 << 63);
    let field = bits >> 52;
    let tz = u64::from((bits | (1u64 << 52)).trailing_zeros());
    if bits == 0 {
        f64::INFINITY
    } else {
        f64::from_bits((field + tz - 52) << 52)
    }
}

/// The magnitudes of one row of A or column of B, as far as its scale needs them: the
/// largest and the least non-zero, on their bits (which order as the magnitudes do, ∞ and NaN
/// above every finite value; zero wraps to the top in the least non-zero one).
#[derive(Clone, Copy)]
struct Extent {
    max: u64,
    least: u64,
}

impl Default for Extent {
    fn default() -> Self {
        Extent {
            max: 0,
            least: u64::MAX,
        }
    }
}

impl Extent {
    #[inline(always)]
    fn of(values: impl Iterator<Item = f64>) -> Extent {
        let mut e = Extent::default();
        values.for_each(|x| e.add(x));
        e
    }

    /// [`Extent::of`] a slice, in AVX2 lanes where the CPU has them.
    fn of_line(line: &[f64]) -> Extent {
        #[cfg(target_arch = "x86_64")]
        {
            if crate::arch::has(crate::arch::Isa::Avx2Fma) {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2(line: &[f64]) -> Extent {
                    Extent::of(line.iter().copied())
                }
                // SAFETY: the CPU has AVX2 and FMA (checked above).
                return unsafe { avx2(line) };
            }
        }
        Extent::of(line.iter().copied())
    }

    #[inline(always)]
    fn add(&mut self, x: f64) {
        let bits = x.to_bits() & !(1u64 << 63);
        self.max = self.max.max(bits);
        self.least = self.least.min(bits.wrapping_sub(1));
    }

    /// The scale exponent e (the largest magnitude times 2^e in [1, 2); 0 when every value
    /// is zero); `None` when a value is not finite, when |e| > 1000 (far outside the formats
    /// the fast path takes), or when a non-zero value scaled would fall below 2^-62 (its
    /// products could underflow `f32`). Scaling by 2^e is then exact and monotone, so the
    /// least non-zero magnitude decides for all.
    fn exponent(&self) -> Option<i32> {
        if self.max >= f64::INFINITY.to_bits() {
            return None;
        }
        // ⌊log₂ max⌋ from the bits: the unbiased exponent of a normal value, the position of
        // the leading bit of a subnormal one.
        let e = match (self.max >> 52) as i32 {
            _ if self.max == 0 => 0,
            0 => 1074 - (63 - self.max.leading_zeros() as i32),
            field => 1023 - field,
        };
        if e.abs() > 1000 {
            return None;
        }
        (self.least == u64::MAX || f64::from_bits(self.least + 1) * 2f64.powi(e) >= 2f64.powi(-62))
            .then_some(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bounds::reduction::lowest_bit;
    use crate::engine::SplitMix64;

    #[test]
    fn the_branchless_lowest_bit_is_the_lowest_bit_on_scaled_values() {
        let mut g = SplitMix64::for_name("lowest_scaled", 0);
        assert_eq!(lowest_scaled(0.0), f64::INFINITY);
        assert_eq!(lowest_scaled(-0.0), f64::INFINITY);
        for _ in 0..100_000 {
            // Any sign and significand, exponents across [2^-62, 2), significands with
            // trailing zeros of every length.
            let e = (g.next_u64() % 64) as i32 - 62;
            let frac = g.next_u64() & ((1u64 << 52) - 1);
            let frac = frac & !((1u64 << (g.next_u64() % 53)) - 1);
            let sign = (g.next_u64() & 1) << 63;
            let x = f64::from_bits(sign | (((e + 1023) as u64) << 52) | frac);
            assert_eq!(lowest_scaled(x), lowest_bit(x), "{x:e}");
        }
    }

    #[test]
    fn the_f32_lowest_bit_is_the_f64_one_on_scaled_f32_values() {
        let mut g = SplitMix64::for_name("lowest_scaled_f32", 0);
        assert_eq!(lowest_scaled_f32(0.0), f32::INFINITY);
        assert_eq!(lowest_scaled_f32(-0.0), f32::INFINITY);
        for _ in 0..100_000 {
            // FP32 values across [2^-62, 2): 23 fraction bits with trailing zeros of every
            // length, either sign.
            let e = (g.next_u64() % 64) as i32 - 62;
            let frac = (g.next_u64() as u32) & 0x007f_ffff;
            let frac = frac & !((1u32 << (g.next_u64() % 24)) - 1);
            let sign = ((g.next_u64() & 1) as u32) << 31;
            let x = f32::from_bits(sign | (((e + 127) as u32) << 23) | frac);
            assert_eq!(
                f64::from(lowest_scaled_f32(x)),
                lowest_bit(f64::from(x)),
                "{x:e}"
            );
        }
    }

    /// The definition: every value finite, the largest magnitude times 2^e in [1, 2) with
    /// |e| ≤ 1000, every non-zero magnitude times 2^e at least 2^-62.
    fn exponent_oracle(values: &[f64]) -> Option<i32> {
        if values.iter().any(|x| !x.is_finite()) {
            return None;
        }
        let max = values.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let e = if max == 0.0 {
            0
        } else {
            // max·2^e in [1, 2), by exact halvings and doublings.
            let (mut e, mut v) = (0i32, max);
            while v >= 2.0 {
                v /= 2.0;
                e -= 1;
            }
            while v < 1.0 {
                v *= 2.0;
                e += 1;
            }
            e
        };
        if e.abs() > 1000 {
            return None;
        }
        values
            .iter()
            .all(|&x| x == 0.0 || x.abs() * 2f64.powi(e) >= 2f64.powi(-62))
            .then_some(e)
    }

    #[test]
    fn the_scale_exponent_matches_its_definition() {
        let mut g = SplitMix64::for_name("extent", 0);
        let specials = [
            0.0,
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            f64::MIN_POSITIVE,
            5e-324,
            f64::MAX,
            1.0,
        ];
        for case in 0..20_000 {
            let n = 1 + (g.next_u64() % 11) as usize;
            let row: Vec<f64> = (0..n)
                .map(|_| match g.next_u64() % 4 {
                    0 => specials[(g.next_u64() % specials.len() as u64) as usize],
                    1 => g.normal() * 2f64.powi((g.next_u64() % 200) as i32 - 100),
                    _ => g.normal() * 2f64.powi((g.next_u64() % 140) as i32 - 70),
                })
                .collect();
            assert_eq!(
                Extent::of(row.iter().copied()).exponent(),
                exponent_oracle(&row),
                "case {case}: {row:?}"
            );
        }
    }
}

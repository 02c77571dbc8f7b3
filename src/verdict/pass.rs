//! The comparison pass: one sweep over a pair of tensors gathering the sums and maxima of a
//! verdict, in 8 lanes (element i into lane i mod 8, each lane summed in index order, lanes
//! combined pairwise), so that the result is fixed bit for bit whatever the instruction set,
//! and the fast path (AVX2 where the CPU has it) is proven identical to the plain one.

use crate::format::Format;

/// Position of a value on its format's ordered grid (sign-magnitude bit pattern → integer).
fn ordinal(format: Format, x: f64) -> Option<i128> {
    let bits = match format {
        // Exact: the value is an F32 (or BF16, the top half of its F32 pattern).
        Format::F32 => i128::from((x as f32).to_bits()),
        Format::BF16 => i128::from((x as f32).to_bits() >> 16),
        _ => format.encode(x).ok()? as i128,
    };
    let width = format.bit_width();
    let sign = 1i128 << (width - 1);
    Some(if bits & sign != 0 {
        -(bits & (sign - 1))
    } else {
        bits
    })
}

/// Everything one comparison pass gathers. Sums run in 8 lanes (element i goes to lane i mod
/// 8, each lane summed in index order, lanes combined pairwise at the end), which fixes the
/// result bit for bit and lets the fast path use vector instructions.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct PassStats {
    pub d2: f64,
    pub r2: f64,
    pub rmax: f64,
    pub max_abs: f64,
    pub max_ulp: u64,
    pub nonfinite_mismatches: usize,
    pub first_nonfinite: Option<usize>,
}

fn combine_lanes(l: [f64; 8]) -> f64 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

fn ulp_distance(rf: Format, cf: Format, r: f64, c: f64) -> u64 {
    match (ordinal(rf, r), ordinal(cf, c)) {
        (Some(a), Some(b)) if rf == cf => (a - b).unsigned_abs() as u64,
        _ => u64::MAX,
    }
}

/// The comparison pass, written plainly: one loop, a branch per element. Non-finite pairs are
/// left out of the sums (identical NaN/NaN or equal infinities agree; anything else is a
/// mismatch); the ulp distance is taken over the differing finite pairs.
#[cfg(test)]
pub(crate) fn pass_simple(r: &[f64], c: &[f64], rf: Format, cf: Format) -> PassStats {
    let mut st = PassStats::default();
    let (mut d2, mut r2) = ([0.0f64; 8], [0.0f64; 8]);
    for (i, (&a, &b)) in r.iter().zip(c).enumerate() {
        if !(a.is_finite() && b.is_finite()) {
            if !((a.is_nan() && b.is_nan()) || a == b) {
                st.nonfinite_mismatches += 1;
                st.first_nonfinite.get_or_insert(i);
            }
            continue;
        }
        let d = b - a;
        d2[i % 8] += d * d;
        r2[i % 8] += a * a;
        st.rmax = st.rmax.max(a.abs());
        st.max_abs = st.max_abs.max(d.abs());
        if d != 0.0 {
            st.max_ulp = st.max_ulp.max(ulp_distance(rf, cf, a, b));
        }
    }
    st.d2 = combine_lanes(d2);
    st.r2 = combine_lanes(r2);
    st
}

/// [`pass_simple`] in two loops: a branch-free one over 8-element blocks (sums, maxima, and
/// flags for "some pair differs" and "some value is not finite") that compiles to vector
/// instructions, then, only when needed, a scalar scan for ulp distances and non-finite
/// mismatches. Bit-identical to [`pass_simple`] (property test `fast_pass_is_the_simple_pass`).
/// Compiled for AVX2 when the CPU has it (the same operations: IEEE adds, multiplies, maxima
/// and conversions give identical results on any instruction set).
#[cfg(test)]
pub(crate) fn pass_fast(r: &[f64], c: &[f64], rf: Format, cf: Format) -> PassStats {
    let mut pass = ComparePass::new(rf, cf);
    pass.feed(r, c);
    pass.finish()
}

/// The comparison pass over a pair of tensors fed in pieces, in order: every piece but the
/// last must hold a multiple of 8 pairs, so each lane keeps summing its elements in index
/// order across pieces and the result is that of one piece, bit for bit (see [`pass_fast`]).
/// A stored tensor is compared this way a decoded block at a time.
pub(crate) struct ComparePass {
    acc: Lanes,
    rf: Format,
    cf: Format,
    /// F32 and BF16 ulp distances come from the lane loop; other formats need a scan.
    in_loop: bool,
    /// Pairs fed so far.
    seen: usize,
    /// The scalar scans' findings.
    scanned: PassStats,
}

impl ComparePass {
    /// A pass comparing values of `rf` (reference) with values of `cf` (candidate).
    pub(crate) fn new(rf: Format, cf: Format) -> ComparePass {
        ComparePass {
            acc: Lanes::default(),
            rf,
            cf,
            in_loop: matches!(
                (rf, cf),
                (Format::F32, Format::F32) | (Format::BF16, Format::BF16)
            ),
            seen: 0,
            scanned: PassStats::default(),
        }
    }

    /// The next pairs (the shorter slice's length of them).
    pub(crate) fn feed(&mut self, r: &[f64], c: &[f64]) {
        let n = r.len().min(c.len());
        debug_assert!(
            n == 0 || self.seen % 8 == 0,
            "pieces before the last hold 8k pairs"
        );
        let (r, c) = (&r[..n], &c[..n]);
        let nonfinite = lanes_dispatch(&mut self.acc, r, c, self.rf, self.cf);
        // Ulp distances of other formats once some pair differed (this piece or an earlier
        // one: the scan then runs on every later piece); non-finite pairs of this piece.
        let differs = !self.in_loop && self.acc.dmax.iter().any(|&d| d > 0.0);
        if differs || nonfinite {
            let st = &mut self.scanned;
            for (i, (&a, &b)) in r.iter().zip(c).enumerate() {
                if a.is_finite() && b.is_finite() {
                    if a != b && !self.in_loop {
                        st.max_ulp = st.max_ulp.max(ulp_distance(self.rf, self.cf, a, b));
                    }
                } else if !((a.is_nan() && b.is_nan()) || a == b) {
                    st.nonfinite_mismatches += 1;
                    st.first_nonfinite.get_or_insert(self.seen + i);
                }
            }
        }
        self.seen += n;
    }

    /// Combine the lanes.
    pub(crate) fn finish(self) -> PassStats {
        let acc = &self.acc;
        let max = |l: &[f64; 8]| l.iter().fold(0.0f64, |m, &x| m.max(x));
        PassStats {
            d2: combine_lanes(acc.d2),
            r2: combine_lanes(acc.r2),
            rmax: max(&acc.rmax),
            max_abs: max(&acc.dmax),
            max_ulp: (acc.umax.iter().copied().max().unwrap_or(0) as u64).max(self.scanned.max_ulp),
            nonfinite_mismatches: self.scanned.nonfinite_mismatches,
            first_nonfinite: self.scanned.first_nonfinite,
        }
    }
}

/// The lane loop over one piece, continuing `acc`, on the best instruction set; whether the
/// piece holds a non-finite value.
fn lanes_dispatch(acc: &mut Lanes, r: &[f64], c: &[f64], rf: Format, cf: Format) -> bool {
    crate::arch::dispatch!(
        // SAFETY: `dispatch!` runs this only on a CPU with AVX2.
        Avx2 => unsafe { lanes_avx2(acc, r, c, rf, cf) },
        lanes_plain(acc, r, c, rf, cf),
    )
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn lanes_avx2(acc: &mut Lanes, r: &[f64], c: &[f64], rf: Format, cf: Format) -> bool {
    match (rf, cf) {
        (Format::F32, Format::F32) => pass_avx2::<true, 0>(acc, r, c),
        (Format::BF16, Format::BF16) => pass_avx2::<true, 16>(acc, r, c),
        _ => pass_avx2::<false, 0>(acc, r, c),
    }
}

/// The lane loop of [`lanes_plain`] in AVX2 intrinsics: lanes 0–3 and 4–7 of each sum in
/// two registers (loaded from `acc` and stored back), the same IEEE operations in the same
/// order per lane (x − x = 0 tests finiteness; masks replace the selects; `max_pd(m, x)` is
/// `if x > m { x } else { m }` for the non-negative, non-NaN values here). The ulp distance
/// runs on 8 `f32` patterns at once: |mag_a − mag_b| for equal signs, mag_a + mag_b for
/// opposite ones (below 2^32 for finite values, so u32 lanes hold it), the BF16 distance being
/// the F32 one over 2^16 (BF16 values have 16 zero low bits). The tail of fewer than 8
/// elements goes through [`lane`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn pass_avx2<const ULP: bool, const SH: u32>(acc: &mut Lanes, r: &[f64], c: &[f64]) -> bool {
    use std::arch::x86_64::*;
    let n = r.len().min(c.len());
    let blocks = n / 8 * 8;
    let zero = _mm256_setzero_pd();
    let abs = _mm256_castsi256_pd(_mm256_set1_epi64x(i64::MAX));
    let mag32 = _mm256_set1_epi32(i32::MAX);
    let load = |l: &[f64; 8]| {
        // SAFETY: reads 4 f64 at offsets 0 and 4 of an 8-element array.
        unsafe {
            [
                _mm256_loadu_pd(l.as_ptr()),
                _mm256_loadu_pd(l.as_ptr().add(4)),
            ]
        }
    };
    let (mut d2, mut r2, mut rmax, mut dmax) = (
        load(&acc.d2),
        load(&acc.r2),
        load(&acc.rmax),
        load(&acc.dmax),
    );
    let mut all_finite = _mm256_castsi256_pd(_mm256_set1_epi64x(-1));
    let mut umax = _mm256_setzero_si256();
    let (rp, cp) = (r.as_ptr(), c.as_ptr());
    for i in (0..blocks).step_by(8) {
        let mut aa = [zero; 2];
        let mut bb = [zero; 2];
        for h in 0..2 {
            // SAFETY: i + 8 ≤ blocks ≤ the length of both slices.
            let (a, b) = unsafe {
                (
                    _mm256_loadu_pd(rp.add(i + 4 * h)),
                    _mm256_loadu_pd(cp.add(i + 4 * h)),
                )
            };
            let fin = _mm256_cmp_pd::<_CMP_ORD_Q>(_mm256_sub_pd(a, a), _mm256_sub_pd(b, b));
            all_finite = _mm256_and_pd(all_finite, fin);
            let d = _mm256_and_pd(_mm256_sub_pd(b, a), fin);
            let a = _mm256_and_pd(a, fin);
            d2[h] = _mm256_add_pd(d2[h], _mm256_mul_pd(d, d));
            r2[h] = _mm256_add_pd(r2[h], _mm256_mul_pd(a, a));
            rmax[h] = _mm256_max_pd(rmax[h], _mm256_and_pd(a, abs));
            dmax[h] = _mm256_max_pd(dmax[h], _mm256_and_pd(d, abs));
            aa[h] = a;
            bb[h] = _mm256_and_pd(b, fin);
        }
        if ULP {
            let pa = _mm256_castps_si256(_mm256_set_m128(
                _mm256_cvtpd_ps(aa[1]),
                _mm256_cvtpd_ps(aa[0]),
            ));
            let pb = _mm256_castps_si256(_mm256_set_m128(
                _mm256_cvtpd_ps(bb[1]),
                _mm256_cvtpd_ps(bb[0]),
            ));
            let (ma, mb) = (_mm256_and_si256(pa, mag32), _mm256_and_si256(pb, mag32));
            let opposite = _mm256_srai_epi32::<31>(_mm256_xor_si256(pa, pb));
            let dist = _mm256_blendv_epi8(
                _mm256_abs_epi32(_mm256_sub_epi32(ma, mb)),
                _mm256_add_epi32(ma, mb),
                opposite,
            );
            umax = _mm256_max_epu32(umax, dist);
        }
    }
    let mut u32s = [0u32; 8];
    // SAFETY: every store writes 4 f64 or 8 u32 into arrays of that many elements.
    unsafe {
        for h in 0..2 {
            _mm256_storeu_pd(acc.d2.as_mut_ptr().add(4 * h), d2[h]);
            _mm256_storeu_pd(acc.r2.as_mut_ptr().add(4 * h), r2[h]);
            _mm256_storeu_pd(acc.rmax.as_mut_ptr().add(4 * h), rmax[h]);
            _mm256_storeu_pd(acc.dmax.as_mut_ptr().add(4 * h), dmax[h]);
        }
        _mm256_storeu_si256(u32s.as_mut_ptr().cast(), umax);
    }
    for (u, &x) in acc.umax.iter_mut().zip(&u32s) {
        *u = (*u).max(i64::from(x >> SH));
    }
    let before = acc.nonfinite.iter().sum::<u64>();
    for i in blocks..n {
        lane::<ULP, SH>(acc, i % 8, r[i], c[i]);
    }
    _mm256_movemask_pd(all_finite) != 0xf || acc.nonfinite.iter().sum::<u64>() != before
}

/// Per-lane accumulators of the fast pass (all zero to start).
#[derive(Default)]
struct Lanes {
    d2: [f64; 8],
    r2: [f64; 8],
    rmax: [f64; 8],
    dmax: [f64; 8],
    umax: [i64; 8],
    nonfinite: [u64; 8],
}

const EXP_BITS: u64 = 0x7ff0_0000_0000_0000;

/// Ordinal of an F32 (SH = 0) or BF16 (SH = 16) value on its ordered grid.
#[inline(always)]
fn ord32<const SH: u32>(x: f64) -> i64 {
    let bits = (x as f32).to_bits() >> SH;
    let sign = 1u32 << (31 - SH);
    let mag = i64::from(bits & (sign - 1));
    let neg = -i64::from(bits >> (31 - SH));
    (mag ^ neg) - neg
}

/// One element into lane `l`: branch-free (selects, not jumps), so the block loop vectorizes.
#[inline(always)]
fn lane<const ULP: bool, const SH: u32>(acc: &mut Lanes, l: usize, a: f64, b: f64) {
    let finite = (a.to_bits() & EXP_BITS != EXP_BITS) & (b.to_bits() & EXP_BITS != EXP_BITS);
    let d = if finite { b - a } else { 0.0 };
    let aa = if finite { a } else { 0.0 };
    acc.d2[l] += d * d;
    acc.r2[l] += aa * aa;
    let (ab, db) = (aa.abs(), d.abs());
    acc.rmax[l] = if ab > acc.rmax[l] { ab } else { acc.rmax[l] };
    acc.dmax[l] = if db > acc.dmax[l] { db } else { acc.dmax[l] };
    acc.nonfinite[l] += u64::from(!finite);
    if ULP {
        let bb = if finite { b } else { 0.0 };
        // Signed 64-bit lanes (|distance| < 2^33): AVX2 compares signed 64-bit integers.
        let u = ord32::<SH>(aa) - ord32::<SH>(bb);
        let m = u >> 63;
        let u = (u ^ m) - m;
        acc.umax[l] = if u > acc.umax[l] { u } else { acc.umax[l] };
    }
}

#[inline(always)]
fn lanes_over<const ULP: bool, const SH: u32>(r: &[f64], c: &[f64], acc: &mut Lanes) {
    let blocks = r.len() / 8 * 8;
    for (rb, cb) in r[..blocks].chunks_exact(8).zip(c[..blocks].chunks_exact(8)) {
        for l in 0..8 {
            lane::<ULP, SH>(acc, l, rb[l], cb[l]);
        }
    }
    for i in blocks..r.len() {
        lane::<ULP, SH>(acc, i % 8, r[i], c[i]);
    }
}

/// The lane loop written for the compiler to vectorize (element i into lane i mod 8, branch-free
/// selects), continuing `acc`; whether the piece holds a non-finite value. F32 and BF16
/// ordinals are cheap bit operations on the f32 pattern and are computed here (0 for equal or
/// non-finite pairs); other formats get the scalar scan of [`ComparePass::feed`].
#[inline(always)]
fn lanes_plain(acc: &mut Lanes, r: &[f64], c: &[f64], rf: Format, cf: Format) -> bool {
    let n = r.len().min(c.len());
    let (r, c) = (&r[..n], &c[..n]);
    let before = acc.nonfinite.iter().sum::<u64>();
    match (rf, cf) {
        (Format::F32, Format::F32) => lanes_over::<true, 0>(r, c, acc),
        (Format::BF16, Format::BF16) => lanes_over::<true, 16>(r, c, acc),
        _ => lanes_over::<false, 0>(r, c, acc),
    }
    acc.nonfinite.iter().sum::<u64>() != before
}

#[cfg(test)]
mod pass_tests {
    use super::*;
    use crate::trace::stored::Stored;
    use crate::verdict::{compare_stored, compare_with_sums, Detection, PIECE};
    use proptest::prelude::*;

    fn value(pick: u8, x: f64) -> f64 {
        match pick % 16 {
            0 => f64::NAN,
            1 => f64::INFINITY,
            2 => f64::NEG_INFINITY,
            3 => 0.0,
            4 => -0.0,
            _ => x,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// The vectorizable comparison pass gives exactly the plain pass's numbers (bit for
        /// bit, maxima, ulp distance, non-finite mismatches and the first one's index), on
        /// pairs that agree, differ slightly, differ wildly or hold NaN/±∞/±0.
        #[test]
        fn fast_pass_is_the_simple_pass(
            pairs in prop::collection::vec((any::<u8>(), any::<u8>(), -1e3f64..1e3, 0u8..5), 0..200),
            pick in 0usize..4,
            cuts in prop::collection::vec(0usize..6, 0..6))
        {
            // F32 and BF16 take the in-loop ulp distance, F16 and F64 the scalar scan.
            let f = [Format::F32, Format::BF16, Format::F16, Format::F64][pick];
            let r: Vec<f64> = pairs.iter().map(|&(p, _, x, k)| match k {
                // An extreme value, whose negation below makes the difference overflow.
                4 => f.max_finite().copysign(x),
                _ => f.round(value(p, x), crate::Overflow::NonSaturating),
            }).collect();
            let c: Vec<f64> = pairs.iter().zip(&r).map(|(&(_, q, x, k), &a)| match k {
                0 => a,
                1 => f.round(a * (1.0 + 1e-2), crate::Overflow::NonSaturating),
                2 => f.round(value(q, x * 3.0), crate::Overflow::NonSaturating),
                3 => f.round(-a, crate::Overflow::NonSaturating),
                // Opposite extremes: the difference overflows to ±∞ between finite values.
                _ => -a,
            }).collect();
            let s = pass_simple(&r, &c, f, f);
            // In one piece, and fed in pieces of 8k pairs.
            let mut pieces = ComparePass::new(f, f);
            let mut at = 0usize;
            for k in cuts.iter().chain([&usize::MAX]) {
                let to = at.saturating_add(k.saturating_mul(8)).min(r.len());
                pieces.feed(&r[at..to], &c[at..to]);
                at = to;
            }
            for q in [pass_fast(&r, &c, f, f), pieces.finish()] {
                prop_assert_eq!(s.d2.to_bits(), q.d2.to_bits());
                prop_assert_eq!(s.r2.to_bits(), q.r2.to_bits());
                prop_assert_eq!(s.rmax.to_bits(), q.rmax.to_bits());
                prop_assert_eq!(s.max_abs.to_bits(), q.max_abs.to_bits());
                prop_assert_eq!(s.max_ulp, q.max_ulp);
                prop_assert_eq!(s.nonfinite_mismatches, q.nonfinite_mismatches);
                prop_assert_eq!(s.first_nonfinite, q.first_nonfinite);
            }
        }

        /// Tensors compared as stored patterns, decoded a piece at a time, give the verdict
        /// and sums of the decoded tensors, on random patterns of every stored format (NaN,
        /// infinities and values whose squares overflow included) and lengths that cross
        /// pieces.
        #[test]
        fn stored_comparison_is_the_decoded_one(
            seed in any::<u64>(),
            pick in 0usize..6,
            n in prop_oneof![0usize..64, (PIECE - 9)..(2 * PIECE + 20)],
            edits in 0usize..4)
        {
            let f = [Format::F64, Format::F32, Format::F16, Format::BF16, Format::E4M3,
                Format::E5M2][pick];
            let mut g = crate::random::SplitMix64::for_name("stored-compare", seed);
            let w = crate::format::codec::element_size(f);
            let rb: Vec<u8> = (0..n * w).map(|_| g.next_u64() as u8).collect();
            let mut cb = rb.clone();
            // None, a few low bits, many bytes, every byte.
            if let Some(step) = [None, Some(997), Some(7), Some(1)][edits] {
                for i in (0..cb.len()).step_by(step) {
                    cb[i] = if step == 997 { cb[i] ^ 1 } else { g.next_u64() as u8 };
                }
            }
            let (rs, cs) = (
                Stored::new(&[n], f, rb).unwrap(),
                Stored::new(&[n], f, cb).unwrap(),
            );
            let (v1, s1) = compare_stored("x", &rs, &cs, 1.0, 0.5, Detection::default());
            let (v2, s2) = compare_with_sums("x", &rs.decode(), &cs.decode(), 1.0, 0.5, Detection::default());
            prop_assert_eq!(format!("{v1:?}"), format!("{v2:?}"));
            prop_assert_eq!(
                (s1.dn.to_bits(), s1.rn.to_bits(), s1.rmax.to_bits()),
                (s2.dn.to_bits(), s2.rn.to_bits(), s2.rmax.to_bits())
            );
        }
    }
}

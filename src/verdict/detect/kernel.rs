//! The first pass's per-element work on a row of finite pairs, in lanes (AVX2 where the CPU
//! has it).

use super::rows::{Columns, Element, RowSums};

/// The first pass's per-element work on a row of finite pairs, in lanes. One unit in the last
/// place of the stored format at m = max(|a|, |b|) is 2^⌊log₂ m⌋ (m's exponent bits), at least
/// `min_ulp` = 2^emin, times `frac` = 2^(1−p): exact, subnormal results included.
#[derive(Clone, Copy)]
pub(super) struct Kernel {
    pub(super) min_ulp: f64,
    pub(super) frac: f64,
}

/// Lanes of the row kernel's sums.
pub(super) const LANES: usize = 4;

impl Kernel {
    pub(super) fn dispatch(
        self,
        r: &[f64],
        c: &[f64],
        cols: Option<Columns<'_>>,
    ) -> Option<RowSums> {
        crate::arch::dispatch!(
            // SAFETY: `dispatch!` runs this only on a CPU with AVX2.
            Avx2 => unsafe { self.row_avx2(r, c, cols) },
            self.row(r, c, cols),
        )
    }

    /// [`Kernel::row`] in AVX2 intrinsics: the same IEEE operations in the same order per
    /// lane, so the same bits (`max_pd(m, x)` is `if m > x { m } else { x }`, as in
    /// [`Kernel::element`]); the tail of fewer than [`LANES`] elements goes through
    /// [`Kernel::element`].
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub(super) fn row_avx2(
        self,
        r: &[f64],
        c: &[f64],
        cols: Option<Columns<'_>>,
    ) -> Option<RowSums> {
        use std::arch::x86_64::*;
        let n = r.len().min(c.len());
        let (r, c) = (&r[..n], &c[..n]);
        let tail = n - n % LANES;
        let (rp, cp) = (r.as_ptr(), c.as_ptr());
        let zero = _mm256_setzero_pd();
        let (mut rr, mut nan) = (zero, zero);
        // The bits in which some pair differs (all zero: the row is equal, bit for bit).
        let mut bits = _mm256_setzero_si256();
        for i in (0..tail).step_by(LANES) {
            // SAFETY: i + LANES ≤ tail ≤ the length of both slices.
            let (a, b) = unsafe { (_mm256_loadu_pd(rp.add(i)), _mm256_loadu_pd(cp.add(i))) };
            rr = _mm256_add_pd(rr, _mm256_mul_pd(a, a));
            nan = _mm256_add_pd(
                nan,
                _mm256_add_pd(_mm256_mul_pd(a, zero), _mm256_mul_pd(b, zero)),
            );
            bits = _mm256_or_si256(
                bits,
                _mm256_xor_si256(_mm256_castpd_si256(a), _mm256_castpd_si256(b)),
            );
        }
        let lanes = |v: __m256d| {
            let mut out = [0.0f64; LANES];
            // SAFETY: stores 4 f64 into an array of 4.
            unsafe { _mm256_storeu_pd(out.as_mut_ptr(), v) };
            out
        };
        let rest = r[tail..]
            .iter()
            .zip(&c[tail..])
            .fold(0.0, |s, (a, b)| s + a * 0.0 + b * 0.0);
        if lanes(nan).iter().sum::<f64>() + rest != 0.0 {
            return None;
        }
        let rr = lanes(rr).iter().sum::<f64>() + r[tail..].iter().map(|a| a * a).sum::<f64>();
        let rms = if n > 0 { (rr / n as f64).sqrt() } else { 0.0 };
        let zero_row = rms == 0.0;
        let (floor, own) = if zero_row { (1.0, 0.0) } else { (rms, 1.0) };
        let equal = _mm256_testz_si256(bits, bits) == 1 && same_bits(&r[tail..], &c[tail..]);
        if equal && rr.is_finite() {
            return Some(self.equal_avx2(r, cols, rr, (floor, own, zero_row)));
        }
        let abs = _mm256_castsi256_pd(_mm256_set1_epi64x(i64::MAX));
        let exp = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7ff0_0000_0000_0000));
        let (min_ulp, frac) = (_mm256_set1_pd(self.min_ulp), _mm256_set1_pd(self.frac));
        let (floor_v, own_v, one) = (
            _mm256_set1_pd(floor),
            _mm256_set1_pd(own),
            _mm256_set1_pd(1.0),
        );
        let [mut x, mut y, mut dada, mut dd, mut a4, mut qs, mut qmax, mut emax] = [zero; 8];
        let (mut lq, mut ln, mut ms) = (zero, zero, zero);
        let (mut m2d, mut m3, mut m3d) = (zero, zero, zero);
        let mut mms = zero;
        let half = _mm256_set1_pd(0.5);
        // Columns: Σ dr, Σ d, Σ r², pairs, Σ q (q masked to zero on a row of zero reference).
        let q_mask = _mm256_castsi256_pd(_mm256_set1_epi64x(if zero_row { 0 } else { -1 }));
        let mut cols = cols;
        let ones = _mm256_set1_epi64x(1);
        for i in (0..tail).step_by(LANES) {
            // SAFETY: i + LANES ≤ tail ≤ the length of both slices.
            let (a, b) = unsafe { (_mm256_loadu_pd(rp.add(i)), _mm256_loadu_pd(cp.add(i))) };
            let d = _mm256_sub_pd(b, a);
            let mid = _mm256_mul_pd(_mm256_add_pd(a, b), half);
            let da = _mm256_mul_pd(d, mid);
            let mm = _mm256_mul_pd(mid, mid);
            let aa = _mm256_and_pd(a, abs);
            let m = _mm256_max_pd(aa, _mm256_and_pd(b, abs));
            let allowance = _mm256_mul_pd(_mm256_max_pd(_mm256_and_pd(m, exp), min_ulp), frac);
            let scale = _mm256_max_pd(_mm256_mul_pd(own_v, aa), floor_v);
            let inv = _mm256_div_pd(one, scale);
            let e = _mm256_mul_pd(d, inv);
            let q = _mm256_mul_pd(e, e);
            let a2 = _mm256_mul_pd(a, a);
            x = _mm256_add_pd(x, da);
            mms = _mm256_add_pd(mms, mm);
            ms = _mm256_add_pd(ms, mid);
            m2d = _mm256_add_pd(m2d, _mm256_mul_pd(mid, da));
            m3 = _mm256_add_pd(m3, _mm256_mul_pd(mid, mm));
            m3d = _mm256_add_pd(m3d, _mm256_mul_pd(mm, da));
            y = _mm256_add_pd(y, d);
            dada = _mm256_add_pd(dada, _mm256_mul_pd(da, da));
            dd = _mm256_add_pd(dd, _mm256_mul_pd(d, d));
            a4 = _mm256_add_pd(a4, _mm256_mul_pd(mm, mm));
            qs = _mm256_add_pd(qs, q);
            qmax = _mm256_max_pd(qmax, q);
            // Elements measured against their own magnitude: own·|a| ≥ floor.
            let big = _mm256_cmp_pd::<_CMP_GE_OQ>(_mm256_mul_pd(own_v, aa), floor_v);
            lq = _mm256_add_pd(lq, _mm256_and_pd(q, big));
            ln = _mm256_add_pd(ln, _mm256_and_pd(one, big));
            let over = _mm256_max_pd(_mm256_sub_pd(_mm256_and_pd(d, abs), allowance), zero);
            emax = _mm256_max_pd(emax, _mm256_div_pd(over, scale));
            if let Some(k) = cols.as_mut() {
                // SAFETY: the column slices are as long as the row (a full row of a matrix).
                unsafe {
                    let add = |p: *mut f64, v: __m256d| {
                        _mm256_storeu_pd(p, _mm256_add_pd(_mm256_loadu_pd(p), v));
                    };
                    add(k.dr.as_mut_ptr().add(i), da);
                    add(k.d.as_mut_ptr().add(i), d);
                    add(k.r2.as_mut_ptr().add(i), a2);
                    add(k.m2.as_mut_ptr().add(i), mm);
                    add(k.q.as_mut_ptr().add(i), _mm256_and_pd(q, q_mask));
                    let np = k.n.as_mut_ptr().add(i).cast::<__m256i>();
                    _mm256_storeu_si256(np, _mm256_add_epi64(_mm256_loadu_si256(np), ones));
                }
            }
        }
        let mut acc = Acc {
            x: lanes(x),
            mm: lanes(mms),
            y: lanes(y),
            dada: lanes(dada),
            dd: lanes(dd),
            a4: lanes(a4),
            q: lanes(qs),
            qmax: lanes(qmax),
            emax: lanes(emax),
            lq: lanes(lq),
            ln: lanes(ln),
            ms: lanes(ms),
            m2d: lanes(m2d),
            m3: lanes(m3),
            m3d: lanes(m3d),
        };
        for j in tail..n {
            let e = self.element(&mut acc, 0, r[j], c[j], floor, own);
            if let Some(k) = cols.as_mut() {
                k.add(j, r[j], &e, !zero_row);
            }
        }
        Some(acc.sums(rr, zero_row))
    }

    /// [`Kernel::equal`] in AVX2 intrinsics: the same IEEE operations in the same order per
    /// lane as [`Kernel::row_avx2`]'s loop, on the sums an equal row does not leave at zero.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn equal_avx2(
        self,
        r: &[f64],
        cols: Option<Columns<'_>>,
        rr: f64,
        (floor, own, zero_row): (f64, f64, bool),
    ) -> RowSums {
        use std::arch::x86_64::*;
        let n = r.len();
        let tail = n - n % LANES;
        let rp = r.as_ptr();
        let zero = _mm256_setzero_pd();
        let abs = _mm256_castsi256_pd(_mm256_set1_epi64x(i64::MAX));
        let (floor_v, own_v, one) = (
            _mm256_set1_pd(floor),
            _mm256_set1_pd(own),
            _mm256_set1_pd(1.0),
        );
        let half = _mm256_set1_pd(0.5);
        let (mut mms, mut ms, mut m3, mut a4, mut ln) = (zero, zero, zero, zero, zero);
        let mut cols = cols;
        let ones = _mm256_set1_epi64x(1);
        for i in (0..tail).step_by(LANES) {
            // SAFETY: i + LANES ≤ tail ≤ the length of the slice.
            let a = unsafe { _mm256_loadu_pd(rp.add(i)) };
            let mid = _mm256_mul_pd(_mm256_add_pd(a, a), half);
            let mm = _mm256_mul_pd(mid, mid);
            let aa = _mm256_and_pd(a, abs);
            mms = _mm256_add_pd(mms, mm);
            ms = _mm256_add_pd(ms, mid);
            m3 = _mm256_add_pd(m3, _mm256_mul_pd(mid, mm));
            a4 = _mm256_add_pd(a4, _mm256_mul_pd(mm, mm));
            let big = _mm256_cmp_pd::<_CMP_GE_OQ>(_mm256_mul_pd(own_v, aa), floor_v);
            ln = _mm256_add_pd(ln, _mm256_and_pd(one, big));
            if let Some(k) = cols.as_mut() {
                // SAFETY: the column slices are as long as the row (a full row of a matrix).
                unsafe {
                    let add = |p: *mut f64, v: __m256d| {
                        _mm256_storeu_pd(p, _mm256_add_pd(_mm256_loadu_pd(p), v));
                    };
                    add(k.r2.as_mut_ptr().add(i), _mm256_mul_pd(a, a));
                    add(k.m2.as_mut_ptr().add(i), mm);
                    let np = k.n.as_mut_ptr().add(i).cast::<__m256i>();
                    _mm256_storeu_si256(np, _mm256_add_epi64(_mm256_loadu_si256(np), ones));
                }
            }
        }
        let lanes = |v: __m256d| {
            let mut out = [0.0f64; LANES];
            // SAFETY: stores 4 f64 into an array of 4.
            unsafe { _mm256_storeu_pd(out.as_mut_ptr(), v) };
            out
        };
        let mut acc = Acc {
            mm: lanes(mms),
            ms: lanes(ms),
            m3: lanes(m3),
            a4: lanes(a4),
            ln: lanes(ln),
            ..Acc::default()
        };
        self.equal_tail(&mut acc, r, tail, cols, (floor, own, zero_row));
        acc.sums(rr, zero_row)
    }

    /// The sums of a row whose candidate equals its reference bit for bit (finite, with Σr²
    /// finite), `rr` = Σr² already summed: every difference is +0, so every sum of differences
    /// stays +0 (a sum that starts at +0 and adds ±0 is +0; no product overflows, as Σr² does
    /// not) and the first pass's loop reduces to the sums of the reference — the same
    /// operations in the same lanes, so the same bits as that loop (test
    /// `an_equal_row_takes_the_general_sums`). The columns' sums of differences are left as
    /// they are (adding +0 or −0 to a column sum, which is never −0, changes nothing).
    fn equal(
        self,
        r: &[f64],
        cols: Option<Columns<'_>>,
        rr: f64,
        (floor, own, zero_row): (f64, f64, bool),
    ) -> RowSums {
        let mut acc = Acc::default();
        let n = r.len();
        let tail = n - n % LANES;
        let mut cols = cols;
        for (i, a) in r.chunks_exact(LANES).enumerate() {
            for (l, &x) in a.iter().enumerate() {
                let mid = (x + x) * 0.5;
                let mm = mid * mid;
                acc.mm[l] += mm;
                acc.ms[l] += mid;
                acc.m3[l] += mid * mm;
                acc.a4[l] += mm * mm;
                acc.ln[l] += if own * x.abs() >= floor { 1.0 } else { 0.0 };
                if let Some(k) = cols.as_mut() {
                    let j = i * LANES + l;
                    k.r2[j] += x * x;
                    k.m2[j] += mm;
                    k.n[j] += 1;
                }
            }
        }
        self.equal_tail(&mut acc, r, tail, cols, (floor, own, zero_row));
        acc.sums(rr, zero_row)
    }

    /// The elements after the last whole group of lanes of an equal row, as the general loop
    /// takes them.
    fn equal_tail(
        self,
        acc: &mut Acc,
        r: &[f64],
        tail: usize,
        mut cols: Option<Columns<'_>>,
        (floor, own, zero_row): (f64, f64, bool),
    ) {
        for (j, &x) in r.iter().enumerate().skip(tail) {
            let e = self.element(acc, 0, x, x, floor, own);
            if let Some(k) = cols.as_mut() {
                k.add(j, x, &e, !zero_row);
            }
        }
    }

    /// The row's sums, or `None` (nothing added to `cols`) if a pair is not finite.
    #[inline(always)]
    pub(super) fn row(self, r: &[f64], c: &[f64], cols: Option<Columns<'_>>) -> Option<RowSums> {
        self.row_with(r, c, cols, true)
    }

    /// [`Kernel::row`], taking equal rows by [`Kernel::equal`] only with `shortcut` (the tests
    /// compare the two ways).
    #[inline(always)]
    pub(super) fn row_with(
        self,
        r: &[f64],
        c: &[f64],
        cols: Option<Columns<'_>>,
        shortcut: bool,
    ) -> Option<RowSums> {
        let n = r.len().min(c.len());
        let (r, c) = (&r[..n], &c[..n]);
        // Σr², and Σ (a·0 + b·0), which is NaN unless every pair is finite.
        let (mut rr, mut nan) = ([0.0f64; LANES], [0.0f64; LANES]);
        for (a, b) in r.chunks_exact(LANES).zip(c.chunks_exact(LANES)) {
            for l in 0..LANES {
                rr[l] += a[l] * a[l];
                nan[l] += a[l] * 0.0 + b[l] * 0.0;
            }
        }
        let tail = n - n % LANES;
        let rest = r[tail..]
            .iter()
            .zip(&c[tail..])
            .fold(0.0, |s, (a, b)| s + a * 0.0 + b * 0.0);
        if nan.iter().sum::<f64>() + rest != 0.0 {
            return None;
        }
        let rr = rr.iter().sum::<f64>() + r[tail..].iter().map(|a| a * a).sum::<f64>();
        let rms = if n > 0 { (rr / n as f64).sqrt() } else { 0.0 };
        let zero = rms == 0.0;
        // The first pass's scale max(|rⱼ|, row rms), or 1 on a row whose reference is zero.
        let (floor, own) = if zero { (1.0, 0.0) } else { (rms, 1.0) };
        if shortcut && rr.is_finite() && same_bits(r, c) {
            return Some(self.equal(r, cols, rr, (floor, own, zero)));
        }
        let mut acc = Acc::default();
        match cols {
            Some(mut cols) => {
                let with_q = !zero;
                let chunks = r
                    .chunks_exact(LANES)
                    .zip(c.chunks_exact(LANES))
                    .zip(cols.dr.chunks_exact_mut(LANES))
                    .zip(cols.d.chunks_exact_mut(LANES))
                    .zip(cols.r2.chunks_exact_mut(LANES))
                    .zip(cols.m2.chunks_exact_mut(LANES))
                    .zip(cols.n.chunks_exact_mut(LANES))
                    .zip(cols.q.chunks_exact_mut(LANES));
                for (((((((a, b), dr), d), r2), m2), cn), q) in chunks {
                    for l in 0..LANES {
                        let e = self.element(&mut acc, l, a[l], b[l], floor, own);
                        dr[l] += e.da;
                        d[l] += e.d;
                        r2[l] += a[l] * a[l];
                        m2[l] += e.mm;
                        cn[l] += 1;
                        q[l] += if with_q { e.q } else { 0.0 };
                    }
                }
                for j in tail..n {
                    let e = self.element(&mut acc, 0, r[j], c[j], floor, own);
                    cols.add(j, r[j], &e, with_q);
                }
            }
            None => {
                for (a, b) in r.chunks_exact(LANES).zip(c.chunks_exact(LANES)) {
                    for l in 0..LANES {
                        self.element(&mut acc, l, a[l], b[l], floor, own);
                    }
                }
                for j in tail..n {
                    self.element(&mut acc, 0, r[j], c[j], floor, own);
                }
            }
        }
        Some(acc.sums(rr, zero))
    }

    #[inline(always)]
    pub(super) fn element(
        self,
        acc: &mut Acc,
        l: usize,
        a: f64,
        b: f64,
        floor: f64,
        own: f64,
    ) -> Element {
        const EXP: u64 = 0x7ff0_0000_0000_0000;
        let d = b - a;
        let mid = (a + b) * 0.5;
        let da = d * mid;
        let mm = mid * mid;
        let max = |m: f64, x: f64| if m > x { m } else { x };
        let m = max(a.abs(), b.abs());
        let allowance = max(f64::from_bits(m.to_bits() & EXP), self.min_ulp) * self.frac;
        let scale = max(own * a.abs(), floor);
        let inv = 1.0 / scale;
        let e = d * inv;
        let q = e * e;
        acc.x[l] += da;
        acc.mm[l] += mm;
        acc.ms[l] += mid;
        acc.m2d[l] += mid * da;
        acc.m3[l] += mid * mm;
        acc.m3d[l] += mm * da;
        acc.y[l] += d;
        acc.dada[l] += da * da;
        acc.dd[l] += d * d;
        acc.a4[l] += mm * mm;
        acc.q[l] += q;
        let max = |m: f64, x: f64| if m > x { m } else { x };
        acc.qmax[l] = max(acc.qmax[l], q);
        let big = if own * a.abs() >= floor { 1.0 } else { 0.0 };
        acc.lq[l] += q * big;
        acc.ln[l] += big;
        acc.emax[l] = max(acc.emax[l], max(d.abs() - allowance, 0.0) / scale);
        Element { d, da, mm, q }
    }
}

/// Whether two rows hold the same bit patterns.
fn same_bits(r: &[f64], c: &[f64]) -> bool {
    r.len() == c.len() && r.iter().zip(c).all(|(a, b)| a.to_bits() == b.to_bits())
}

/// The lanes of [`RowSums`]'s sums and maxima.
#[derive(Default)]
pub(super) struct Acc {
    pub(super) x: [f64; LANES],
    pub(super) mm: [f64; LANES],
    pub(super) y: [f64; LANES],
    pub(super) dada: [f64; LANES],
    pub(super) dd: [f64; LANES],
    pub(super) a4: [f64; LANES],
    pub(super) q: [f64; LANES],
    pub(super) qmax: [f64; LANES],
    pub(super) emax: [f64; LANES],
    pub(super) lq: [f64; LANES],
    pub(super) ln: [f64; LANES],
    pub(super) ms: [f64; LANES],
    pub(super) m2d: [f64; LANES],
    pub(super) m3: [f64; LANES],
    pub(super) m3d: [f64; LANES],
}

impl Acc {
    pub(super) fn sums(&self, rr: f64, zero: bool) -> RowSums {
        let sum = |v: &[f64; LANES]| v.iter().sum::<f64>();
        let max = |v: &[f64; LANES]| v.iter().fold(0.0f64, |m, &x| m.max(x));
        RowSums {
            rr,
            mm: sum(&self.mm),
            zero,
            x: sum(&self.x),
            y: sum(&self.y),
            dada: sum(&self.dada),
            dd: sum(&self.dd),
            a4: sum(&self.a4),
            q: sum(&self.q),
            qmax: max(&self.qmax),
            emax: max(&self.emax),
            lq: sum(&self.lq),
            ln: sum(&self.ln),
            ms: sum(&self.ms),
            m2d: sum(&self.m2d),
            m3: sum(&self.m3),
            m3d: sum(&self.m3d),
        }
    }
}

//! Exact accumulation of `f64` values and products, with one correct rounding at the end.
//!
//! [`ExactAccumulator`] is a *superaccumulator*: a fixed-point number wide enough to hold the
//! exact sum of any number (< 2^31 between renormalizations, unlimited overall) of finite `f64`
//! values and exact products of two `f64` values, with no rounding at all. It is the oracle
//! the tests measure every emulated reduction against, and the engine of the "fused" orders
//! (block FMA), where a whole block of products is added to the accumulator and rounded once.
//!
//! Representation: 136 signed 64-bit limbs, each standing for a 32-bit digit; limb `i` weighs
//! 2^(32·i − 2176). The least significant bit of an exact product of two `f64` values weighs
//! at least 2^-2148 and the most significant at most 2^2047, so every term lands well inside the
//! 4352-bit window, and carries are propagated lazily (a limb absorbs up to 2^31 digit-sized
//! additions before it could overflow). The technique is Kulisch's long accumulator
//! (Kulisch & Miranker, 1981); see `papers/formats-and-orders.md`.

use crate::format::{pow2, Format, Overflow};

const LIMBS: usize = 136;
/// Bit position (from the bottom of the window) of weight 2^0.
const OFFSET: i32 = 2176;
const DIGIT_MASK: i64 = 0xFFFF_FFFF;
const RENORMALIZE_EVERY: u32 = 1 << 30;

/// An exact sum of `f64` values and products of `f64` values.
///
/// ```
/// use ttrace::{ExactAccumulator, Format, Overflow};
/// let mut acc = ExactAccumulator::new();
/// acc.add(1e100);
/// acc.add(1.0);
/// acc.add(-1e100);
/// assert_eq!(acc.round(Format::F64, Overflow::NonSaturating), 1.0); // no cancellation loss
/// ```
#[derive(Clone)]
pub struct ExactAccumulator {
    limbs: Box<[i64; LIMBS]>,
    /// Lowest and highest limb touched since the last clear (inclusive); `lo > hi` when none.
    lo: usize,
    hi: usize,
    pending: u32,
    nan: bool,
    pos_inf: bool,
    neg_inf: bool,
    /// True while every term added so far was a negative zero (IEEE: −0 + −0 = −0).
    only_negative_zeros: bool,
    terms: u64,
}

impl Default for ExactAccumulator {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for ExactAccumulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExactAccumulator")
            .field("approx", &self.round(Format::F64, Overflow::NonSaturating))
            .field("terms", &self.terms)
            .finish()
    }
}

/// Split a finite non-zero `f64` into (integer significand, exponent of its last bit).
fn decompose(x: f64) -> (u64, i32) {
    let bits = x.to_bits() & !(1u64 << 63);
    let field = (bits >> 52) as i32;
    let frac = bits & ((1u64 << 52) - 1);
    if field == 0 {
        (frac, -1074)
    } else {
        (frac | (1u64 << 52), field - 1075)
    }
}

impl ExactAccumulator {
    /// An accumulator holding exactly zero.
    pub fn new() -> Self {
        ExactAccumulator {
            limbs: Box::new([0; LIMBS]),
            lo: LIMBS,
            hi: 0,
            pending: 0,
            nan: false,
            pos_inf: false,
            neg_inf: false,
            only_negative_zeros: true,
            terms: 0,
        }
    }

    /// Reset to exactly zero, keeping the allocation.
    pub fn clear(&mut self) {
        if self.lo <= self.hi {
            self.limbs[self.lo..=self.hi].fill(0);
        }
        self.lo = LIMBS;
        self.hi = 0;
        self.pending = 0;
        self.nan = false;
        self.pos_inf = false;
        self.neg_inf = false;
        self.only_negative_zeros = true;
        self.terms = 0;
    }

    /// Number of terms added since creation or the last [`clear`](Self::clear).
    pub fn len(&self) -> u64 {
        self.terms
    }

    /// Whether no term has been added.
    pub fn is_empty(&self) -> bool {
        self.terms == 0
    }

    fn note_special(&mut self, value: f64) -> bool {
        self.terms += 1;
        if value.is_nan() {
            self.nan = true;
            return true;
        }
        if value.is_infinite() {
            if value > 0.0 {
                self.pos_inf = true;
            } else {
                self.neg_inf = true;
            }
            self.only_negative_zeros = false;
            return true;
        }
        if !(value == 0.0 && value.is_sign_negative()) {
            self.only_negative_zeros = false;
        }
        value == 0.0
    }

    /// Add `x` exactly. NaN and infinities are remembered and decide the rounded result as in
    /// IEEE arithmetic (NaN wins; +inf and −inf together give NaN).
    pub fn add(&mut self, x: f64) {
        if self.note_special(x) {
            return;
        }
        let (m, e) = decompose(x);
        self.add_scaled(m as u128, e, x < 0.0);
    }

    /// Add the exact product `x·y` (no rounding of the product).
    pub fn add_product(&mut self, x: f64, y: f64) {
        let negative = x.is_sign_negative() != y.is_sign_negative();
        if x.is_nan()
            || y.is_nan()
            || (x.is_infinite() && y == 0.0)
            || (y.is_infinite() && x == 0.0)
        {
            self.note_special(f64::NAN);
            return;
        }
        if x.is_infinite() || y.is_infinite() {
            self.note_special(if negative {
                f64::NEG_INFINITY
            } else {
                f64::INFINITY
            });
            return;
        }
        if x == 0.0 || y == 0.0 {
            self.note_special(if negative { -0.0 } else { 0.0 });
            return;
        }
        self.terms += 1;
        self.only_negative_zeros = false;
        let (mx, ex) = decompose(x);
        let (my, ey) = decompose(y);
        self.add_scaled(mx as u128 * my as u128, ex + ey, negative);
    }

    /// Add every element of `xs` exactly.
    pub fn add_all(&mut self, xs: &[f64]) {
        for &x in xs {
            self.add(x);
        }
    }

    /// Add `m · 2^e` (m < 2^106) with the given sign.
    fn add_scaled(&mut self, m: u128, e: i32, negative: bool) {
        let pos = (e + OFFSET) as usize; // >= 2176 - 2148 > 0
        let idx = pos / 32;
        let off = pos % 32;
        let mut rest = m;
        let mut i = idx;
        while rest != 0 {
            let chunk = (rest & 0xFFFF_FFFF) as u64;
            rest >>= 32;
            let w = chunk << off; // < 2^63
            let (low, high) = ((w & 0xFFFF_FFFF) as i64, (w >> 32) as i64);
            if negative {
                self.limbs[i] -= low;
                self.limbs[i + 1] -= high;
            } else {
                self.limbs[i] += low;
                self.limbs[i + 1] += high;
            }
            i += 1;
        }
        self.lo = self.lo.min(idx);
        self.hi = self.hi.max(i);
        self.pending += 1;
        if self.pending >= RENORMALIZE_EVERY {
            self.renormalize();
        }
    }

    /// Propagate carries so that every limb but the top one is a digit in [0, 2^32).
    fn renormalize(&mut self) {
        normalize(&mut self.limbs, self.lo);
        // A negative value's borrow runs up to the top limb.
        self.hi = LIMBS - 1;
        self.pending = 0;
    }

    /// The exact sum, correctly rounded (to nearest, ties to even) to `format`, with
    /// `overflow` applied beyond its largest finite value. An exact zero is +0 unless every
    /// term was −0 (or the accumulator is empty, which gives +0).
    pub fn round(&self, format: Format, overflow: Overflow) -> f64 {
        if self.nan || (self.pos_inf && self.neg_inf) {
            return f64::NAN;
        }
        if self.pos_inf || self.neg_inf {
            let inf = if self.pos_inf {
                f64::INFINITY
            } else {
                f64::NEG_INFINITY
            };
            return format.round(inf, overflow);
        }
        let zero = if self.only_negative_zeros && self.terms > 0 {
            -0.0
        } else {
            0.0
        };
        if self.lo > self.hi {
            return zero;
        }
        let mut limbs = self.limbs.clone();
        normalize(&mut limbs, self.lo);
        let negative = limbs[LIMBS - 1] < 0;
        if negative {
            negate(&mut limbs);
        }
        // Highest non-zero digit.
        let top = match (0..LIMBS).rev().find(|&i| limbs[i] != 0) {
            Some(t) => t,
            None => return zero,
        };
        let top_bit = 32 * top as i32 + (63 - limbs[top].leading_zeros() as i32);
        let exponent = top_bit - OFFSET; // value in [2^exponent, 2^(exponent+1))
        if exponent > format.emax() {
            let inf = if negative {
                f64::NEG_INFINITY
            } else {
                f64::INFINITY
            };
            return format.round(inf, overflow);
        }
        let p = format.precision() as i32;
        let quantum_exp = exponent.max(format.emin()) - p + 1;
        let qbit = quantum_exp + OFFSET; // > 0 for every format
        let q = extract(&limbs, qbit, top_bit);
        let round_bit = qbit >= 1 && bit(&limbs, qbit - 1);
        let sticky = qbit >= 2 && any_below(&limbs, qbit - 1);
        let mut q = q;
        if round_bit && (sticky || q & 1 == 1) {
            q += 1;
        }
        let magnitude = q as f64 * pow2(quantum_exp);
        let value = if negative { -magnitude } else { magnitude };
        if magnitude == 0.0 {
            return if negative { -0.0 } else { 0.0 };
        }
        format.round(value, overflow) // exact, or the overflow policy if rounding carried past max
    }

    /// The exact sum rounded to `f64`.
    pub fn to_f64(&self) -> f64 {
        self.round(Format::F64, Overflow::NonSaturating)
    }
}

/// Propagate carries upward from limb `lo`, leaving digits in [0, 2^32) in every limb but the
/// top one, which holds the signed remainder.
fn normalize(limbs: &mut [i64; LIMBS], lo: usize) {
    let mut carry = 0i64;
    for limb in limbs[lo..LIMBS - 1].iter_mut() {
        let v = *limb + carry;
        *limb = v & DIGIT_MASK;
        carry = v >> 32;
    }
    limbs[LIMBS - 1] += carry;
}

/// Replace a normalized negative value by its magnitude (all digits in [0, 2^32)).
fn negate(limbs: &mut [i64; LIMBS]) {
    // value = sum d_i 2^(32 i), digits in [0, 2^32) but the top limb, which is signed.
    let mut borrow = 0i64;
    for (i, limb) in limbs.iter_mut().enumerate() {
        let v = -*limb - borrow; // in (-2^32 - 1, 0] below the top
        if i == LIMBS - 1 {
            *limb = v;
        } else {
            *limb = v & DIGIT_MASK;
            borrow = -(v >> 32);
        }
    }
}

fn bit(limbs: &[i64; LIMBS], pos: i32) -> bool {
    let pos = pos as usize;
    (limbs[pos / 32] >> (pos % 32)) & 1 == 1
}

fn any_below(limbs: &[i64; LIMBS], pos: i32) -> bool {
    let pos = pos as usize;
    let idx = pos / 32;
    let off = pos % 32;
    if limbs[idx] & ((1i64 << off) - 1) != 0 {
        return true;
    }
    limbs[..idx].iter().any(|&d| d != 0)
}

/// Bits `from..=to` as an integer (at most 63 bits wide); bits above the window are zero.
fn extract(limbs: &[i64; LIMBS], from: i32, to: i32) -> u64 {
    if from > to {
        return 0;
    }
    let mut q = 0u64;
    for pos in (from..=to).rev() {
        q = (q << 1) | bit(limbs, pos) as u64;
    }
    q
}

/// The sum of `xs` when `f64` adds them, in order, without any rounding: every partial sum is
/// exact (TwoSum's error term is zero, Knuth 1969 / Higham 2002 §4.3), so the result is the
/// exact sum — what [`ExactAccumulator::to_f64`] of the same terms gives, bit for bit (IEEE
/// gives −0 for a sum only when every term is −0, as the accumulator does). `None` when a step
/// rounds or a term or partial sum is not finite: the caller then takes the accumulator. A
/// partial sum of a few shards of one format almost never rounds, and this path is about two
/// hundred times faster than the long accumulator.
#[inline]
pub(crate) fn sum_if_exact(mut xs: impl Iterator<Item = f64>) -> Option<f64> {
    let mut s = xs.next()?;
    for x in xs {
        let t = s + x;
        // TwoSum: t − (s + x) exactly; zero iff t is the exact sum.
        let bb = t - s;
        let err = (s - (t - bb)) + (x - bb);
        if err != 0.0 || !t.is_finite() {
            return None;
        }
        s = t;
    }
    s.is_finite().then_some(s)
}

/// The exact sum of `xs`, correctly rounded to `f64`.
pub fn exact_sum(xs: &[f64]) -> f64 {
    let mut acc = ExactAccumulator::new();
    acc.add_all(xs);
    acc.to_f64()
}

/// The exact sum Σ|xᵢ|, correctly rounded to `f64` (the scale of Higham's summation bounds).
pub fn exact_sum_abs(xs: &[f64]) -> f64 {
    let mut acc = ExactAccumulator::new();
    for &x in xs {
        acc.add(x.abs());
    }
    acc.to_f64()
}

/// The exact dot product Σ xᵢ·yᵢ, correctly rounded to `f64`.
///
/// Returns [`Error::LengthMismatch`](crate::Error::LengthMismatch) when the lengths differ.
pub fn exact_dot(x: &[f64], y: &[f64]) -> crate::Result<f64> {
    if x.len() != y.len() {
        return Err(crate::Error::LengthMismatch {
            what: "exact_dot",
            left: x.len(),
            right: y.len(),
        });
    }
    let mut acc = ExactAccumulator::new();
    for (&a, &b) in x.iter().zip(y) {
        acc.add_product(a, b);
    }
    Ok(acc.to_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Terms of partial sums as shards hold them: a format's grid at nearby exponents (the
    /// fast path's case), or anywhere in f64 (where it must step aside), with signed zeros,
    /// subnormals, the extremes and non-finite values.
    fn term() -> impl Strategy<Value = f64> {
        prop_oneof![
            4 => (-512i32..512, -12i32..12).prop_map(|(m, e)| m as f64 * 2f64.powi(e)),
            2 => (any::<bool>(), 0u64..(1 << 52), -1074i32..1023).prop_map(|(neg, f, e)| {
                let v = (1.0 + f as f64 / (1u64 << 52) as f64) * 2f64.powi(e.max(-1022));
                if neg { -v } else { v }
            }),
            1 => prop::sample::select(vec![
                0.0, -0.0, f64::MAX, -f64::MAX, f64::from_bits(1), -f64::from_bits(3),
                f64::INFINITY, f64::NEG_INFINITY, f64::NAN,
            ]),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]
        /// Whenever the f64 path answers, it is the long accumulator's result bit for bit.
        #[test]
        fn the_fast_sum_is_the_exact_sum_whenever_it_answers(
            xs in prop::collection::vec(term(), 1..9),
        ) {
            let mut acc = ExactAccumulator::new();
            xs.iter().for_each(|&x| acc.add(x));
            if let Some(s) = sum_if_exact(xs.iter().copied()) {
                prop_assert_eq!(s.to_bits(), acc.to_f64().to_bits(), "{:?}", xs);
            }
        }
    }

    #[test]
    fn the_fast_sum_answers_exact_sums_and_steps_aside_otherwise() {
        let got = |xs: &[f64]| sum_if_exact(xs.iter().copied()).map(f64::to_bits);
        assert_eq!(got(&[-0.0, -0.0]), Some((-0.0f64).to_bits()));
        assert_eq!(got(&[-0.0, 0.0]), Some(0.0f64.to_bits()));
        assert_eq!(got(&[1.5, -1.5]), Some(0.0f64.to_bits()));
        assert_eq!(got(&[0.375, 1.25, -2.0]), Some((-0.375f64).to_bits()));
        assert_eq!(got(&[1.0, 2f64.powi(-60)]), None);
        assert_eq!(got(&[f64::MAX, f64::MAX]), None);
        assert_eq!(got(&[1.0, f64::NAN]), None);
        assert_eq!(got(&[f64::INFINITY, 1.0]), None);
        assert_eq!(got(&[]), None);
    }
}

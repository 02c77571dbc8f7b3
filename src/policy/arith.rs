//! Scalar arithmetic of one op under a policy: every operation rounded once, correctly, to the
//! accumulator format, and a final rounding to the output format.
//!
//! Conventions (stated once here, relied on by every op and by the hand-composed tests):
//! * `ra(x)`: round an exact value to the accumulator format A; `ro(x)`: to the output format.
//! * `add`, `sub`: the exact sum rounded once to A ([`Format::add_rounded`]).
//! * `mul`: the exact product rounded once to A (split with an FMA when it is not exact in
//!   `f64`).
//! * `div`: computed in `f64` (correctly rounded) and rounded to A; for operands of at
//!   most p ≤ 25 bits and A of p ≤ 25 bits this double rounding is innocuous (Figueroa 1995),
//!   so the result is the correctly rounded quotient; for A = F64 it is native.
//! * `exp`, `ln`: the `f64` libm value rounded to A. libm is faithful (error < 1 ulp of
//!   `f64`), so for A narrower than `f64` the result is the correctly rounded value except in
//!   the rare cases where the exact value lies within 2^-53 relative of a midpoint of A.

use crate::format::{Format, Overflow};

/// Rounding context of one op.
#[derive(Debug, Clone, Copy)]
pub struct Arith {
    /// The accumulator format every intermediate is rounded to.
    pub acc: Format,
    /// The output format.
    pub out: Format,
    /// What a rounding does beyond the format's range.
    pub ov: Overflow,
}

impl Arith {
    /// The context of accumulator `acc`, output `out` and overflow policy `ov`.
    pub fn new(acc: Format, out: Format, ov: Overflow) -> Arith {
        Arith { acc, out, ov }
    }

    /// `x` rounded to the accumulator.
    #[inline]
    pub fn ra(&self, x: f64) -> f64 {
        self.acc.round(x, self.ov)
    }

    /// `x` rounded to the output format.
    #[inline]
    pub fn ro(&self, x: f64) -> f64 {
        self.out.round(x, self.ov)
    }

    /// a + b, rounded once to the accumulator.
    #[inline]
    pub fn add(&self, a: f64, b: f64) -> f64 {
        self.acc.add_rounded(a, b, self.ov)
    }

    /// a − b, rounded once to the accumulator.
    #[inline]
    pub fn sub(&self, a: f64, b: f64) -> f64 {
        self.acc.add_rounded(a, -b, self.ov)
    }

    /// a·b, rounded once to the accumulator (exactly computed first).
    #[inline]
    pub fn mul(&self, a: f64, b: f64) -> f64 {
        let p = a * b;
        if self.acc == Format::F64 || !p.is_finite() {
            return self.ra(p);
        }
        // Exact in f64 when both operands have at most 26 significant bits (always the case for
        // values of formats up to F32); otherwise split with an FMA.
        if fits_26_bits(a) && fits_26_bits(b) {
            self.ra(p)
        } else {
            self.acc.add_rounded(p, a.mul_add(b, -p), self.ov)
        }
    }

    /// a / b: the `f64` quotient rounded to the accumulator.
    #[inline]
    pub fn div(&self, a: f64, b: f64) -> f64 {
        self.ra(a / b)
    }

    /// exp(a) in `f64`, rounded to the accumulator.
    #[inline]
    pub fn exp(&self, a: f64) -> f64 {
        self.ra(a.exp())
    }

    /// ln(a) in `f64`, rounded to the accumulator.
    #[inline]
    pub fn ln(&self, a: f64) -> f64 {
        self.ra(a.ln())
    }
}

/// Whether `x` has at most 26 significant bits (so a product of two such is exact in f64).
#[inline]
fn fits_26_bits(x: f64) -> bool {
    x.to_bits() & ((1u64 << 27) - 1) == 0 || !x.is_normal()
}

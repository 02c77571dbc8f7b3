//! Correctly rounded conversion of decimal text to any [`Format`], without double rounding.
//!
//! Parsing text to `f64` and then rounding to a narrow format rounds twice, and gives a wrong
//! answer when the decimal lies just off a midpoint of the narrow format but its nearest
//! `f64` is that midpoint (e.g. `"1.00390625000000000001"` in BF16). [`Format::round_decimal`]
//! detects exactly that case and settles it by comparing the decimal with the `f64` midpoint
//! in exact integer arithmetic.

use std::cmp::Ordering;

use crate::error::{Error, Result};
use crate::format::{Format, Overflow};

/// A non-negative arbitrary-precision integer, little-endian base 2^32 (just enough for
/// exact comparisons of a decimal with a binary number).
#[derive(Debug, Clone, PartialEq, Eq)]
struct BigNat(Vec<u32>);

impl BigNat {
    fn from_u64(v: u64) -> Self {
        let mut n = BigNat(vec![v as u32, (v >> 32) as u32]);
        n.trim();
        n
    }

    fn trim(&mut self) {
        while self.0.last() == Some(&0) {
            self.0.pop();
        }
    }

    fn mul_small(&mut self, f: u32) {
        let mut carry = 0u64;
        for d in self.0.iter_mut() {
            let v = *d as u64 * f as u64 + carry;
            *d = v as u32;
            carry = v >> 32;
        }
        if carry != 0 {
            self.0.push(carry as u32);
        }
    }

    fn add_small(&mut self, a: u32) {
        let mut carry = a as u64;
        for d in self.0.iter_mut() {
            if carry == 0 {
                break;
            }
            let v = *d as u64 + carry;
            *d = v as u32;
            carry = v >> 32;
        }
        if carry != 0 {
            self.0.push(carry as u32);
        }
    }

    fn mul_pow(&mut self, base: u32, mut exp: u64) {
        while exp > 0 {
            let step = exp.min(if base == 2 { 31 } else { 9 });
            self.mul_small(base.pow(step as u32));
            exp -= step;
        }
    }

    fn cmp(&self, other: &BigNat) -> Ordering {
        self.0
            .len()
            .cmp(&other.0.len())
            .then_with(|| self.0.iter().rev().cmp(other.0.iter().rev()))
    }
}

/// The decimal digits and power of ten of a finite decimal literal: value = digits · 10^exp10.
fn parse_decimal(text: &str) -> Option<(BigNat, i64)> {
    let t = text.trim();
    let t = t.strip_prefix(['+', '-']).unwrap_or(t);
    let (mantissa, exp) = match t.find(['e', 'E']) {
        Some(i) => (&t[..i], t[i + 1..].parse::<i64>().ok()?),
        None => (t, 0),
    };
    let (int, frac) = match mantissa.find('.') {
        Some(i) => (&mantissa[..i], &mantissa[i + 1..]),
        None => (mantissa, ""),
    };
    let mut n = BigNat(Vec::new());
    for c in int.chars().chain(frac.chars()) {
        let d = c.to_digit(10)?;
        n.mul_small(10);
        n.add_small(d);
    }
    Some((n, exp.checked_sub(frac.len() as i64)?))
}

/// Compare |decimal| with |x| exactly (x finite and non-zero).
fn compare_magnitudes(text: &str, x: f64) -> Option<Ordering> {
    let (mut d, exp10) = parse_decimal(text)?;
    let bits = x.abs().to_bits();
    let field = (bits >> 52) as i64;
    let (m, e2) = if field == 0 {
        (bits & ((1 << 52) - 1), -1074)
    } else {
        ((bits & ((1 << 52) - 1)) | (1 << 52), field - 1075)
    };
    let mut b = BigNat::from_u64(m);
    // Compare d·10^exp10 with m·2^e2 after moving negative powers across.
    if exp10 >= 0 {
        d.mul_pow(10, exp10 as u64);
    } else {
        // Far beyond the range where x could be a midpoint of any format; treat as unequal.
        if -exp10 > 2000 {
            return None;
        }
        b.mul_pow(10, (-exp10) as u64);
    }
    if e2 >= 0 {
        b.mul_pow(2, e2 as u64);
    } else {
        d.mul_pow(2, (-e2) as u64);
    }
    d.trim();
    b.trim();
    Some(d.cmp(&b))
}

impl Format {
    /// Round the decimal number in `text` to this format, correctly (one rounding of the exact
    /// decimal value, ties to even), with `overflow` applied past the largest finite value.
    ///
    /// Accepts what Rust's `f64` parser accepts (`1.5`, `-2e-3`, `.5`, `inf`, `-inf`, `NaN`,
    /// case-insensitive), with surrounding white space. Anything else is
    /// [`Error::InvalidParameter`] naming the text.
    ///
    /// ```
    /// use ttrace::{Format, Overflow};
    /// // Just above the BF16 midpoint 1 + 2^-8: parsing to f64 first would give the midpoint
    /// // and round down to 1; the exact decimal is above it and rounds up.
    /// let r = Format::BF16.round_decimal("1.00390625000000000001", Overflow::NonSaturating).unwrap();
    /// assert_eq!(r, 1.0 + 2f64.powi(-7));
    /// ```
    pub fn round_decimal(self, text: &str, overflow: Overflow) -> Result<f64> {
        let trimmed = text.trim();
        let x: f64 = trimmed.parse().map_err(|_| Error::InvalidParameter {
            name: "number",
            reason: format!("'{trimmed}' is not a decimal number"),
        })?;
        if self == Format::F64 || !x.is_finite() || x == 0.0 {
            return Ok(self.round(x, overflow));
        }
        if self == Format::F32 {
            // The standard library's f32 parser rounds the exact decimal once.
            let y: f32 = trimmed.parse().map_err(|_| Error::InvalidParameter {
                name: "number",
                reason: format!("'{trimmed}' is not a decimal number"),
            })?;
            return Ok(self.round(y as f64, overflow));
        }
        let r = self.round(x, Overflow::NonSaturating);
        let half = self.ulp(x).unwrap_or(f64::INFINITY) / 2.0;
        let on_midpoint = r.is_finite() && (x - r).abs() == half;
        let unbounded_midpoint = !r.is_finite() && {
            // Past max the rounding result is ±inf/NaN; x may still sit on the midpoint
            // between max and the next (unrepresentable) grid value.
            let next = self.max_finite() + self.ulp(self.max_finite()).unwrap_or(0.0);
            x.abs() == (self.max_finite() + next) / 2.0
        };
        if !(on_midpoint || unbounded_midpoint) {
            return Ok(self.round(x, overflow));
        }
        match compare_magnitudes(trimmed, x) {
            Some(Ordering::Equal) | None => Ok(self.round(x, overflow)),
            Some(ord) => {
                // Push x a hair (far below half an f64 ulp) towards the true value; the
                // TwoSum-based rounding then breaks the tie the right way.
                let hair = x.abs() * 2f64.powi(-80);
                let tail = if ord == Ordering::Greater {
                    hair.copysign(x)
                } else {
                    -hair.copysign(x)
                };
                Ok(self.add_rounded(x, tail, overflow))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_comparison() {
        assert_eq!(compare_magnitudes("0.5", 0.5), Some(Ordering::Equal));
        assert_eq!(
            compare_magnitudes("0.50000000000000000001", 0.5),
            Some(Ordering::Greater)
        );
        assert_eq!(
            compare_magnitudes("0.49999999999999999999", 0.5),
            Some(Ordering::Less)
        );
        assert_eq!(compare_magnitudes("-1.25e2", -125.0), Some(Ordering::Equal));
        // The f64 nearest 0.001 is 0.001000000000000000020816681711721685..., above 1e-3.
        assert_eq!(compare_magnitudes("1e-3", 0.001), Some(Ordering::Less));
    }
}

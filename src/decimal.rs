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

/// Significant digits kept by [`canonical`]: more than the 767 that can decide a rounding of
/// an `f64` (or of any narrower format), the rest stood in for by one sticky digit.
const KEEP_DIGITS: usize = 800;

/// `text` as an equivalent decimal of bounded size, `±0.DDD…e±P` with at most
/// [`KEEP_DIGITS`] + 1 significant digits: leading and trailing zeros removed, the exponent
/// folded with the digit positions in checked arithmetic, digits beyond the kept ones
/// replaced by a single `1` when any of them is non-zero (a sticky digit: it keeps the value
/// on the same side of every rounding boundary). Values beyond 10^400 or below 10^−400 become
/// `1e400` / `0`, which every format rounds alike. Rust's own parser saturates explicit
/// exponents (a million digits with exponent −1,000,000 parsed as `inf`); this form never
/// reaches that. Text that is not a plain decimal (`inf`, `NaN`, garbage) is returned as is.
fn canonical(text: &str) -> std::borrow::Cow<'_, str> {
    use std::borrow::Cow;
    let (sign, t) = match text.strip_prefix('-') {
        Some(r) => ("-", r),
        None => ("", text.strip_prefix('+').unwrap_or(text)),
    };
    let (mantissa, exp) = match t.find(['e', 'E']) {
        Some(i) => (&t[..i], Some(&t[i + 1..])),
        None => (t, None),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits_ok = |d: &str| d.bytes().all(|c| c.is_ascii_digit());
    if int.len() + frac.len() == 0 || !digits_ok(int) || !digits_ok(frac) {
        return Cow::Borrowed(text);
    }
    let exp: i64 = match exp {
        None => 0,
        Some(e) => {
            let body = e.strip_prefix(['+', '-']).unwrap_or(e);
            if body.is_empty() || !digits_ok(body) {
                return Cow::Borrowed(text);
            }
            // Saturate: anything beyond ±10^15 is far outside every format's range.
            let v: i64 = body.parse().unwrap_or(i64::MAX / 4).min(i64::MAX / 4);
            if e.starts_with('-') {
                -v
            } else {
                v
            }
        }
    };
    let all = || int.bytes().chain(frac.bytes());
    let lead = all().take_while(|&c| c == b'0').count();
    let total = int.len() + frac.len();
    if lead == total {
        return Cow::Owned(format!("{sign}0"));
    }
    let trail = all().rev().take_while(|&c| c == b'0').count();
    let sig: Vec<u8> = all().skip(lead).take(total - lead - trail).collect();
    // value = 0.sig × 10^p
    let p = exp.saturating_add(int.len() as i64 - lead as i64);
    if p > 400 {
        return Cow::Owned(format!("{sign}1e400"));
    }
    if p < -400 {
        return Cow::Owned(format!("{sign}0"));
    }
    let mut kept: String = sig.iter().take(KEEP_DIGITS).map(|&c| c as char).collect();
    if sig.len() > KEEP_DIGITS && sig[KEEP_DIGITS..].iter().any(|&c| c != b'0') {
        kept.push('1');
    }
    Cow::Owned(format!("{sign}0.{kept}e{p}"))
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
        let shown = text.trim();
        let bad = || Error::InvalidParameter {
            name: "number",
            reason: format!(
                // Quoted and escaped as `io::guard::escape` does.
                "{:?} is not a decimal number",
                shown.chars().take(80).collect::<String>()
            ),
        };
        let canon = canonical(shown);
        let trimmed: &str = &canon;
        let x: f64 = trimmed.parse().map_err(|_| bad())?;
        if self == Format::F64 || !x.is_finite() || x == 0.0 {
            return Ok(self.round(x, overflow));
        }
        if self == Format::F32 {
            // The standard library's f32 parser rounds the exact decimal once.
            let y: f32 = trimmed.parse().map_err(|_| bad())?;
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

    proptest::proptest! {
        /// The bounded form parses to the same f64 and f32 as the text itself (within the
        /// exponents Rust's parser handles), including long digit strings with zeros.
        #[test]
        fn canonical_form_parses_alike(
            int in "[0-9]{0,30}",
            frac in "[0-9]{0,900}",
            exp in -350i64..350,
            neg in proptest::bool::ANY,
        ) {
            proptest::prop_assume!(!(int.is_empty() && frac.is_empty()));
            let text = format!("{}{int}.{frac}e{exp}", if neg { "-" } else { "" });
            let c = canonical(&text);
            proptest::prop_assert_eq!(
                text.parse::<f64>().unwrap().to_bits(),
                c.parse::<f64>().unwrap().to_bits()
            );
            proptest::prop_assert_eq!(
                text.parse::<f32>().unwrap().to_bits(),
                c.parse::<f32>().unwrap().to_bits()
            );
        }
    }
}

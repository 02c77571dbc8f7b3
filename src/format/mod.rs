//! Number formats and correct rounding into them.
//!
//! Every value of every supported format is exactly representable in `f64`, so an emulated
//! number is an `f64` together with the [`Format`] it belongs to. [`Format::round`] maps any
//! `f64` to the nearest value of the format (round to nearest, ties to even), with subnormals,
//! signed zeros and NaN handled as IEEE 754-2019 §4.3 and §7 (and, for the FP8 formats, the
//! OCP OFP8 v1.0 specification) prescribe, and with two overflow policies ([`Overflow`]).
//!
//! # Unit roundoff versus machine epsilon
//! Two different constants are in common use, a factor of two apart, and mixing them up is the
//! most common slip in rounding-error bounds (see `papers/formats-and-orders.md`):
//! * [`Format::unit_roundoff`] is **u = 2^-p**, the bound on the relative error of one
//!   round-to-nearest operation (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd
//!   ed., Thm 2.2). All bounds in this crate are written with u.
//! * [`Format::machine_epsilon`] is **ε = 2^(1-p)**, the distance from 1.0 to the next larger
//!   value: what `f32::EPSILON`, `torch.finfo(..).eps` and `half::bf16::EPSILON` report.
//!
//! There is deliberately no method called `eps`.

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

mod bulk;
pub(crate) mod codec;
pub(crate) mod kind;
use bulk::{bulk_16bit, round_slice_const};
pub use kind::Format;

/// What [`Format::round`] does with a value too large for the format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overflow {
    /// IEEE 754 round-to-nearest overflow: a value whose rounded magnitude exceeds the largest
    /// finite value becomes ±infinity, and an infinite input stays infinite. E4M3 has no
    /// infinity, so there the result is NaN (OCP OFP8 v1.0, conversion in non-saturating mode).
    #[default]
    NonSaturating,
    /// Clamp to ±(largest finite value); infinite inputs also become ±max finite (the
    /// `__NV_SATFINITE` behaviour of the CUDA FP8 conversions and the mode FP8 training kernels
    /// use). NaN stays NaN.
    Saturating,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Specials {
    /// All-ones exponent: infinity (zero fraction) or NaN (non-zero fraction).
    Ieee,
    /// OCP "FN": no infinity, NaN only when exponent and fraction are all ones.
    FiniteNanOnly,
}

#[derive(Debug, Clone, Copy)]
struct Params {
    /// Significand precision including the hidden bit.
    p: u32,
    exp_bits: u32,
    bias: i32,
    /// Exponent of the largest finite value.
    emax: i32,
    max_finite: f64,
    specials: Specials,
}

const SIGN_BIT: u64 = 1 << 63;
const FRAC_MASK: u64 = (1 << 52) - 1;
const HIDDEN_BIT: u64 = 1 << 52;
const EXP_MASK: u64 = 0x7FF << 52;

/// `2^k` exactly, for any `k` in `-1074..=1023`.
pub(crate) fn pow2(k: i32) -> f64 {
    debug_assert!((-1074..=1023).contains(&k));
    if k >= -1022 {
        f64::from_bits(((k + 1023) as u64) << 52)
    } else {
        f64::from_bits(1u64 << (k + 1074))
    }
}

impl Format {
    const fn params(self) -> Params {
        match self {
            Format::F64 => Params {
                p: 53,
                exp_bits: 11,
                bias: 1023,
                emax: 1023,
                max_finite: f64::MAX,
                specials: Specials::Ieee,
            },
            Format::F32 => Params {
                p: 24,
                exp_bits: 8,
                bias: 127,
                emax: 127,
                max_finite: f32::MAX as f64,
                specials: Specials::Ieee,
            },
            Format::TF32 => Params {
                p: 11,
                exp_bits: 8,
                bias: 127,
                emax: 127,
                // (2 - 2^-10) * 2^127
                max_finite: 3.4011621342146535e38,
                specials: Specials::Ieee,
            },
            Format::F16 => Params {
                p: 11,
                exp_bits: 5,
                bias: 15,
                emax: 15,
                max_finite: 65504.0,
                specials: Specials::Ieee,
            },
            Format::BF16 => Params {
                p: 8,
                exp_bits: 8,
                bias: 127,
                emax: 127,
                // (2 - 2^-7) * 2^127
                max_finite: 3.3895313892515355e38,
                specials: Specials::Ieee,
            },
            Format::E4M3 => Params {
                p: 4,
                exp_bits: 4,
                bias: 7,
                emax: 8,
                max_finite: 448.0,
                specials: Specials::FiniteNanOnly,
            },
            Format::E5M2 => Params {
                p: 3,
                exp_bits: 5,
                bias: 15,
                emax: 15,
                max_finite: 57344.0,
                specials: Specials::Ieee,
            },
        }
    }

    /// Significand precision p in bits, **including** the hidden bit (53 for F64, 24 for F32,
    /// 11 for TF32 and F16, 8 for BF16, 4 for E4M3, 3 for E5M2).
    pub const fn precision(self) -> u32 {
        self.params().p
    }

    /// Number of stored fraction (trailing significand) bits, p − 1.
    pub const fn fraction_bits(self) -> u32 {
        self.params().p - 1
    }

    /// Number of exponent bits.
    pub const fn exponent_bits(self) -> u32 {
        self.params().exp_bits
    }

    /// Total width of a bit pattern: 1 + exponent bits + fraction bits.
    pub const fn bit_width(self) -> u32 {
        1 + self.params().exp_bits + self.params().p - 1
    }

    /// Exponent bias.
    pub const fn bias(self) -> i32 {
        self.params().bias
    }

    /// Smallest normal exponent e_min = 1 − bias: the least normal value is 2^e_min.
    pub const fn emin(self) -> i32 {
        1 - self.params().bias
    }

    /// Exponent of the largest finite value (for E4M3 this is 8, one more than IEEE
    /// conventions would give, because the FN encoding uses the all-ones exponent for numbers).
    pub const fn emax(self) -> i32 {
        self.params().emax
    }

    /// Whether the format has ±infinity (all but E4M3).
    pub const fn has_infinity(self) -> bool {
        matches!(self.params().specials, Specials::Ieee)
    }

    /// **Unit roundoff u = 2^-p**: the largest relative error of one rounding to nearest in the
    /// normal range (Higham 2002, Thm 2.2). This is *half* of [`machine_epsilon`](Self::machine_epsilon).
    ///
    /// F64 2^-53, F32 2^-24, TF32 and F16 2^-11, BF16 2^-8, E4M3 2^-4, E5M2 2^-3.
    pub fn unit_roundoff(self) -> f64 {
        pow2(-(self.precision() as i32))
    }

    /// **Machine epsilon ε = 2^(1-p)**: the distance from 1.0 to the next larger value of the
    /// format; equal to 2·u. This is what `f32::EPSILON` and `torch.finfo(dtype).eps` report.
    /// Do not put it where a bound asks for u.
    pub fn machine_epsilon(self) -> f64 {
        pow2(1 - self.precision() as i32)
    }

    /// Smallest positive normal value, 2^e_min.
    pub fn min_normal(self) -> f64 {
        pow2(self.emin())
    }

    /// Smallest positive subnormal value, 2^(e_min − p + 1): also the spacing of the values
    /// in the subnormal range.
    pub fn min_subnormal(self) -> f64 {
        pow2(self.emin() - self.precision() as i32 + 1)
    }

    /// Largest finite value: (2 − 2^(1−p))·2^e_max for the IEEE-style formats, 448 for E4M3.
    pub const fn max_finite(self) -> f64 {
        self.params().max_finite
    }

    /// Higham's γ_n = n·u / (1 − n·u), written with the unit roundoff u of this format, or
    /// `None` when n·u ≥ 1 (the bound is then vacuous). Higham 2002, Lemma 3.1.
    pub fn gamma(self, n: usize) -> Option<f64> {
        let nu = n as f64 * self.unit_roundoff();
        if nu < 1.0 {
            Some(nu / (1.0 - nu))
        } else {
            None
        }
    }

    /// The spacing of the format's values at `x` (its unit in the last place): the distance
    /// between the two representable numbers that enclose |x| when |x| is not representable,
    /// or from |x| to the next larger magnitude when it is. Subnormal spacing below
    /// [`min_normal`](Self::min_normal). `None` for NaN and infinities.
    pub fn ulp(self, x: f64) -> Option<f64> {
        if !x.is_finite() {
            return None;
        }
        let a = x.abs();
        let e = if a == 0.0 {
            self.emin()
        } else {
            exponent_of(a).max(self.emin())
        };
        Some(pow2(e - self.precision() as i32 + 1))
    }

    /// Round `x` to the nearest value of this format, ties to even (IEEE 754 roundTiesToEven),
    /// with gradual underflow to subnormals and signed zeros. NaN stays NaN. What happens
    /// beyond the largest finite value is chosen by `overflow`.
    ///
    /// This is one correct rounding of the exact value `x`; rounding the result of an `f64`
    /// operation therefore rounds twice, which is harmless for one +, −, ×, ÷ or √ of operands
    /// of precision p ≤ 25 into a format of that precision (double rounding is innocuous when
    /// the intermediate format has at least 2p + 2 bits: Figueroa, ACM SIGNUM 1995), and not in
    /// general. The reductions in [`sum`](crate::sum) and [`dot`](crate::dot) take care of this.
    ///
    /// ```
    /// use ttrace::{Format, Overflow};
    /// // 1 + 2^-8 is the midpoint between BF16's 1 and 1 + 2^-7: ties go to the even one.
    /// assert_eq!(Format::BF16.round(1.0 + 2f64.powi(-8), Overflow::NonSaturating), 1.0);
    /// // E4M3 has no infinity: overflow gives NaN unless saturating.
    /// assert!(Format::E4M3.round(1000.0, Overflow::NonSaturating).is_nan());
    /// assert_eq!(Format::E4M3.round(1000.0, Overflow::Saturating), 448.0);
    /// ```
    #[inline]
    pub fn round(self, x: f64, overflow: Overflow) -> f64 {
        match self {
            Format::F64 => {
                if x.is_infinite() && overflow == Overflow::Saturating {
                    f64::MAX.copysign(x)
                } else {
                    x
                }
            }
            // A single native conversion is a correct round-to-nearest-even (IEEE 754 §5.4.2).
            Format::F32 => self.apply_overflow((x as f32) as f64, x, overflow),
            _ => {
                let r = round_to_precision(x, self.precision(), self.emin());
                self.apply_overflow(r, x, overflow)
            }
        }
    }

    /// Position of this format in [`Format::ALL`] (a dense index for per-format tables).
    pub fn index(self) -> usize {
        match self {
            Format::F64 => 0,
            Format::F32 => 1,
            Format::TF32 => 2,
            Format::F16 => 3,
            Format::BF16 => 4,
            Format::E4M3 => 5,
            Format::E5M2 => 6,
        }
    }

    /// Whether every finite value of `self` is a value of `other` (so converting is exact):
    /// p ≤ p', e_min ≥ e'_min and max ≤ max'. Infinities are not considered.
    pub fn is_subset_of(self, other: Format) -> bool {
        self.precision() <= other.precision()
            && self.emin() >= other.emin()
            && self.max_finite() <= other.max_finite()
    }

    /// The narrower of two formats when one contains the other, else `self`.
    pub fn min_with(self, other: Format) -> Format {
        if other.is_subset_of(self) {
            other
        } else {
            self
        }
    }

    /// The correctly rounded value of the exact sum `a + b` (both `f64`), in this format.
    ///
    /// Computing `a + b` in `f64` and rounding again would round twice; this uses Knuth's
    /// TwoSum to recover the exact error `e` of the `f64` sum `s` and breaks the one ambiguous
    /// case (`s` exactly halfway between two values of the format) by the sign of `e`. Requires
    /// that `a + b` does not overflow `f64`; NaN and infinities follow IEEE addition.
    #[inline]
    pub fn add_rounded(self, a: f64, b: f64, overflow: Overflow) -> f64 {
        let s = a + b;
        if self == Format::F64 || !s.is_finite() {
            return self.round(s, overflow);
        }
        // TwoSum (Møller 1965; Knuth, TAOCP vol. 2, §4.2.2): a + b = s + e exactly.
        let bb = s - a;
        let e = (a - (s - bb)) + (b - bb);
        if e == 0.0 {
            return self.round(s, overflow);
        }
        let r = round_to_precision(s, self.precision(), self.emin());
        if r == s {
            // s is on the grid and |e| <= ulp64(s)/2 is far below half the grid spacing.
            return self.apply_overflow(r, s, overflow);
        }
        let half_spacing = self.ulp(s).unwrap_or(f64::INFINITY) / 2.0;
        if (s - r).abs() != half_spacing {
            // Not a midpoint: s and s + e lie strictly on the same side of every midpoint.
            return self.apply_overflow(r, s, overflow);
        }
        // s is exactly halfway between r and its other neighbour; the true sum s + e is not.
        let other = 2.0 * s - r;
        let (away, toward) = if r.abs() > other.abs() {
            (r, other)
        } else {
            (other, r)
        };
        let pick = if (e > 0.0) == (s > 0.0) { away } else { toward };
        self.apply_overflow(pick, s, overflow)
    }

    /// Round `f32` values to this 16-bit format's bit patterns in bulk (BF16 or F16): `dst[i]`
    /// is `encode(round(src[i] as f64, overflow))` — the same value [`round`](Self::round)
    /// gives, as its pattern. Fast paths: BF16 by the round-to-nearest-even carry on the `f32`
    /// pattern, F16 by the F16C conversion instruction when the CPU has it (IEEE 754
    /// roundTiesToEven with gradual underflow, as `round`); blocks of 8 holding a NaN, or a value
    /// that saturation would change, go through the element-wise path. Errors: another format,
    /// or `dst` and `src` of different lengths.
    pub fn round_f32_to_bits(self, src: &[f32], dst: &mut [u16], overflow: Overflow) -> Result<()> {
        if !matches!(self, Format::BF16 | Format::F16) {
            return Err(Error::InvalidParameter {
                name: "format",
                reason: format!(
                    "round_f32_to_bits produces 16-bit patterns: {self} is not BF16 or F16"
                ),
            });
        }
        if src.len() != dst.len() {
            return Err(Error::LengthMismatch {
                what: "round_f32_to_bits",
                left: src.len(),
                right: dst.len(),
            });
        }
        let slow = |x: f32, o: &mut u16| -> Result<()> {
            *o = self.encode(self.round(f64::from(x), overflow))? as u16;
            Ok(())
        };
        // Magnitudes below this round to a finite value, so saturation leaves them alone: the
        // midpoint between the largest finite value and the next power (which itself rounds to
        // even, i.e. up, to infinity). BF16: 0x7f7f8000 = max + half an ulp (f32::MAX is above
        // it); F16: 65504 + 16 = 65520.
        let finite_limit = match self {
            Format::BF16 => f32::from_bits(0x7f7f_8000),
            _ => 65504.0 + 16.0,
        };
        let sat = overflow == Overflow::Saturating;
        let whole = src.len() / 8 * 8;
        let mut redo = Vec::new();
        bulk_16bit(
            self,
            &src[..whole],
            &mut dst[..whole],
            sat,
            finite_limit,
            &mut redo,
        );
        for b in redo {
            for i in b * 8..b * 8 + 8 {
                slow(src[i], &mut dst[i])?;
            }
        }
        let (si, di) = (&src[whole..], &mut dst[whole..]);
        for (x, o) in si.iter().zip(di.iter_mut()) {
            slow(*x, o)?;
        }
        Ok(())
    }

    /// Round every element of `xs` in place (see [`round`](Self::round)); bit-identical to
    /// calling `round` on each element, with the format's constants fixed at compile time.
    pub fn round_slice(self, xs: &mut [f64], overflow: Overflow) {
        let sat = overflow == Overflow::Saturating;
        match self {
            Format::F64 => {
                if sat {
                    for x in xs.iter_mut() {
                        *x = self.round(*x, overflow);
                    }
                }
            }
            Format::F32 => {
                for x in xs.iter_mut() {
                    let r = (*x as f32) as f64;
                    *x = if r.abs() <= f32::MAX as f64 {
                        r
                    } else {
                        self.apply_overflow(r, *x, overflow)
                    };
                }
            }
            Format::TF32 => round_slice_const::<11, -126>(self, xs, overflow),
            Format::F16 => round_slice_const::<11, -14>(self, xs, overflow),
            Format::BF16 => round_slice_const::<8, -126>(self, xs, overflow),
            Format::E4M3 => round_slice_const::<4, -6>(self, xs, overflow),
            Format::E5M2 => round_slice_const::<3, -14>(self, xs, overflow),
        }
    }

    #[inline]
    fn apply_overflow(self, rounded: f64, x: f64, overflow: Overflow) -> f64 {
        let max = self.max_finite();
        if rounded.abs() <= max || rounded.is_nan() {
            return rounded;
        }
        // |rounded| > max (possibly infinite, including an infinite input).
        match overflow {
            Overflow::Saturating => max.copysign(x),
            Overflow::NonSaturating => {
                if self.has_infinity() {
                    f64::INFINITY.copysign(x)
                } else {
                    f64::NAN.copysign(x)
                }
            }
        }
    }

    /// Whether `x` is exactly a value of this format (NaN counts as one; ±infinity only for
    /// formats that have it).
    pub fn is_representable(self, x: f64) -> bool {
        if x.is_nan() {
            return true;
        }
        self.round(x, Overflow::NonSaturating).to_bits() == x.to_bits()
    }

    /// Index of the first element of `xs` that is not a value of this format (NaN counts as
    /// one; infinities only where the format has them), or `None` if all are.
    pub fn first_unrepresentable(self, xs: &[f64]) -> Option<usize> {
        fn scan<const P: u32, const EMIN: i32>(f: Format, xs: &[f64]) -> Option<usize> {
            let max = f.max_finite();
            let inf_ok = f.has_infinity();
            xs.iter().position(|&x| {
                let r = round_to_precision(x, P, EMIN);
                let ok = (r.to_bits() == x.to_bits()
                    && (x.abs() <= max || (inf_ok && x.is_infinite())))
                    || x.is_nan();
                !ok
            })
        }
        match self {
            Format::F64 => None,
            Format::F32 => xs
                .iter()
                .position(|&x| ((x as f32) as f64).to_bits() != x.to_bits() && !x.is_nan()),
            Format::TF32 => scan::<11, -126>(self, xs),
            Format::F16 => scan::<11, -14>(self, xs),
            Format::BF16 => scan::<8, -126>(self, xs),
            Format::E4M3 => scan::<4, -6>(self, xs),
            Format::E5M2 => scan::<3, -14>(self, xs),
        }
    }

    /// Check that `x` is a value of this format, or say which value is not.
    pub fn check_representable(self, x: f64, what: impl FnOnce() -> String) -> Result<()> {
        if self.is_representable(x) {
            Ok(())
        } else {
            Err(Error::NotRepresentable {
                value: x,
                format: self,
                what: what(),
            })
        }
    }

    /// Encode a value of this format as its bit pattern (right-aligned in a `u64`).
    ///
    /// `x` must be exactly representable (round it first with [`round`](Self::round));
    /// otherwise [`Error::NotRepresentable`]. NaN keeps its sign and the leading fraction bits
    /// of its payload (quieted if those are all zero); in E4M3 every NaN is S.1111.111.
    /// Decoding then re-encoding any bit pattern gives the pattern back.
    pub fn encode(self, x: f64) -> Result<u64> {
        if self == Format::F64 {
            return Ok(x.to_bits());
        }
        let p = self.params();
        let frac_bits = p.p - 1;
        let bits = x.to_bits();
        let sign = (bits >> 63) << (self.bit_width() - 1);
        let exp_ones: u64 = (1 << p.exp_bits) - 1;
        if x.is_nan() {
            return Ok(match p.specials {
                Specials::FiniteNanOnly => sign | (exp_ones << frac_bits) | ((1 << frac_bits) - 1),
                Specials::Ieee => {
                    let mut payload = (bits & FRAC_MASK) >> (52 - frac_bits);
                    if payload == 0 {
                        payload = 1 << (frac_bits - 1);
                    }
                    sign | (exp_ones << frac_bits) | payload
                }
            });
        }
        self.check_representable(x, || "value to encode".to_string())?;
        if x.is_infinite() {
            return Ok(sign | (exp_ones << frac_bits));
        }
        let mag = bits & !SIGN_BIT;
        if mag == 0 {
            return Ok(sign);
        }
        // x is a non-zero f64 normal number (every narrow format's values are f64 normals).
        let e = ((mag >> 52) as i32) - 1023;
        let m53 = (mag & FRAC_MASK) | HIDDEN_BIT;
        let emin = self.emin();
        if e >= emin {
            let m = m53 >> (53 - p.p);
            let biased = (e + p.bias) as u64;
            Ok(sign | (biased << frac_bits) | (m & ((1 << frac_bits) - 1)))
        } else {
            let m = m53 >> (53 - p.p + (emin - e) as u32);
            Ok(sign | m)
        }
    }

    /// Decode a bit pattern (right-aligned in a `u64`) to its exact value.
    ///
    /// Every pattern of [`bit_width`](Self::bit_width) bits is valid; a wider one gives
    /// [`Error::BitPatternTooWide`]. NaN patterns decode to an `f64` NaN with the same sign
    /// and the fraction bits left-aligned as its payload.
    pub fn decode(self, bits: u64) -> Result<f64> {
        if self == Format::F64 {
            return Ok(f64::from_bits(bits));
        }
        let width = self.bit_width();
        if bits >> width != 0 {
            return Err(Error::BitPatternTooWide { bits, format: self });
        }
        let p = self.params();
        let frac_bits = p.p - 1;
        let negative = (bits >> (width - 1)) & 1 == 1;
        let exp = (bits >> frac_bits) & ((1 << p.exp_bits) - 1);
        let frac = bits & ((1 << frac_bits) - 1);
        let exp_ones: u64 = (1 << p.exp_bits) - 1;
        let f64_sign = if negative { SIGN_BIT } else { 0 };
        let is_nan = match p.specials {
            Specials::Ieee => exp == exp_ones && frac != 0,
            Specials::FiniteNanOnly => exp == exp_ones && frac == (1 << frac_bits) - 1,
        };
        if is_nan {
            return Ok(f64::from_bits(
                f64_sign | EXP_MASK | (frac << (52 - frac_bits)),
            ));
        }
        if p.specials == Specials::Ieee && exp == exp_ones {
            return Ok(f64::from_bits(f64_sign | EXP_MASK));
        }
        let magnitude = if exp == 0 {
            frac as f64 * self.min_subnormal()
        } else {
            ((1u64 << frac_bits) | frac) as f64 * pow2(exp as i32 - p.bias - frac_bits as i32)
        };
        Ok(if negative { -magnitude } else { magnitude })
    }

    /// The constants of this format as a serializable record (for tables and `--json`).
    pub fn info(self) -> FormatInfo {
        FormatInfo {
            name: self.name(),
            bits: self.bit_width(),
            precision: self.precision(),
            exponent_bits: self.exponent_bits(),
            fraction_bits: self.fraction_bits(),
            bias: self.bias(),
            emin: self.emin(),
            emax: self.emax(),
            unit_roundoff: self.unit_roundoff(),
            machine_epsilon: self.machine_epsilon(),
            min_subnormal: self.min_subnormal(),
            min_normal: self.min_normal(),
            max_finite: self.max_finite(),
            has_infinity: self.has_infinity(),
        }
    }
}

/// Unbiased binary exponent of a positive finite non-zero `f64` (floor(log2 a)).
pub(crate) fn exponent_of(a: f64) -> i32 {
    let bits = a.to_bits() & !SIGN_BIT;
    let field = (bits >> 52) as i32;
    if field == 0 {
        // f64 subnormal: position of the leading one.
        let lz = (bits & FRAC_MASK).leading_zeros() as i32; // >= 12
        -1022 - (lz - 11)
    } else {
        field - 1023
    }
}

/// Round `x` to `p` significant bits with gradual underflow below 2^`emin`, ties to even,
/// ignoring any upper exponent limit (the caller applies the overflow policy). Requires
/// `p < 53` and `emin >= -1021`; NaN and infinities are returned unchanged.
#[inline]
pub(crate) fn round_to_precision(x: f64, p: u32, emin: i32) -> f64 {
    let bits = x.to_bits();
    let sign = bits & SIGN_BIT;
    let mag = bits & !SIGN_BIT;
    if mag >= EXP_MASK {
        return x; // NaN or infinity
    }
    let field = (mag >> 52) as i32;
    if field == 0 {
        // Zero or f64 subnormal: below half the smallest subnormal of every narrower format.
        return f64::from_bits(sign);
    }
    let e = field - 1023;
    if e >= emin {
        // Normal result: round the f64 pattern itself; a carry out of the fraction correctly
        // bumps the exponent (and may reach the infinity pattern, which is an overflow).
        let shift = 53 - p;
        let half_minus_one = (1u64 << (shift - 1)) - 1;
        let lsb = (mag >> shift) & 1;
        let rounded = (mag + half_minus_one + lsb) & !((1u64 << shift) - 1);
        return f64::from_bits(sign | rounded);
    }
    // Subnormal result: the quantum is 2^(emin - p + 1).
    let shift = 53 - p + (emin - e) as u32;
    if shift >= 54 {
        // |x| < 2^(e+1) <= quantum / 2: rounds to zero (an exact half goes to even zero).
        return f64::from_bits(sign);
    }
    let m = (mag & FRAC_MASK) | HIDDEN_BIT;
    let half = 1u64 << (shift - 1);
    let rem = m & ((1u64 << shift) - 1);
    let mut q = m >> shift;
    if rem > half || (rem == half && q & 1 == 1) {
        q += 1;
    }
    let magnitude = q as f64 * pow2(emin - p as i32 + 1);
    f64::from_bits(sign | magnitude.to_bits())
}

impl FromStr for Format {
    type Err = Error;

    /// Parse a format name, case-insensitively. Accepted: `f64`/`fp64`/`float64`/`double`,
    /// `f32`/`fp32`/`float32`/`float`, `tf32`, `f16`/`fp16`/`float16`/`half`,
    /// `bf16`/`bfloat16`, `e4m3`/`fp8_e4m3`/`float8_e4m3fn`, `e5m2`/`fp8_e5m2`/`float8_e5m2`.
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        Ok(match lower.as_str() {
            "f64" | "fp64" | "float64" | "double" => Format::F64,
            "f32" | "fp32" | "float32" | "float" => Format::F32,
            "tf32" => Format::TF32,
            "f16" | "fp16" | "float16" | "half" => Format::F16,
            "bf16" | "bfloat16" => Format::BF16,
            "e4m3" | "e4m3fn" | "fp8_e4m3" | "fp8e4m3" | "float8_e4m3fn" => Format::E4M3,
            "e5m2" | "fp8_e5m2" | "fp8e5m2" | "float8_e5m2" => Format::E5M2,
            _ => return Err(Error::UnknownFormat(s.to_string())),
        })
    }
}

/// The constants of one format, as printed by `ttrace formats`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FormatInfo {
    /// Short name.
    pub name: &'static str,
    /// Width of a bit pattern.
    pub bits: u32,
    /// Significand precision p, including the hidden bit.
    pub precision: u32,
    /// Exponent bits.
    pub exponent_bits: u32,
    /// Stored fraction bits (p − 1).
    pub fraction_bits: u32,
    /// Exponent bias.
    pub bias: i32,
    /// Exponent of the smallest normal value.
    pub emin: i32,
    /// Exponent of the largest finite value.
    pub emax: i32,
    /// u = 2^-p.
    pub unit_roundoff: f64,
    /// ε = 2^(1-p) = 2u.
    pub machine_epsilon: f64,
    /// Smallest positive subnormal value.
    pub min_subnormal: f64,
    /// Smallest positive normal value.
    pub min_normal: f64,
    /// Largest finite value.
    pub max_finite: f64,
    /// Whether ±infinity exists.
    pub has_infinity: bool,
}

#[cfg(test)]
mod tests;

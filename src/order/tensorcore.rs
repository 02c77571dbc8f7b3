//! The accumulation of a hardware matrix unit (GPU tensor cores): block fused multiply-adds
//! whose addends are aligned to the block's largest exponent and cut to a fixed number of
//! bits, an internal accumulator narrower than FP32, and an optional promotion of that
//! accumulator into an ordinary accumulator register every P terms.
//!
//! # The model (papers/formats-and-orders.md §5)
//! One block step adds `block` exact products t₁ … t_b to the internal accumulator c:
//! 1. the alignment exponent is e = max(exponent(c), a₁, …, a_b), where aᵢ is the *nominal*
//!    exponent of a product: e_x + e_y for a product of x = m_x·2^(e_x) and y = m_y·2^(e_y)
//!    with significands m ∈ [1, 2) (the product's significand lies in [1, 4), so |tᵢ| <
//!    2^(aᵢ + 2)), and exponent(t) for the terms of a plain sum;
//! 2. every addend (c included) is truncated toward zero to a multiple of q = 2^(e − F),
//!    F = `align_bits`;
//! 3. the truncated addends are added exactly, and the sum is rounded to `acc_bits`
//!    significant bits (toward zero, or to nearest) in FP32's exponent range.
//!
//! With a promotion interval P, the internal accumulator starts from 0 for every run of P
//! consecutive terms, and each run's result is added to the accumulator register (the
//! policy's accumulator format, round to nearest): cuBLAS's FP8 GEMMs with
//! `use_fast_accum=False`, DeepSeek-V3's "promotion to CUDA cores every N_C = 128 elements".
//!
//! Calibrated on an NVIDIA H100's `torch._scaled_mm` (`../shared/fixtures/h100`, copied to
//! `tests/fixtures/h100`): E4M3 products, block 32, F = 13, a 14-bit accumulator (8-bit
//! exponent, 13 fraction bits: "e8m13") rounding toward zero reproduce the GPU's output bit
//! for bit on every element of every case whose kernel runs K in one pass, and with P = 128
//! every `use_fast_accum=False` case (tests/gpu_fixtures.rs). Independent reports agree: 13
//! bits and truncation (huweim/emulation_sys, a `wgmma` probe), "around 14 bits"
//! (DeepSeek-V3 §3.3.2); Khattak & Mikaitis (arXiv 2512.07004) model the same features
//! (alignment width, truncation, normalisation points) for V100 to B200.

use serde::{Deserialize, Serialize};

use super::exec::{Ctx, Terms};
use crate::error::{Error, Result};
use crate::format::{exponent_of, pow2};

/// How the internal accumulator of a [`TensorCoreSum`] rounds a block's sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AccRounding {
    /// Toward zero (truncation): what Hopper's FP8 tensor cores do.
    Truncate,
    /// To nearest, ties to even.
    Nearest,
}

/// A hardware matrix unit's accumulation (module docs): blocks of `block` products added to
/// an internal accumulator of `acc_bits` significant bits after alignment to `align_bits`
/// fraction bits below the largest exponent, promoted every `promote` terms.
///
/// # Examples
///
/// ```
/// use ttrace::{Order, TensorCoreSum};
/// // Hopper's FP8 tensor cores: fast accumulation, and promoted every 128 terms.
/// let fast = Order::TensorCore(TensorCoreSum::hopper_fp8_fast());
/// assert_eq!(fast.to_string(), "tc:32:13:14:rz");
/// let precise: Order = "tc:32:13:14:rz:promote=128".parse()?;
/// assert_eq!(precise, Order::TensorCore(TensorCoreSum::hopper_fp8()));
/// # Ok::<(), ttrace::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorCoreSum {
    /// Products added in one block fused multiply-add (≥ 1; 32 for Hopper's FP8 `wgmma`).
    pub block: usize,
    /// F: fraction bits kept below the block's largest exponent (1 ..= 40).
    pub align_bits: u32,
    /// Significant bits of the internal accumulator, leading bit included (2 ..= 40).
    pub acc_bits: u32,
    /// How the internal accumulator rounds.
    pub rounding: AccRounding,
    /// Every this many terms the internal accumulator is added to the accumulator register
    /// (round to nearest) and restarts from 0; `None`: never (one run over all terms).
    pub promote: Option<usize>,
}

impl TensorCoreSum {
    /// Hopper (sm_90) FP8 tensor cores with fast accumulation (`torch._scaled_mm(…,
    /// use_fast_accum=True)`): block 32, 13 alignment bits, a 14-bit truncating accumulator,
    /// no promotion.
    pub const fn hopper_fp8_fast() -> TensorCoreSum {
        TensorCoreSum {
            block: 32,
            align_bits: 13,
            acc_bits: 14,
            rounding: AccRounding::Truncate,
            promote: None,
        }
    }

    /// Hopper FP8 tensor cores as cuBLAS runs them by default (`use_fast_accum=False`): the
    /// fast accumulator promoted into FP32 every 128 terms.
    pub const fn hopper_fp8() -> TensorCoreSum {
        TensorCoreSum {
            promote: Some(128),
            ..TensorCoreSum::hopper_fp8_fast()
        }
    }

    /// Check the parameters (ranges in the field docs).
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] naming the field out of its range.
    pub fn validate(&self) -> Result<()> {
        let bad =
            |name: &'static str, reason: String| Err(Error::InvalidParameter { name, reason });
        if self.block == 0 || self.block > 1024 {
            return bad(
                "block",
                format!(
                    "a tensor-core block holds 1 to 1024 products (got {})",
                    self.block
                ),
            );
        }
        if !(1..=40).contains(&self.align_bits) {
            return bad(
                "align",
                format!(
                    "alignment keeps 1 to 40 fraction bits (got {})",
                    self.align_bits
                ),
            );
        }
        if !(2..=40).contains(&self.acc_bits) {
            return bad(
                "acc_bits",
                format!(
                    "the internal accumulator holds 2 to 40 significant bits (got {})",
                    self.acc_bits
                ),
            );
        }
        if self.promote == Some(0) {
            return bad(
                "promote",
                "a promotion interval is at least 1 term (got 0)".into(),
            );
        }
        Ok(())
    }

    /// The text form (see [`Order`](super::Order)'s): `tc:BLOCK:ALIGN:ACC_BITS:rz|rn` with
    /// `:promote=P` when promoted.
    pub(crate) fn write(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = match self.rounding {
            AccRounding::Truncate => "rz",
            AccRounding::Nearest => "rn",
        };
        write!(
            f,
            "tc:{}:{}:{}:{r}",
            self.block, self.align_bits, self.acc_bits
        )?;
        if let Some(p) = self.promote {
            write!(f, ":promote={p}")?;
        }
        Ok(())
    }

    /// Parse the fields after `tc:` (`BLOCK:ALIGN:ACC_BITS[:rz|rn][:promote=P]`), or a preset
    /// name: `hopper-fp8` (promoted every 128) and `hopper-fp8-fast`, each optionally followed
    /// by `:promote=P`.
    pub(crate) fn parse_fields(fields: &str) -> std::result::Result<TensorCoreSum, String> {
        let mut it = fields.split(':');
        let whole = |what: &str, t: Option<&str>| -> std::result::Result<u64, String> {
            let t = t.ok_or_else(|| format!("missing {what}"))?;
            t.parse::<u64>()
                .map_err(|_| format!("{what} '{t}' is not a whole number"))
        };
        let block = whole("block size", it.next())? as usize;
        let align_bits = u32::try_from(whole("alignment bits", it.next())?)
            .map_err(|_| "alignment bits out of range".to_string())?;
        let acc_bits = u32::try_from(whole("accumulator bits", it.next())?)
            .map_err(|_| "accumulator bits out of range".to_string())?;
        let mut tc = TensorCoreSum {
            block,
            align_bits,
            acc_bits,
            rounding: AccRounding::Truncate,
            promote: None,
        };
        for rest in it {
            tc.apply_option(rest)?;
        }
        Ok(tc)
    }

    fn apply_option(&mut self, opt: &str) -> std::result::Result<(), String> {
        match opt {
            "rz" | "trunc" => self.rounding = AccRounding::Truncate,
            "rn" => self.rounding = AccRounding::Nearest,
            "promote=none" => self.promote = None,
            o => match o.strip_prefix("promote=") {
                Some(p) => {
                    self.promote =
                        Some(p.parse().map_err(|_| {
                            format!("promotion interval '{p}' is not a whole number")
                        })?)
                }
                None => {
                    return Err(format!(
                        "unknown tensor-core option '{o}' (rz, rn, promote=P)"
                    ))
                }
            },
        }
        Ok(())
    }

    /// The quantum of a block step whose largest alignment exponent is `e`: 2^(e − F).
    #[inline]
    pub(crate) fn quantum(&self, e: i32) -> f64 {
        pow2((e - self.align_bits as i32).max(-1074))
    }

    /// Round an exact block sum `s` (a multiple of the block's quantum) to the internal
    /// accumulator: `acc_bits` significant bits, spacing never below `min_spacing`.
    #[inline]
    pub(crate) fn round_internal(&self, s: f64, min_spacing: f64) -> f64 {
        if s == 0.0 || !s.is_finite() {
            return s;
        }
        let g = pow2(exponent_of(s.abs()) - self.acc_bits as i32 + 1).max(min_spacing);
        let k = s / g;
        let r = match self.rounding {
            AccRounding::Truncate => k.trunc(),
            AccRounding::Nearest => {
                let f = k.floor();
                let d = k - f;
                if d > 0.5 || (d == 0.5 && f % 2.0 != 0.0) {
                    f + 1.0
                } else {
                    f
                }
            }
        };
        r * g
    }
}

/// `t` truncated toward zero to a multiple of `q` (a power of two), exactly.
#[inline]
pub(crate) fn truncate_to(t: f64, q: f64) -> f64 {
    if !t.is_finite() {
        return t;
    }
    // Scaling by a power of two is exact: by its inverse when that is a normal number.
    if (1e-300..=1e300).contains(&q) {
        (t * (1.0 / q)).trunc() * q
    } else {
        (t / q).trunc() * q
    }
}

/// The exponent an addend is aligned by: e_x + e_y for an exact product (from its factors'
/// exponents), the exponent of the value otherwise; `None` for a zero.
#[inline]
pub(crate) fn value_exponent(v: f64) -> Option<i32> {
    if v == 0.0 || !v.is_finite() {
        None
    } else {
        Some(exponent_of(v.abs()))
    }
}

/// Execute a [`TensorCoreSum`] over `range` of `terms` (module docs), the promoted runs added
/// in the context's accumulator format.
pub(crate) fn run<T: Terms>(
    terms: &T,
    range: std::ops::Range<usize>,
    tc: &TensorCoreSum,
    ctx: Ctx,
) -> f64 {
    let len = range.end - range.start;
    let chunk = tc.promote.unwrap_or(len).max(1);
    let min_spacing = ctx.acc.min_subnormal();
    let mut register: Option<f64> = None;
    let mut start = range.start;
    while start < range.end {
        let end = (start + chunk).min(range.end);
        let mut c = 0.0f64;
        let mut b = start;
        while b < end {
            let e_b = (b + tc.block).min(end);
            let mut e = value_exponent(c);
            let mut special = 0.0;
            for i in b..e_b {
                let t = terms.term(i).hi;
                if !t.is_finite() {
                    special += t;
                }
                if let Some(a) = terms.align_exponent(i) {
                    e = Some(e.map_or(a, |x| x.max(a)));
                }
            }
            if let Some(e) = e {
                let q = tc.quantum(e);
                let mut s = truncate_to(c, q);
                for i in b..e_b {
                    let t = terms.term(i).hi;
                    if t.is_finite() {
                        s += truncate_to(t, q);
                    }
                }
                c = tc.round_internal(s + special, min_spacing);
                let limit = ctx.acc.max_finite();
                if c.abs() > limit {
                    c = ctx.acc.round(c, ctx.overflow);
                }
            } else if special != 0.0 || special.is_nan() {
                c = special;
            }
            b = e_b;
        }
        register = Some(match register {
            None => ctx.acc.round(c, ctx.overflow),
            Some(r) => ctx.acc.add_rounded(r, c, ctx.overflow),
        });
        start = end;
    }
    register.unwrap_or(0.0)
}

/// The alignment exponent of the exact product x·y: e_x + e_y (`None` when either is zero or
/// not finite).
#[inline]
pub(crate) fn product_exponent(x: f64, y: f64) -> Option<i32> {
    Some(value_exponent(x)? + value_exponent(y)?)
}

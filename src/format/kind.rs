//! The names of the formats: the enum, its list and its text, with nothing below them (the
//! error type names a format, and the arithmetic of `format` returns errors, so the names
//! sit apart from both).

use std::fmt;

use serde::{Deserialize, Serialize};

/// A binary floating-point format whose values are all exactly representable in `f64`.
///
/// | format | p | exponent bits | bias | max finite | min normal | min subnormal | ±inf |
/// |---|---|---|---|---|---|---|---|
/// | `F64` | 53 | 11 | 1023 | ≈1.80e308 | 2^-1022 | 2^-1074 | yes |
/// | `F32` | 24 | 8 | 127 | ≈3.40e38 | 2^-126 | 2^-149 | yes |
/// | `TF32` | 11 | 8 | 127 | ≈3.40e38 | 2^-126 | 2^-136 | yes |
/// | `F16` | 11 | 5 | 15 | 65504 | 2^-14 | 2^-24 | yes |
/// | `BF16` | 8 | 8 | 127 | ≈3.39e38 | 2^-126 | 2^-133 | yes |
/// | `E4M3` | 4 | 4 | 7 | 448 | 2^-6 | 2^-9 | no |
/// | `E5M2` | 3 | 5 | 15 | 57344 | 2^-14 | 2^-16 | yes |
///
/// p is the significand precision *including* the hidden bit. Sources: IEEE 754-2019 Table 3.5
/// (binary16/32/64); bfloat16 and TF32 share binary32's exponent range with 8 and 11 significand
/// bits; OCP 8-bit Floating Point Specification (OFP8) rev. 1.0, 2023, Table 1 (E4M3 in its "FN"
/// encoding: no infinities, NaN only at S.1111.111, so the all-ones exponent still holds normal
/// values up to 448 = S.1111.110; E5M2 follows IEEE conventions).
///
/// TF32 is NVIDIA's tensor-core input format (19 bits: 1 sign, 8 exponent, 10 fraction); its bit
/// patterns here are those 19 bits, right-aligned in the `u64`.
#[allow(clippy::upper_case_acronyms)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Format {
    /// IEEE 754 binary64 (double precision).
    F64,
    /// IEEE 754 binary32 (single precision).
    F32,
    /// NVIDIA TensorFloat-32: binary32's exponent range with binary16's precision.
    TF32,
    /// IEEE 754 binary16 (half precision).
    F16,
    /// bfloat16: binary32's exponent range with 8 bits of precision.
    BF16,
    /// OCP OFP8 E4M3 ("E4M3FN"): bias 7, max 448, no infinities, NaN = S.1111.111.
    E4M3,
    /// OCP OFP8 E5M2: bias 15, max 57344, ±infinity, NaN = S.11111.{01,10,11}.
    E5M2,
}

impl Format {
    /// Every supported format, widest first.
    pub const ALL: [Format; 7] = [
        Format::F64,
        Format::F32,
        Format::TF32,
        Format::F16,
        Format::BF16,
        Format::E4M3,
        Format::E5M2,
    ];

    /// Short lower-case name (`"f32"`, `"bf16"`, `"e4m3"`, ...), accepted by
    /// [`FromStr`](std::str::FromStr).
    pub const fn name(self) -> &'static str {
        match self {
            Format::F64 => "f64",
            Format::F32 => "f32",
            Format::TF32 => "tf32",
            Format::F16 => "f16",
            Format::BF16 => "bf16",
            Format::E4M3 => "e4m3",
            Format::E5M2 => "e5m2",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

//! Algorithm choices that change an op's arithmetic beyond its policy: how LayerNorm computes
//! its variance, which attention algorithm runs, and the form of GELU.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How LayerNorm computes the variance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Variance {
    /// μ = ra(Σx / n), dᵢ = ra(xᵢ − μ), var = ra(dot(d, d) / n): the stable two-pass form.
    #[default]
    TwoPass,
    /// Welford's updating form, sequential whatever the policy order: for k = 1..n,
    /// δ = ra(x_k − μ), μ = ra(μ + ra(δ / k)), M2 = ra(M2 + ra(δ · ra(x_k − μ))); var = ra(M2 / n).
    Welford,
    /// The textbook one-pass form var = ra(ra(dot(x, x) / n) − ra(μ·μ)), which cancels
    /// catastrophically when |μ| ≫ σ (Chan, Golub & LeVeque 1983).
    OnePass,
}

/// Which attention algorithm to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionImpl {
    /// Materialize S and P.
    #[default]
    Standard,
    /// Blockwise over keys with online softmax merging (flash / ring attention).
    Online {
        /// Keys per block (≥ 1).
        block: usize,
    },
}

impl std::fmt::Display for Variance {
    /// `twopass`, `welford` or `onepass`: the text [`FromStr`](std::str::FromStr) reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Variance::TwoPass => "twopass",
            Variance::Welford => "welford",
            Variance::OnePass => "onepass",
        })
    }
}

impl std::str::FromStr for Variance {
    type Err = Error;

    /// `twopass`, `welford` or `onepass`.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownName`] for any other text.
    fn from_str(s: &str) -> Result<Variance> {
        match s.trim() {
            "twopass" => Ok(Variance::TwoPass),
            "welford" => Ok(Variance::Welford),
            "onepass" => Ok(Variance::OnePass),
            other => Err(Error::UnknownName {
                kind: "variance algorithm (twopass, welford, onepass)",
                name: other.to_string(),
            }),
        }
    }
}

impl std::fmt::Display for AttentionImpl {
    /// `standard` or `online:B`: the text [`FromStr`](std::str::FromStr) reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AttentionImpl::Standard => f.write_str("standard"),
            AttentionImpl::Online { block } => write!(f, "online:{block}"),
        }
    }
}

impl std::str::FromStr for AttentionImpl {
    type Err = Error;

    /// `standard`, or `online:B` with B ≥ 1 keys per block.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidParameter`] for a block that is not a whole number ≥ 1;
    /// [`Error::UnknownName`] for any other text.
    fn from_str(s: &str) -> Result<AttentionImpl> {
        let s = s.trim();
        if s == "standard" {
            return Ok(AttentionImpl::Standard);
        }
        if let Some(b) = s.strip_prefix("online:") {
            return match b.trim().parse::<usize>() {
                Ok(block) if block >= 1 => Ok(AttentionImpl::Online { block }),
                _ => Err(Error::InvalidParameter {
                    name: "block",
                    reason: format!("online:B needs a whole number of keys B >= 1 (got '{b}')"),
                }),
            };
        }
        Err(Error::UnknownName {
            kind: "softmax form (standard, online:B)",
            name: s.to_string(),
        })
    }
}

/// √(2/π), the constant of the tanh form of GELU.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh form of GELU.
const GELU_CUBIC: f64 = 0.044_715;

/// GELU in its tanh form, x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³))), in f64: the function
/// the engine rounds and the elementwise bounds evaluate.
pub(crate) fn gelu_f64(x: f64) -> f64 {
    let inner = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
    0.5 * x * (1.0 + inner.tanh())
}

/// The derivative of [`gelu_f64`], in f64.
pub(crate) fn gelu_grad_f64(x: f64) -> f64 {
    let inner = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
    let t = inner.tanh();
    let dinner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_round_trip_and_bad_ones_name_the_problem() {
        for v in [Variance::TwoPass, Variance::Welford, Variance::OnePass] {
            assert_eq!(v.to_string().parse::<Variance>().unwrap(), v);
        }
        for a in [AttentionImpl::Standard, AttentionImpl::Online { block: 32 }] {
            assert_eq!(a.to_string().parse::<AttentionImpl>().unwrap(), a);
        }
        assert!(matches!(
            "two-pass".parse::<Variance>(),
            Err(Error::UnknownName { .. })
        ));
        assert!(matches!(
            "flash".parse::<AttentionImpl>(),
            Err(Error::UnknownName { .. })
        ));
        for bad in ["online:0", "online:x", "online:-3"] {
            assert!(matches!(
                bad.parse::<AttentionImpl>(),
                Err(Error::InvalidParameter { name: "block", .. })
            ));
        }
    }
}

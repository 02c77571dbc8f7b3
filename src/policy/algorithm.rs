//! Algorithm choices that change an op's arithmetic beyond its policy: how LayerNorm computes
//! its variance, which attention algorithm runs, and the form of GELU.

use serde::{Deserialize, Serialize};

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

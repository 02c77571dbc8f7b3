//! Critical values of the tests' statistics: Bentkus and Dzindzalieta's bound for Rademacher
//! sums (the self-normalized systematic tests) and the sparse test's.

/// Bentkus and Dzindzalieta's optimal constant c* = 1/(4·P(η ≥ √2)) ≈ 3.178, η standard
/// normal: P(Σ aᵢεᵢ ≥ x) ≤ c*·P(η ≥ x) for independent Rademacher εᵢ and Σ aᵢ² ≤ 1, every x
/// (*A tight Gaussian bound for weighted sums of Rademacher random variables*, Bernoulli
/// 21(2), 2015).
fn rademacher_constant() -> f64 {
    1.0 / (4.0 * normal_upper_tail(std::f64::consts::SQRT_2))
}

/// P(η ≥ x) for η standard normal.
fn normal_upper_tail(x: f64) -> f64 {
    0.5 * statrs::function::erf::erfc(x / std::f64::consts::SQRT_2)
}

/// The two-sided critical value t of a Rademacher sum of unit variance (a self-normalized sum
/// of independent symmetric clusters, conditionally on their magnitudes) at false-alarm
/// probability δ: the smaller of Hoeffding's √(2 ln(2/δ)) (P(|S| ≥ t) ≤ 2e^(−t²/2)) and
/// Bentkus–Dzindzalieta's Gaussian comparison, 2c*·P(η ≥ t) = δ — the latter for every δ ≤ 1
/// (5.72 against Hoeffding's 5.98 at the tests' δ/30 = 3.3·10⁻⁸).
pub fn symmetric_critical(delta: f64) -> f64 {
    use statrs::distribution::{ContinuousCDF, Normal};
    let hoeffding = (2.0 * (2.0 / delta).ln()).sqrt();
    let p = delta / (2.0 * rademacher_constant());
    // P(η ≥ t) = p: t = −Φ⁻¹(p) (the lower tail, without the cancellation of 1 − p).
    let gaussian = Normal::standard().inverse_cdf(p.min(0.5));
    hoeffding.min(-gaussian)
}

/// The critical value of the sparse test for `n` elements at false-alarm probability `delta`:
/// a Laplace variable of unit variance exceeds x in absolute value with probability
/// exp(−√2·x), so x = ln(n/δ)/√2 keeps the union over n elements at δ.
pub fn sparse_critical(n: f64, delta: f64) -> f64 {
    (n / delta).ln().max(0.0) / std::f64::consts::SQRT_2
}

//! Sensitivity: the smallest relative perturbation of one module's output that a comparison
//! rule detects with 99% power.
//!
//! On a correct sharded run, the candidate's tensor c (already differing from the reference r
//! by round-off) is perturbed: c' = c + ρ·‖r‖·z/√n with z standard normal per element (‖·‖
//! the Frobenius norm, n elements), so the injected error has relative size ≈ ρ. A rule
//! detects when it rejects (r, c'). ρ* is the smallest ρ at which at least 99 of 100 draws are
//! detected, found by bisection on log ρ ∈ [1e-12, 1e2] (power is monotone in ρ up to
//! sampling noise; draws are fixed per tensor so the bisection is deterministic). A rule that
//! already rejects the unperturbed correct run has no sensitivity figure (it false-alarms).

use serde::Serialize;

use crate::bounds::baselines::{megatron_ttrace, torch_assert_close};
use crate::engine::init::SplitMix64;
use crate::format::Format;
use crate::tensor::Tensor;

/// ρ* of each rule for one tensor (`None`: the rule rejects the correct run already).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sensitivity {
    /// Our composed threshold.
    pub ours: Option<f64>,
    /// Megatron's 4·1.03^(L+1)·ε.
    pub megatron: Option<f64>,
    /// PyTorch `assert_close` defaults.
    pub torch: Option<f64>,
    /// The perturbation estimate.
    pub perturbation: Option<f64>,
}

const DRAWS: usize = 100;

/// ρ* for every rule. `threshold_abs`: ours on ‖c − r‖; `perturbation`: the perturbation
/// estimate (relative); `train`: the training dtype (Megatron's ε), `depth` = L + 1.
pub fn sensitivity(
    id: &str,
    reference: &Tensor,
    candidate: &Tensor,
    threshold_abs: f64,
    perturbation: f64,
    train: Format,
    depth: u32,
) -> Sensitivity {
    let r = reference.values();
    let c = candidate.values();
    let n = r.len().max(1);
    let rnorm = r.iter().map(|x| x * x).sum::<f64>().sqrt();
    let mut rng = SplitMix64::for_name(id, 0x5e75);
    let z: Vec<Vec<f64>> = (0..DRAWS)
        .map(|_| (0..n).map(|_| rng.normal()).collect())
        .collect();
    let scale = rnorm / (n as f64).sqrt();
    let torch = torch_assert_close(reference.format());
    let meg = megatron_ttrace(train, depth);
    let frob = |rho: f64, k: usize| -> f64 {
        r.iter()
            .zip(c)
            .zip(&z[k])
            .map(|((a, b), w)| {
                let d = b + rho * scale * w - a;
                d * d
            })
            .sum::<f64>()
            .sqrt()
    };
    let perturbed = |rho: f64, k: usize| -> Vec<f64> {
        c.iter()
            .zip(&z[k])
            .map(|(b, w)| b + rho * scale * w)
            .collect()
    };
    let rules: [&dyn Fn(f64, usize) -> bool; 4] = [
        &|rho, k| frob(rho, k) > threshold_abs,
        &|rho, k| !meg.accepts(r, &perturbed(rho, k)),
        &|rho, k| !torch.accepts(r, &perturbed(rho, k)),
        &|rho, k| frob(rho, k) > perturbation * rnorm,
    ];
    let mut out = [None; 4];
    for (slot, rule) in out.iter_mut().zip(rules) {
        if rnorm == 0.0 || rule(0.0, 0) {
            continue;
        }
        let power = |rho: f64| (0..DRAWS).filter(|&k| rule(rho, k)).count();
        let (mut lo, mut hi) = (-12.0f64, 2.0f64);
        if power(10f64.powf(hi)) < 99 {
            *slot = Some(f64::INFINITY);
            continue;
        }
        for _ in 0..14 {
            let mid = 0.5 * (lo + hi);
            if power(10f64.powf(mid)) >= 99 {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        *slot = Some(10f64.powf(hi));
    }
    Sensitivity {
        ours: out[0],
        megatron: out[1],
        torch: out[2],
        perturbation: out[3],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tighter_rule_is_more_sensitive() {
        let n = 1000;
        let r: Vec<f64> = (0..n).map(|i| 1.0 + (i % 7) as f64).collect();
        let t = Tensor::from_vec(&[n], r.clone(), Format::F64).unwrap();
        let norm = r.iter().map(|x| x * x).sum::<f64>().sqrt();
        let s = sensitivity("t", &t, &t, 1e-3 * norm, 1e-2, Format::BF16, 3);
        let ours = s.ours.unwrap();
        // ‖N‖ ≈ ρ‖r‖ concentrates: ρ* just above the relative threshold.
        assert!(ours > 1e-3 && ours < 1.2e-3, "{ours}");
        assert!(s.perturbation.unwrap() > 1e-2 && s.perturbation.unwrap() < 1.2e-2);
        // Megatron's 4·1.03³·2^-7 ≈ 0.034.
        let m = s.megatron.unwrap();
        assert!(m > 0.03 && m < 0.04, "{m}");
        // A rule that rejects the unperturbed pair has no figure.
        let c = Tensor::from_vec(&[n], r.iter().map(|x| x * 1.1).collect(), Format::F64).unwrap();
        assert_eq!(
            sensitivity("t", &t, &c, 1e-3 * norm, 1e-2, Format::BF16, 3).ours,
            None
        );
    }
}

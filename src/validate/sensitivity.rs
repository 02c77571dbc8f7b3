//! Sensitivity: the smallest perturbation of one tensor that a comparison rule detects with 99%
//! power, for perturbations of several shapes.
//!
//! On a correct sharded run, the candidate's tensor c (already differing from the reference r
//! by round-off) is perturbed, with ρ the perturbation's relative size:
//! * **Gaussian**: c + ρ·‖r‖·z/√n, z standard normal per element (‖·‖ the Frobenius norm, n
//!   elements), so the injected error has relative size ≈ ρ;
//! * **scale**: c·(1 ± ρ) (the two signs are the two draws);
//! * **channel bias**: c + ρ·rms(r)·g_j on every element of channel j (the last dimension's
//!   index), g standard normal per channel;
//! * **k elements** (k = 1, 4, 16): k positions drawn uniformly, each moved by
//!   ±ρ·max(|rᵢ|, rms of its row) — relative to the element's own magnitude, or its row's
//!   where the element is smaller.
//!
//! The perturbation is added to the values as numbers, not rounded back to the tensor's format
//! (a bug acts before the output rounding; rounding afterwards would turn a shift below half an
//! ulp into flips of the elements near a rounding boundary, the same shift in expectation).
//! A rule detects when it rejects (r, c'). ρ* is the smallest ρ at which at least 99% of the
//! draws are detected, found by bisection on log ρ ∈ [1e-12, 1e2] (power is monotone in ρ up to
//! sampling noise; draws are fixed per tensor so the bisection is deterministic). A rule that
//! already rejects the unperturbed correct run has no figure (it false-alarms).
//!
//! Rules: ours (the norm against the composed threshold and the scale, bias and sparse tests of
//! [`crate::check::Detector`]), the norm alone, Megatron's 4·1.03^(L+1)·ε, PyTorch's
//! `assert_close` defaults, and the perturbation estimate.

use serde::Serialize;

use crate::bounds::baselines::{megatron_ttrace, torch_assert_close};
use crate::check::detect::detect;
use crate::check::{detection_for, Detection};
use crate::engine::init::SplitMix64;
use crate::format::Format;
use crate::tensor::Tensor;

/// The shape of an injected perturbation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Perturbation {
    /// Independent Gaussian noise on every element.
    Gaussian,
    /// A scale 1 ± ρ of the whole tensor.
    Scale,
    /// A Gaussian offset per channel (index of the last dimension), the same on every row.
    ChannelBias,
    /// This many elements at random positions, each off by ρ of its magnitude.
    Elements(usize),
}

impl Perturbation {
    /// Every shape the sensitivity study measures.
    pub const ALL: [Perturbation; 6] = [
        Perturbation::Gaussian,
        Perturbation::Scale,
        Perturbation::ChannelBias,
        Perturbation::Elements(1),
        Perturbation::Elements(4),
        Perturbation::Elements(16),
    ];

    /// Its name in tables.
    pub fn name(self) -> String {
        match self {
            Perturbation::Gaussian => "gaussian".into(),
            Perturbation::Scale => "scale".into(),
            Perturbation::ChannelBias => "channel bias".into(),
            Perturbation::Elements(1) => "1 element".into(),
            Perturbation::Elements(k) => format!("{k} elements"),
        }
    }

    /// Draws per power estimate.
    fn draws(self) -> usize {
        match self {
            Perturbation::Scale => 2,
            _ => DRAWS,
        }
    }
}

/// ρ* of each rule for one tensor and one perturbation (`None`: the rule rejects the correct
/// run already; +∞: not detected at ρ = 100).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RuleFigures {
    /// Our rules: the composed threshold on the norm, and the scale, bias and sparse tests.
    pub ours: Option<f64>,
    /// The composed threshold on the norm alone.
    pub norm: Option<f64>,
    /// Megatron's 4·1.03^(L+1)·ε.
    pub megatron: Option<f64>,
    /// PyTorch `assert_close` defaults.
    pub torch: Option<f64>,
    /// The perturbation estimate.
    pub perturbation: Option<f64>,
}

impl RuleFigures {
    /// The rules by name, in table order.
    pub fn named(&self) -> [(&'static str, Option<f64>); 5] {
        [
            ("ours", self.ours),
            ("norm only", self.norm),
            ("megatron", self.megatron),
            ("torch", self.torch),
            ("perturbation", self.perturbation),
        ]
    }
}

/// ρ* per perturbation shape for one tensor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sensitivity {
    /// Per shape, in [`Perturbation::ALL`] order.
    pub figures: Vec<(Perturbation, RuleFigures)>,
}

impl Sensitivity {
    /// The figures of one shape.
    pub fn of(&self, p: Perturbation) -> Option<&RuleFigures> {
        self.figures.iter().find(|(q, _)| *q == p).map(|(_, f)| f)
    }
}

const DRAWS: usize = 100;

/// What a rule is given: the reference, a perturbed candidate, and which draw it is.
struct Case<'a> {
    id: &'a str,
    reference: &'a Tensor,
    candidate: &'a Tensor,
    threshold_abs: f64,
    eps: f64,
    detection: Detection,
}

/// ρ* for every rule and each of the perturbation `shapes` ([`Perturbation::ALL`] for the
/// whole study). `threshold_abs`: ours on ‖c − r‖; `perturbation`: the perturbation estimate
/// (relative); `train`: the training dtype (Megatron's ε and the unit of the tests'
/// estimates), `depth` = L + 1.
#[allow(clippy::too_many_arguments)]
pub fn sensitivity(
    shapes: &[Perturbation],
    id: &str,
    reference: &Tensor,
    candidate: &Tensor,
    threshold_abs: f64,
    perturbation: f64,
    train: Format,
    depth: u32,
    detection: Detection,
) -> Sensitivity {
    let case = Case {
        id,
        reference,
        candidate,
        threshold_abs,
        eps: train.machine_epsilon(),
        detection,
    };
    let figures = shapes
        .iter()
        .map(|&p| (p, figures_for(&case, p, perturbation, train, depth)))
        .collect();
    Sensitivity { figures }
}

fn figures_for(
    case: &Case,
    shape: Perturbation,
    pert_estimate: f64,
    train: Format,
    depth: u32,
) -> RuleFigures {
    let r = case.reference.values();
    let c = case.candidate.values();
    let n = r.len().max(1);
    let rnorm = r.iter().map(|x| x * x).sum::<f64>().sqrt();
    let row = case.reference.shape().last().copied().unwrap_or(1).max(1);
    let draws = shape.draws();
    let mut rng = SplitMix64::for_name(case.id, 0x5e75 ^ (shape_seed(shape)));
    // Unit perturbations (ρ = 1) per draw, scaled by ρ when applied.
    let rms = rnorm / (n as f64).sqrt();
    let units: Vec<Vec<f64>> = (0..draws)
        .map(|k| match shape {
            Perturbation::Gaussian => (0..n).map(|_| rms * rng.normal()).collect(),
            Perturbation::Scale => {
                let sign = if k % 2 == 0 { 1.0 } else { -1.0 };
                c.iter().map(|x| sign * x).collect()
            }
            Perturbation::ChannelBias => {
                let g: Vec<f64> = (0..row).map(|_| rng.normal()).collect();
                (0..n).map(|i| rms * g[i % row]).collect()
            }
            Perturbation::Elements(m) => {
                let mut u = vec![0.0; n];
                let mut placed = 0;
                while placed < m.min(n) {
                    let i = ((rng.uniform() * n as f64) as usize).min(n - 1);
                    if u[i] != 0.0 {
                        continue;
                    }
                    let start = i / row * row;
                    let end = (start + row).min(n);
                    let row_rms = (r[start..end].iter().map(|x| x * x).sum::<f64>()
                        / (end - start) as f64)
                        .sqrt();
                    let sign = if rng.uniform() < 0.5 { -1.0 } else { 1.0 };
                    u[i] = sign * r[i].abs().max(row_rms).max(f64::MIN_POSITIVE);
                    placed += 1;
                }
                u
            }
        })
        .collect();
    let torch = torch_assert_close(case.reference.format());
    let meg = megatron_ttrace(train, depth);
    let perturbed = |rho: f64, k: usize| -> Vec<f64> {
        c.iter().zip(&units[k]).map(|(b, w)| b + rho * w).collect()
    };
    let frob = |rho: f64, k: usize| -> f64 {
        r.iter()
            .zip(c)
            .zip(&units[k])
            .map(|((a, b), w)| {
                let d = b + rho * w - a;
                d * d
            })
            .sum::<f64>()
            .sqrt()
    };
    // The norm first (cheap); the other tests only where it stays quiet. The perturbed values
    // are off the format's grid: the tests allow one ulp of the reference's format.
    let detection = detection_for(case.id, case.detection);
    let ours = |rho: f64, k: usize| -> bool {
        frob(rho, k) > case.threshold_abs
            || detect(
                case.reference.shape(),
                r,
                &perturbed(rho, k),
                case.reference.format(),
                case.eps,
                detection,
            )
            .iter()
            .any(|f| f.fired)
    };
    let rules: [&dyn Fn(f64, usize) -> bool; 5] = [
        &ours,
        &|rho, k| frob(rho, k) > case.threshold_abs,
        &|rho, k| !meg.accepts(r, &perturbed(rho, k)),
        &|rho, k| !torch.accepts(r, &perturbed(rho, k)),
        &|rho, k| frob(rho, k) > pert_estimate * rnorm,
    ];
    let misses_allowed = draws / 100;
    let mut out = [None; 5];
    for (slot, rule) in out.iter_mut().zip(rules) {
        if rnorm == 0.0 || rule(0.0, 0) {
            continue;
        }
        // At least 99% of the draws detected (every draw when there are fewer than 100).
        let powerful = |rho: f64| {
            let mut misses = 0;
            for k in 0..draws {
                if !rule(rho, k) {
                    misses += 1;
                    if misses > misses_allowed {
                        return false;
                    }
                }
            }
            true
        };
        let (mut lo, mut hi) = (-12.0f64, 2.0f64);
        if !powerful(10f64.powf(hi)) {
            *slot = Some(f64::INFINITY);
            continue;
        }
        for _ in 0..14 {
            let mid = 0.5 * (lo + hi);
            if powerful(10f64.powf(mid)) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        *slot = Some(10f64.powf(hi));
    }
    RuleFigures {
        ours: out[0],
        norm: out[1],
        megatron: out[2],
        torch: out[3],
        perturbation: out[4],
    }
}

fn shape_seed(p: Perturbation) -> u64 {
    match p {
        Perturbation::Gaussian => 0,
        Perturbation::Scale => 1,
        Perturbation::ChannelBias => 2,
        Perturbation::Elements(k) => 3 + k as u64,
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
        let s = sensitivity(
            &Perturbation::ALL,
            "t",
            &t,
            &t,
            1e-3 * norm,
            1e-2,
            Format::BF16,
            3,
            Detection::default(),
        );
        let g = s.of(Perturbation::Gaussian).unwrap();
        let ours = g.norm.unwrap();
        // ‖N‖ ≈ ρ‖r‖ concentrates: ρ* just above the relative threshold.
        assert!(ours > 1e-3 && ours < 1.2e-3, "{ours}");
        assert!(g.perturbation.unwrap() > 1e-2 && g.perturbation.unwrap() < 1.2e-2);
        // Megatron's 4·1.03³·2^-7 ≈ 0.034.
        let m = g.megatron.unwrap();
        assert!(m > 0.03 && m < 0.04, "{m}");
        // A scale: the norm sees ‖ρ c‖ = ρ‖r‖, at the same ρ*.
        let sc = s.of(Perturbation::Scale).unwrap();
        assert!((sc.norm.unwrap() / 1e-3 - 1.0).abs() < 0.01, "{sc:?}");
        // A rule that rejects the unperturbed pair has no figure.
        let c = Tensor::from_vec(&[n], r.iter().map(|x| x * 1.1).collect(), Format::F64).unwrap();
        let s = sensitivity(
            &Perturbation::ALL,
            "t",
            &t,
            &c,
            1e-3 * norm,
            1e-2,
            Format::BF16,
            3,
            Detection::default(),
        );
        assert_eq!(s.of(Perturbation::Gaussian).unwrap().norm, None);
    }

    #[test]
    fn the_tests_beyond_the_norm_see_structured_perturbations_the_norm_misses() {
        // 256 × 256 with round-off of 1 ε per element and a norm threshold at 3 ε.
        let (rows, cols) = (256, 256);
        let eps = Format::BF16.machine_epsilon();
        let mut g = SplitMix64::for_name("sens", 1);
        let r: Vec<f64> = (0..rows * cols).map(|_| g.normal()).collect();
        let c: Vec<f64> = r.iter().map(|x| x + eps * g.normal()).collect();
        let rn = r.iter().map(|x| x * x).sum::<f64>().sqrt();
        let rt = Tensor::from_vec(&[rows, cols], r, Format::F64).unwrap();
        let ct = Tensor::from_vec(&[rows, cols], c, Format::F64).unwrap();
        let s = sensitivity(
            &Perturbation::ALL,
            "x|fwd.output.0",
            &rt,
            &ct,
            3.0 * eps * rn,
            1.0,
            Format::BF16,
            3,
            Detection::default(),
        );
        let of = |p| *s.of(p).unwrap();
        let (scale, one) = (of(Perturbation::Scale), of(Perturbation::Elements(1)));
        // The norm needs ρ ≈ 2.8 ε (√(9 − 1) ε); the scale test about 6.2 / 256 ε.
        assert!(scale.norm.unwrap() / eps > 2.5, "{scale:?}");
        assert!(scale.ours.unwrap() / eps < 0.05, "{scale:?}");
        // One element: the norm needs it at ≈ 2.8·256 ε; the sparse test far less.
        assert!(one.norm.unwrap() / eps > 500.0, "{one:?}");
        assert!(one.ours.unwrap() / eps < 40.0, "{one:?}");
    }
}

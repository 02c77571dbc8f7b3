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
//! * **row bias**: c + ρ·rms(r)·g_i on every element of row i (a token's offset; not on a
//!   tensor of one row, where it is one random constant);
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
//! [`ttrace::check::Detector`]), the norm alone, Megatron's 4·1.03^(L+1)·ε, PyTorch's
//! `assert_close` defaults, and the perturbation estimate — all end to end, on the candidate
//! as the sharded step produced it, carrying every earlier module's round-off — and the
//! **replaying localizer** ([`crate::validate::localize`]): the same perturbation added to the
//! module's own output replayed on the reference's inputs, judged against its local threshold
//! (the difference the module's own arithmetic may add; zero where the sharded arithmetic is
//! the reference's) and the same tests. That is a bug born in that module as the localizer
//! sees it; it needs the model to replay, so trace files from elsewhere have only the first
//! five rules.

use serde::Serialize;

use crate::validate::compose::OffsetBounds;
use ttrace::__lab::detect;
use ttrace::__lab::detection_for;
use ttrace::bounds::{megatron_ttrace, torch_assert_close};
use ttrace::check::Detection;
use ttrace::engine::SplitMix64;
use ttrace::Format;
use ttrace::Tensor;

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
    /// A Gaussian offset per row (a token), the same on every channel.
    RowBias,
    /// This many elements at random positions, each off by ρ of its magnitude.
    Elements(usize),
}

impl Perturbation {
    /// Every shape the sensitivity study measures.
    pub const ALL: [Perturbation; 7] = [
        Perturbation::Gaussian,
        Perturbation::Scale,
        Perturbation::ChannelBias,
        Perturbation::RowBias,
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
            Perturbation::RowBias => "row bias".into(),
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
/// run already; +∞: not detected at ρ = 100; 0: detected at every ρ ≥ 10⁻¹², a rule whose
/// threshold is zero).
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
    /// The replaying localizer: the module's own output, replayed on the reference's inputs
    /// and perturbed, against its local threshold and the tests beyond the norm (`None` also
    /// where the tensor has no replay: [`Sensitivity::replayed`]).
    pub localizer: Option<f64>,
}

impl RuleFigures {
    /// The rules' names in table order.
    pub const NAMES: [&'static str; 6] = [
        "ours",
        "norm only",
        "megatron",
        "torch",
        "perturbation",
        "localizer",
    ];

    /// The rules by name, in table order.
    pub fn named(&self) -> [(&'static str, Option<f64>); 6] {
        let n = Self::NAMES;
        [
            (n[0], self.ours),
            (n[1], self.norm),
            (n[2], self.megatron),
            (n[3], self.torch),
            (n[4], self.perturbation),
            (n[5], self.localizer),
        ]
    }
}

/// ρ* per perturbation shape for one tensor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sensitivity {
    /// Per shape, in [`Perturbation::ALL`] order.
    pub figures: Vec<(Perturbation, RuleFigures)>,
    /// The tensor has a replayed output, so [`RuleFigures::localizer`] is a figure (or a
    /// false alarm when `None`).
    pub replayed: bool,
}

impl Sensitivity {
    /// The figures of one shape.
    pub fn of(&self, p: Perturbation) -> Option<&RuleFigures> {
        self.figures.iter().find(|(q, _)| *q == p).map(|(_, f)| f)
    }
}

const DRAWS: usize = 100;

/// What a rule is given: the reference, the candidate to perturb and the norm's threshold.
#[derive(Clone, Copy)]
struct Case<'a> {
    id: &'a str,
    reference: &'a Tensor,
    candidate: &'a Tensor,
    threshold_abs: f64,
    /// The per-channel and per-row offsets' bounds, where there are.
    offsets: OffsetBounds,
    eps: f64,
    detection: Detection,
}

/// What the replaying localizer sees of a tensor: the module's own output on the reference's
/// inputs ([`crate::validate::replayed_outputs`]) and its local threshold on ‖output − r‖.
#[derive(Debug, Clone, Copy)]
pub struct Replayed<'a> {
    /// The replayed output, merged.
    pub output: &'a Tensor,
    /// The local threshold (absolute; 0 where the sharded arithmetic is the reference's).
    pub threshold_abs: f64,
}

/// One tensor of a correct run as the sensitivity study is given it.
///
/// [`Subject::new`] sets what every study needs; the rest defaults to what trace files from
/// elsewhere have (no offset bounds, no perturbation estimate, no replay) and is set with
/// struct-update syntax.
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    /// The tensor's id (seeds its draws, and says its class: parameter gradients have no
    /// sparse or systematic test).
    pub id: &'a str,
    /// The reference tensor r.
    pub reference: &'a Tensor,
    /// The candidate c, as the sharded step produced it.
    pub candidate: &'a Tensor,
    /// Ours on ‖c − r‖ (absolute).
    pub threshold_abs: f64,
    /// Ours on the per-channel and per-row offsets (`validate::Composed::offsets`); none by
    /// default.
    pub offsets: OffsetBounds,
    /// The perturbation estimate (relative); +∞ by default (that rule never rejects).
    pub perturbation: f64,
    /// The training dtype: Megatron's ε and the unit of the tests' estimates.
    pub train: Format,
    /// L + 1 in Megatron's 4·1.03^(L+1)·ε; 3 by default.
    pub depth: u32,
    /// The tests' settings (their δ).
    pub detection: Detection,
    /// The localizer's view, if the tensor has one; none by default.
    pub replayed: Option<Replayed<'a>>,
}

impl<'a> Subject<'a> {
    /// A tensor judged by `threshold_abs` on its norm, in a run trained in `train`, with the
    /// other fields at their defaults.
    pub fn new(
        id: &'a str,
        reference: &'a Tensor,
        candidate: &'a Tensor,
        threshold_abs: f64,
        train: Format,
    ) -> Subject<'a> {
        Subject {
            id,
            reference,
            candidate,
            threshold_abs,
            offsets: OffsetBounds::default(),
            perturbation: f64::INFINITY,
            train,
            depth: 3,
            detection: Detection::default(),
            replayed: None,
        }
    }
}

/// ρ* for every rule and each of the perturbation `shapes` ([`Perturbation::ALL`] for the
/// whole study) on `subject`.
///
/// # Examples
///
/// ```
/// use ttrace::{Format, Tensor};
/// use ttrace_lab::validate::{sensitivity, Perturbation, Subject};
///
/// // 64 × 64 values whose candidate is 1 ε of BF16 off, judged at 3 ε on the norm.
/// let eps = Format::BF16.machine_epsilon();
/// let r: Vec<f64> = (0..4096).map(|i| ((i * 37 % 101) as f64 - 50.0) / 25.0).collect();
/// let c: Vec<f64> = r.iter().enumerate()
///     .map(|(i, x)| x + if i % 2 == 0 { eps } else { -eps } * x.abs().max(0.5))
///     .collect();
/// let norm = r.iter().map(|x| x * x).sum::<f64>().sqrt();
/// let rt = Tensor::from_vec(&[64, 64], r, Format::F64)?;
/// let ct = Tensor::from_vec(&[64, 64], c, Format::F64)?;
/// let subject = Subject::new("x|fwd.output.0", &rt, &ct, 3.0 * eps * norm, Format::BF16);
/// let s = sensitivity(&[Perturbation::Gaussian], &subject);
/// let rho = s.of(Perturbation::Gaussian).unwrap().norm.unwrap();
/// // Noise must add √(3² − 1²) ≈ 2.8 ε to the norm (in quadrature) to cross 3 ε.
/// assert!(rho > 2.0 * eps && rho < 3.5 * eps, "{rho}");
/// # Ok::<(), ttrace::Error>(())
/// ```
pub fn sensitivity(shapes: &[Perturbation], subject: &Subject<'_>) -> Sensitivity {
    let case = Case {
        id: subject.id,
        reference: subject.reference,
        candidate: subject.candidate,
        threshold_abs: subject.threshold_abs,
        offsets: subject.offsets,
        eps: subject.train.machine_epsilon(),
        detection: subject.detection,
    };
    let local = subject.replayed.map(|l| Case {
        candidate: l.output,
        threshold_abs: l.threshold_abs,
        offsets: OffsetBounds::default(),
        ..case
    });
    // A per-row offset of a tensor of one row is one random constant: no shape of its own.
    let reference = subject.reference;
    let rows = reference.len() / reference.shape().last().copied().unwrap_or(1).max(1);
    let figures = shapes
        .iter()
        .filter(|&&p| p != Perturbation::RowBias || rows >= 2)
        .map(|&p| (p, figures_for(&case, local.as_ref(), p, subject)))
        .collect();
    Sensitivity {
        figures,
        replayed: subject.replayed.is_some(),
    }
}

/// The unit perturbations (ρ = 1) of `shape`, one per draw, scaled by ρ when applied.
fn units(case: &Case, shape: Perturbation) -> Vec<Vec<f64>> {
    let r = case.reference.values();
    let c = case.candidate.values();
    let n = r.len().max(1);
    let rnorm = r.iter().map(|x| x * x).sum::<f64>().sqrt();
    let row = case.reference.shape().last().copied().unwrap_or(1).max(1);
    let mut rng = SplitMix64::for_name(case.id, 0x5e75 ^ (shape_seed(shape)));
    let rms = rnorm / (n as f64).sqrt();
    (0..shape.draws())
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
            Perturbation::RowBias => {
                let g: Vec<f64> = (0..n.div_ceil(row)).map(|_| rng.normal()).collect();
                (0..n).map(|i| rms * g[i / row]).collect()
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
        .collect()
}

/// A case's candidate with draw `k` of `units` at size ρ, and its norm test and tests beyond
/// the norm.
struct Perturbed<'a> {
    case: &'a Case<'a>,
    units: Vec<Vec<f64>>,
    detection: Detection,
}

impl Perturbed<'_> {
    fn new<'a>(case: &'a Case<'a>, shape: Perturbation) -> Perturbed<'a> {
        Perturbed {
            units: units(case, shape),
            detection: detection_for(case.id, case.detection),
            case,
        }
    }

    fn values(&self, rho: f64, k: usize) -> Vec<f64> {
        let c = self.case.candidate.values();
        c.iter()
            .zip(&self.units[k])
            .map(|(b, w)| b + rho * w)
            .collect()
    }

    fn frob(&self, rho: f64, k: usize) -> f64 {
        let (r, c) = (self.case.reference.values(), self.case.candidate.values());
        r.iter()
            .zip(c)
            .zip(&self.units[k])
            .map(|((a, b), w)| {
                let d = b + rho * w - a;
                d * d
            })
            .sum::<f64>()
            .sqrt()
    }

    /// The norm against the case's threshold, else the tests beyond it. The perturbed values
    /// are off the format's grid: the tests allow one ulp of the reference's format.
    fn rejects(&self, rho: f64, k: usize) -> bool {
        if self.frob(rho, k) > self.case.threshold_abs {
            return true;
        }
        let reference = self.case.reference;
        let (r, c) = (reference.values(), self.values(rho, k));
        let eps = self.case.eps;
        let offsets = self.case.offsets.findings(reference.shape(), r, &c, eps);
        offsets.iter().any(|f| f.fired)
            || detect(
                reference.shape(),
                r,
                &c,
                reference.format(),
                eps,
                self.detection,
            )
            .iter()
            .any(|f| f.fired)
    }
}

/// ρ* of `rule` over `draws` draws: `None` when it rejects the unperturbed pair, +∞ when 99%
/// power is not reached at ρ = 100, 0 when it is reached at ρ = 10⁻¹² already (a zero
/// threshold: any change is detected).
fn rho_star(draws: usize, rule: &dyn Fn(f64, usize) -> bool) -> Option<f64> {
    if rule(0.0, 0) {
        return None;
    }
    let misses_allowed = draws / 100;
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
        return Some(f64::INFINITY);
    }
    if powerful(10f64.powf(lo)) {
        return Some(0.0);
    }
    for _ in 0..14 {
        let mid = 0.5 * (lo + hi);
        if powerful(10f64.powf(mid)) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(10f64.powf(hi))
}

fn figures_for(
    case: &Case,
    replayed: Option<&Case>,
    shape: Perturbation,
    subject: &Subject<'_>,
) -> RuleFigures {
    let pert_estimate = subject.perturbation;
    let r = case.reference.values();
    let rnorm = r.iter().map(|x| x * x).sum::<f64>().sqrt();
    let draws = shape.draws();
    let p = Perturbed::new(case, shape);
    let torch = torch_assert_close(case.reference.format());
    let meg = megatron_ttrace(subject.train, subject.depth);
    let rules: [&dyn Fn(f64, usize) -> bool; 5] = [
        &|rho, k| p.rejects(rho, k),
        &|rho, k| p.frob(rho, k) > case.threshold_abs,
        &|rho, k| !meg.accepts(r, &p.values(rho, k)),
        &|rho, k| !torch.accepts(r, &p.values(rho, k)),
        &|rho, k| p.frob(rho, k) > pert_estimate * rnorm,
    ];
    let mut out = [None; 5];
    if rnorm > 0.0 {
        for (slot, rule) in out.iter_mut().zip(rules) {
            *slot = rho_star(draws, rule);
        }
    }
    let localizer = replayed.and_then(|local| {
        let p = Perturbed::new(local, shape);
        if rnorm > 0.0 {
            rho_star(draws, &|rho, k| p.rejects(rho, k))
        } else {
            None
        }
    });
    RuleFigures {
        ours: out[0],
        norm: out[1],
        megatron: out[2],
        torch: out[3],
        perturbation: out[4],
        localizer,
    }
}

fn shape_seed(p: Perturbation) -> u64 {
    match p {
        Perturbation::Gaussian => 0,
        Perturbation::Scale => 1,
        Perturbation::ChannelBias => 2,
        Perturbation::RowBias => 100,
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
            &Subject {
                perturbation: 1e-2,
                ..Subject::new("t", &t, &t, 1e-3 * norm, Format::BF16)
            },
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
            &Subject {
                perturbation: 1e-2,
                ..Subject::new("t", &t, &c, 1e-3 * norm, Format::BF16)
            },
        );
        assert_eq!(s.of(Perturbation::Gaussian).unwrap().norm, None);
    }

    #[test]
    fn per_channel_and_per_row_offsets_are_found_by_their_means_far_below_the_norm() {
        // 256 rows × 64 channels, round-off of 1 ε per element, the norm at 3 ε, and a
        // channel bound 3 times the column means' round-off (each column's mean ε/16: ‖D‖/256).
        let (rows, cols) = (256, 64);
        let eps = Format::BF16.machine_epsilon();
        let mut g = SplitMix64::for_name("channel", 4);
        let r: Vec<f64> = (0..rows * cols).map(|_| g.normal()).collect();
        let c: Vec<f64> = r.iter().map(|x| x + eps * g.normal()).collect();
        let rn = r.iter().map(|x| x * x).sum::<f64>().sqrt();
        let rt = Tensor::from_vec(&[rows, cols], r, Format::F64).unwrap();
        let ct = Tensor::from_vec(&[rows, cols], c, Format::F64).unwrap();
        let bound = 3.0 * eps * rn / rows as f64;
        let study = |channel: Option<f64>| {
            *sensitivity(
                &[Perturbation::ChannelBias],
                &Subject {
                    offsets: OffsetBounds { channel, row: None },
                    perturbation: 1.0,
                    ..Subject::new("x|fwd.output.0", &rt, &ct, 3.0 * eps * rn, Format::BF16)
                },
            )
            .of(Perturbation::ChannelBias)
            .unwrap()
        };
        let without = study(None).ours.unwrap() / eps;
        let with = study(Some(bound)).ours.unwrap() / eps;
        // The norm: ρ·rms·‖g‖ against √8 ε; the column means: the same against 3 ε/16.
        assert!(without > 2.0, "{without}");
        assert!(with < 0.4 && with * 8.0 < without, "{with} {without}");
        // A per-row offset, against the row means' bound (each row's mean ε/8: ‖D‖/64).
        let rows_study = |row: Option<f64>| {
            *sensitivity(
                &[Perturbation::RowBias],
                &Subject {
                    offsets: OffsetBounds { channel: None, row },
                    perturbation: 1.0,
                    ..Subject::new("x|fwd.output.0", &rt, &ct, 3.0 * eps * rn, Format::BF16)
                },
            )
            .of(Perturbation::RowBias)
            .unwrap()
        };
        let without = rows_study(None).ours.unwrap() / eps;
        let with = rows_study(Some(3.0 * eps * rn / cols as f64)).ours.unwrap() / eps;
        assert!(without > 2.0, "{without}");
        assert!(with < 0.6 && with * 4.0 < without, "{with} {without}");
    }

    #[test]
    fn the_localizer_judges_the_replayed_output_against_its_local_threshold() {
        let (rows, cols) = (64, 64);
        let eps = Format::F32.machine_epsilon();
        let mut g = SplitMix64::for_name("replay", 2);
        let r: Vec<f64> = (0..rows * cols).map(|_| g.normal()).collect();
        let rn = r.iter().map(|x| x * x).sum::<f64>().sqrt();
        // End to end: 20 ε of carried round-off and a threshold at 30 ε.
        let c: Vec<f64> = r.iter().map(|x| x + 20.0 * eps * x * g.normal()).collect();
        let rt = Tensor::from_vec(&[rows, cols], r.clone(), Format::F64).unwrap();
        let ct = Tensor::from_vec(&[rows, cols], c, Format::F64).unwrap();
        let study = |replayed: Option<Replayed<'_>>| {
            sensitivity(
                &[Perturbation::Gaussian],
                &Subject {
                    perturbation: 1.0,
                    replayed,
                    ..Subject::new("x|fwd.output.0", &rt, &ct, 30.0 * eps * rn, Format::F32)
                },
            )
        };
        let s = study(None);
        assert!(!s.replayed);
        let g0 = *s.of(Perturbation::Gaussian).unwrap();
        assert_eq!(g0.localizer, None);
        // √(30² − 20²) ≈ 22 ε end to end.
        let ours = g0.ours.unwrap() / eps;
        assert!(ours > 20.0 && ours < 26.0, "{ours}");
        // A bit-identical replay with a zero local threshold: any change is detected.
        let s = study(Some(Replayed {
            output: &rt,
            threshold_abs: 0.0,
        }));
        assert!(s.replayed);
        assert_eq!(s.of(Perturbation::Gaussian).unwrap().localizer, Some(0.0));
        // A replay 1 ε off with a local threshold of 2 ε: ρ* ≈ √(4 − 1) ε.
        let l: Vec<f64> = r.iter().map(|x| x + eps * x * g.normal()).collect();
        let lt = Tensor::from_vec(&[rows, cols], l, Format::F64).unwrap();
        let s = study(Some(Replayed {
            output: &lt,
            threshold_abs: 2.0 * eps * rn,
        }));
        let local = s.of(Perturbation::Gaussian).unwrap().localizer.unwrap() / eps;
        assert!(local > 1.5 && local < 2.1, "{local}");
        // A replay already beyond its local threshold has no figure (a false alarm).
        let s = study(Some(Replayed {
            output: &lt,
            threshold_abs: 0.5 * eps * rn,
        }));
        assert_eq!(s.of(Perturbation::Gaussian).unwrap().localizer, None);
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
            &Subject {
                perturbation: 1.0,
                ..Subject::new("x|fwd.output.0", &rt, &ct, 3.0 * eps * rn, Format::BF16)
            },
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

//! A probabilistic threshold checked by the engine's own executions of the two declared sides
//! (papers/bounds-reductions.md §4, "The model checked by the executions").
//!
//! A probabilistic threshold rests on the random-rounding model; the guaranteed one does not.
//! Both sides of a comparison are executions the engine can run — the op's form and
//! arithmetic declared, one order or a family of orders (a vendor kernel whose blocking is
//! unknown: the threshold must hold whichever member runs) — and running them costs about
//! the op per order, next to the tens to hundreds of times the op that pricing takes. The
//! difference D of each pair of orders the two sides may run is a draw the model must cover. Under the model ‖D‖ and max |Dᵢ| exceed the model's threshold at
//! δ_s = min(δ, [`MODEL_CHECK_DELTA`]) with probability at most δ_s; where they do, the data
//! carry structure the model does not capture (roundings that move together across elements,
//! or data built against the uniform phase), and the guaranteed threshold is returned instead,
//! marked [`Confidence::Guaranteed`]. Every op's threshold function goes through here, so a
//! probabilistic threshold never falls below the difference of the declared executions (of
//! any two members, for families).

use crate::bounds::compare::{Confidence, Threshold};
use crate::error::Result;
use crate::policy::Policy;

/// The failure probability at which the engine's executions of the two declared sides test
/// the model behind a probabilistic threshold (`checked_by_executions`).
pub const MODEL_CHECK_DELTA: f64 = 1e-3;

/// Each side's outputs for every order it may run: one for a side of one order, one per
/// member for a family ([`Order::AnyOf`](crate::Order::AnyOf), or a split-K over one).
pub(crate) type Executions = (Vec<Vec<f64>>, Vec<Vec<f64>>);

/// The policies a side may run: itself for one order, one per member of its family.
pub(crate) fn member_policies(p: &Policy) -> Vec<Policy> {
    let members = p.accumulation.order.members();
    members
        .into_iter()
        .map(|o| p.clone().with_order(o))
        .collect()
}

/// Both sides' [`Executions`], `run` executing one side (`false`: the reference, `true`: the
/// candidate) under one policy; `None` where any execution fails.
pub(crate) fn each_member(
    (reference, candidate): (&Policy, &Policy),
    run: impl Fn(bool, &Policy) -> Option<Vec<f64>>,
) -> Option<Executions> {
    let side = |cand: bool, p: &Policy| -> Option<Vec<Vec<f64>>> {
        member_policies(p).iter().map(|m| run(cand, m)).collect()
    };
    Some((side(false, reference)?, side(true, candidate)?))
}

/// The threshold `build` gives at `confidence`, checked first, when it is probabilistic, by
/// `executions` (both sides' outputs for every order each may run, or `None` where they
/// cannot be run): where the difference of any pair exceeds the model's threshold at δ_s =
/// min(δ, [`MODEL_CHECK_DELTA`]) (the tensor norm or one element), the guaranteed threshold
/// (module docs). The executions run beside the first pricing (`parallel::join`); `build`
/// runs once when the check passes at δ ≤ [`MODEL_CHECK_DELTA`] (the default δ = 10⁻⁶), at
/// most three times otherwise.
///
/// # Errors
///
/// `build`'s.
pub(crate) fn checked_by_executions(
    confidence: Confidence,
    build: &(dyn Fn(Confidence) -> Result<Threshold> + Sync),
    executions: &(dyn Fn() -> Option<Executions> + Sync),
) -> Result<Threshold> {
    checked_by_executions_tiered(confidence, &[build], executions)
}

/// [`checked_by_executions`] over a ladder of models, the cheapest first (a compiled
/// all-random model, then the determined-rounding walk): each probabilistic threshold in turn
/// is checked by the same executions, and the first that the executions' differences fit is
/// returned; where none fits, the last model's guaranteed threshold. A model that fails (an
/// error: a sum it cannot exclude from overflowing, say) hands the data to the next one; the
/// last model's errors are the answer. Where the executions cannot check anything (one
/// failed, or a value is not finite), the last model answers alone. A guaranteed threshold
/// is the last model's. A threshold that is not finite is refused
/// ([`Error::NoFiniteBound`](crate::error::Error::NoFiniteBound)): it would pass anything.
///
/// # Errors
///
/// The last model's.
pub(crate) fn checked_by_executions_tiered(
    confidence: Confidence,
    builds: &[&(dyn Fn(Confidence) -> Result<Threshold> + Sync)],
    executions: &(dyn Fn() -> Option<Executions> + Sync),
) -> Result<Threshold> {
    finite(ladder(confidence, builds, executions)?)
}

/// `t` where its norm and per-element bounds are finite; a refusal otherwise. A threshold of
/// NaN or ∞ passes every difference (a vacuous verdict): whatever model produced one has met
/// data it cannot price, and says so.
pub(crate) fn finite(t: Threshold) -> Result<Threshold> {
    if t.abs_frobenius.is_finite() && t.per_element.is_finite() {
        return Ok(t);
    }
    Err(crate::error::Error::NoFiniteBound {
        what: format!("a threshold on {} elements", t.elements),
        reason: format!(
            "the model priced a norm bound of {:e} and a per-element bound of {:e}, which would \
             pass any difference",
            t.abs_frobenius, t.per_element
        ),
    })
}

/// [`checked_by_executions_tiered`] before the finiteness guard.
fn ladder(
    confidence: Confidence,
    builds: &[&(dyn Fn(Confidence) -> Result<Threshold> + Sync)],
    executions: &(dyn Fn() -> Option<Executions> + Sync),
) -> Result<Threshold> {
    let Some((last, cheaper)) = builds.split_last() else {
        return Err(crate::error::Error::InvalidParameter {
            name: "builds",
            reason: "no model to price the threshold".into(),
        });
    };
    let Confidence::Probabilistic { delta } = confidence else {
        return last(confidence);
    };
    // The executions run beside the first pricing where a thread is free.
    let first = builds[0];
    let (first_threshold, runs) = crate::parallel::join(|| first(confidence), executions);
    // The executions' largest differences over every pair of orders (`None`: not usable —
    // an execution failed, lengths differ or a value is not finite — and the model's
    // threshold stands unchecked).
    let worst = runs.and_then(|(refs, cands)| {
        let (mut worst_sq, mut worst_max) = (0.0f64, 0.0f64);
        for r in &refs {
            for c in &cands {
                if r.len() != c.len() || !r.iter().chain(c).all(|v| v.is_finite()) {
                    return None;
                }
                let (mut sq, mut max) = (0.0f64, 0.0f64);
                for (x, y) in r.iter().zip(c) {
                    let d = (y - x).abs();
                    sq += d * d;
                    max = max.max(d);
                }
                worst_sq = worst_sq.max(sq);
                worst_max = worst_max.max(max);
            }
        }
        Some((worst_sq.sqrt(), worst_max))
    });
    let check_delta = delta.min(MODEL_CHECK_DELTA);
    let mut first_threshold = Some(first_threshold);
    for (i, build) in builds.iter().enumerate() {
        let threshold = match first_threshold.take() {
            Some(t) if i == 0 => t,
            _ => build(confidence),
        };
        let threshold = match threshold {
            Ok(t) => t,
            Err(_) if i < cheaper.len() => continue,
            Err(e) => return Err(e),
        };
        if threshold.identical {
            return Ok(threshold);
        }
        // Nothing to check against (an execution failed or overflowed): only the last,
        // most careful model is taken unchecked.
        let Some((norm, max)) = worst else {
            if i < cheaper.len() {
                return last(confidence);
            }
            return Ok(threshold);
        };
        let check = if check_delta == delta {
            threshold.clone()
        } else {
            match build(Confidence::Probabilistic { delta: check_delta }) {
                Ok(t) => t,
                Err(_) if i < cheaper.len() => continue,
                Err(e) => return Err(e),
            }
        };
        if norm <= check.abs_frobenius && max <= check.per_element {
            return Ok(threshold);
        }
    }
    last(Confidence::Guaranteed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A threshold of the given norm and per-element bound at `confidence`.
    fn at(confidence: Confidence, norm: f64, per: f64) -> Threshold {
        let mut t = Threshold::identical(confidence, 1.0, 2);
        t.identical = false;
        t.abs_frobenius = norm;
        t.per_element = per;
        t
    }

    /// The model's threshold where the executions' difference fits it; the guaranteed one
    /// where the norm or one element exceeds it; the check made at δ_s for a δ above it.
    #[test]
    fn falls_back_exactly_where_the_executions_exceed_the_model() {
        let build = |c: Confidence| -> Result<Threshold> {
            Ok(match c {
                Confidence::Guaranteed => at(c, 10.0, 10.0),
                // A looser model threshold at a smaller δ.
                Confidence::Probabilistic { delta } => at(c, 1.0 - delta.ln() / 100.0, 0.9),
            })
        };
        let p = Confidence::Probabilistic { delta: 1e-6 };
        let run = |d: Vec<f64>| move || Some((vec![vec![0.0; d.len()]], vec![d.clone()]));
        // ‖D‖ = 1.1 within 1.138 (δ = 10⁻⁶), each |Dᵢ| within 0.9.
        let t = checked_by_executions(p, &build, &run(vec![0.8, 0.75])).unwrap();
        assert_eq!(t.confidence, p);
        // One element beyond 0.9.
        let t = checked_by_executions(p, &build, &run(vec![0.95, 0.1])).unwrap();
        assert_eq!(t.confidence, Confidence::Guaranteed);
        assert_eq!(t.abs_frobenius, 10.0);
        // The norm beyond.
        let t = checked_by_executions(p, &build, &run(vec![0.85, 0.85])).unwrap();
        assert_eq!(t.confidence, Confidence::Guaranteed);
        // δ = 0.5: the model's threshold 1.0069 is returned, but it is checked at 10⁻³
        // (1.069): ‖D‖ = 1.04 passes.
        let half = Confidence::Probabilistic { delta: 0.5 };
        let t = checked_by_executions(half, &build, &run(vec![0.8, 0.665])).unwrap();
        assert_eq!(t.confidence, half);
        assert!(t.abs_frobenius < 1.01);
        // Nothing to run, or non-finite executions: the model's threshold.
        let none = || None;
        assert_eq!(
            checked_by_executions(p, &build, &none).unwrap().confidence,
            p
        );
        let t = checked_by_executions(p, &build, &run(vec![f64::NAN, 5.0])).unwrap();
        assert_eq!(t.confidence, p);
        // A family's members: every pair is held against the model, the worst decides.
        let members = || Some((vec![vec![0.0; 2]], vec![vec![0.8, 0.75], vec![0.95, 0.1]]));
        let t = checked_by_executions(p, &build, &members).unwrap();
        assert_eq!(t.confidence, Confidence::Guaranteed);
        // A guaranteed request is never checked.
        let t = checked_by_executions(Confidence::Guaranteed, &build, &run(vec![50.0])).unwrap();
        assert_eq!(t.abs_frobenius, 10.0);
    }

    /// A ladder of models: the cheapest whose threshold the executions fit is returned; a
    /// model that errs or does not fit hands over to the next; where none fits, the last
    /// one's guaranteed threshold; a guaranteed request goes to the last model alone; the
    /// last model's error is the answer.
    #[test]
    fn the_ladder_returns_the_first_model_the_executions_fit() {
        let p = Confidence::Probabilistic { delta: 1e-6 };
        // A narrow cheap model, a wide one, one that fails.
        let narrow = |c: Confidence| -> Result<Threshold> {
            Ok(match c {
                Confidence::Guaranteed => at(c, 100.0, 100.0),
                _ => at(c, 1.0, 1.0),
            })
        };
        let wide = |c: Confidence| -> Result<Threshold> {
            Ok(match c {
                Confidence::Guaranteed => at(c, 10.0, 10.0),
                _ => at(c, 3.0, 3.0),
            })
        };
        let fails = |_: Confidence| -> Result<Threshold> {
            Err(crate::error::Error::NoFiniteBound {
                what: "test".into(),
                reason: "test".into(),
            })
        };
        let run = |d: Vec<f64>| move || Some((vec![vec![0.0; d.len()]], vec![d.clone()]));
        let ladder = [
            &narrow as &(dyn Fn(Confidence) -> Result<Threshold> + Sync),
            &wide,
        ];
        // Within the narrow model.
        let t = checked_by_executions_tiered(p, &ladder, &run(vec![0.5, 0.5])).unwrap();
        assert_eq!((t.confidence, t.abs_frobenius), (p, 1.0));
        // Beyond it, within the wide one.
        let t = checked_by_executions_tiered(p, &ladder, &run(vec![2.0, 0.5])).unwrap();
        assert_eq!((t.confidence, t.abs_frobenius), (p, 3.0));
        // Beyond both: the last model's guaranteed threshold.
        let t = checked_by_executions_tiered(p, &ladder, &run(vec![5.0, 0.5])).unwrap();
        assert_eq!(
            (t.confidence, t.abs_frobenius),
            (Confidence::Guaranteed, 10.0)
        );
        // Nothing to check against: the last model, not the cheap one.
        let t = checked_by_executions_tiered(p, &ladder, &run(vec![f64::NAN, 0.5])).unwrap();
        assert_eq!((t.confidence, t.abs_frobenius), (p, 3.0));
        let t = checked_by_executions_tiered(p, &ladder, &|| None).unwrap();
        assert_eq!(t.abs_frobenius, 3.0);
        // A guaranteed request: the last model.
        let g = Confidence::Guaranteed;
        let t = checked_by_executions_tiered(g, &ladder, &run(vec![0.5])).unwrap();
        assert_eq!(t.abs_frobenius, 10.0);
        // A cheap model that fails hands over; the last model's failure is the answer.
        let ladder = [
            &fails as &(dyn Fn(Confidence) -> Result<Threshold> + Sync),
            &wide,
        ];
        let t = checked_by_executions_tiered(p, &ladder, &run(vec![0.5, 0.5])).unwrap();
        assert_eq!(t.abs_frobenius, 3.0);
        let ladder = [
            &narrow as &(dyn Fn(Confidence) -> Result<Threshold> + Sync),
            &fails,
        ];
        let e = checked_by_executions_tiered(p, &ladder, &run(vec![2.0, 0.5]));
        assert!(matches!(e, Err(crate::error::Error::NoFiniteBound { .. })));
        assert!(matches!(
            checked_by_executions_tiered(p, &[], &run(vec![0.5])),
            Err(crate::error::Error::InvalidParameter { name: "builds", .. })
        ));
    }

    /// Every op's executions run, for both sides and every member of a family, as the
    /// engine's public entry points run them (so that no check is skipped silently).
    #[test]
    fn every_op_runs_its_declared_executions() {
        use crate::bounds::{Elementwise, NormData, NormOp, NormSide, OpSide};
        use crate::engine::{self, AttentionImpl, Variance};
        use crate::{Format, Order, Policy, Tensor};
        let t = |shape: &[usize], seed: usize| {
            let n: usize = shape.iter().product();
            let v = (0..n)
                .map(|i| ((i * 37 + seed) % 23) as f64 / 8.0 - 1.375)
                .collect();
            Tensor::from_vec(shape, v, Format::BF16).unwrap()
        };
        let r: Policy = "in=bf16,acc=f32,out=bf16".parse().unwrap();
        let c = r.clone().with_order(Order::pairwise(4));
        let members = [Order::blocked(4), Order::pairwise(2), Order::pairwise(8)];
        let family = r.clone().with_order(Order::AnyOf(members.to_vec()));
        let each: Vec<Policy> = members
            .iter()
            .map(|o| r.clone().with_order(o.clone()))
            .collect();
        // What `executions` must give: the reference's one output, the candidate's per member
        // (no member is the reference's sequential order: the closures below tell the sides
        // apart by policy).
        let expect = |run: &dyn Fn(&Policy) -> Tensor, cand: &[Policy]| -> Option<Executions> {
            Some((
                vec![run(&r).into_values()],
                cand.iter().map(|p| run(p).into_values()).collect(),
            ))
        };
        let x = t(&[3, 16], 1);
        let online = AttentionImpl::Online { block: 4 };
        let std_ = AttentionImpl::Standard;
        use crate::bounds::softmax::executions as softmax_runs;
        // The standard form on both sides (numerators computed once where alike, and apart
        // for an accumulator of its own), and the online form.
        let bf = Policy::new(Format::BF16, Format::BF16, Format::F32);
        let soft = |p: &Policy| engine::softmax(&x, p).unwrap();
        for cand in [vec![c.clone()], vec![bf.clone()]] {
            assert_eq!(
                softmax_runs(&x, (&r, std_), (&cand[0], std_)),
                expect(&soft, &cand)
            );
        }
        assert_eq!(
            softmax_runs(&x, (&r, std_), (&family, std_)),
            expect(&soft, &each)
        );
        let on = |p: &Policy| {
            if p == &r {
                soft(p)
            } else {
                engine::online_softmax(&x, 4, p).unwrap()
            }
        };
        assert_eq!(
            softmax_runs(&x, (&r, std_), (&family, online)),
            expect(&on, &each)
        );
        let (w, b) = (t(&[16], 2), t(&[16], 3));
        let data = NormData {
            x: &x,
            weight: &w,
            bias: Some(&b),
            eps: 1e-5,
        };
        let side = |op, policy| NormSide { op, policy };
        let (two, welford) = (
            NormOp::LayerNorm(Variance::TwoPass),
            NormOp::LayerNorm(Variance::Welford),
        );
        let ln = |p: &Policy| {
            let v = if p == &r {
                Variance::TwoPass
            } else {
                Variance::Welford
            };
            engine::layer_norm(&x, &w, &b, 1e-5, v, p).unwrap().0
        };
        let runs = crate::bounds::norm::executions(&data, side(two, &r), side(welford, &family));
        assert_eq!(runs, expect(&ln, &each));
        let rms = NormData { bias: None, ..data };
        let rn = |p: &Policy| engine::rms_norm(&x, &w, 1e-5, p).unwrap().0;
        let (rr, rc) = (side(NormOp::RmsNorm, &r), side(NormOp::RmsNorm, &c));
        let runs = crate::bounds::norm::executions(&rms, rr, rc);
        assert_eq!(runs, expect(&rn, std::slice::from_ref(&c)));
        let targets = [3, 0, 15];
        let ce = |p: &Policy| engine::cross_entropy(&x, &targets, p).unwrap();
        let runs = crate::bounds::cross_entropy::executions(&x, &targets, &r, &family);
        assert_eq!(runs, expect(&ce, &each));
        let ceg = |p: &Policy| engine::cross_entropy_backward(&x, &targets, 0.5, p).unwrap();
        let runs = crate::bounds::cross_entropy::grad::executions(&x, &targets, 0.5, (&r, &family));
        assert_eq!(runs, expect(&ceg, &each));
        // Attention: Q, K, V [6, 4], packed per token as [1, 6, 12] for the engine.
        let (q, k, v) = (t(&[6, 4], 4), t(&[6, 4], 5), t(&[6, 4], 6));
        let mut qkv = vec![];
        for i in 0..6 {
            for m in [&q, &k, &v] {
                qkv.extend_from_slice(&m.values()[i * 4..(i + 1) * 4]);
            }
        }
        let qkv = Tensor::from_vec(&[1, 6, 12], qkv, Format::BF16).unwrap();
        let (sr, mut sc) = (OpSide::new(r.clone()), OpSide::new(family.clone()));
        sc.form = online;
        let att = |p: &Policy| {
            let form = if p == &r { std_ } else { online };
            engine::attention(&qkv, 1, true, form, p).unwrap().0
        };
        let runs = crate::bounds::attention::executions((&q, &k, &v), true, &sr, &sc);
        assert_eq!(runs, expect(&att, &each));
        // Cross-attention (another key count) is not what the engine runs.
        let k2 = t(&[5, 4], 5);
        let runs = crate::bounds::attention::executions((&q, &k2, &k2), true, &sr, &sc);
        assert_eq!(runs, None);
        use crate::bounds::elementwise::executions as elementwise_runs;
        let cf = vec![Policy::new(Format::BF16, Format::BF16, Format::BF16)];
        let gelu = |p: &Policy| engine::gelu(&x, p).unwrap();
        let silu = |p: &Policy| engine::silu(&x, p).unwrap();
        for (op, run) in [
            (Elementwise::Gelu, &gelu as &dyn Fn(&Policy) -> Tensor),
            (Elementwise::Silu, &silu),
        ] {
            assert_eq!(elementwise_runs(op, &x, None, &r, &cf[0]), expect(run, &cf));
        }
        let y = t(&[3, 16], 7);
        let add = |p: &Policy| engine::add(&x, &y, p).unwrap();
        let runs = elementwise_runs(Elementwise::Add, &x, Some(&y), &r, &cf[0]);
        assert_eq!(runs, expect(&add, &cf));
        let scale = |p: &Policy| engine::scale(&x, 0.3, p).unwrap();
        let runs = elementwise_runs(Elementwise::Scale { c: 0.3 }, &x, None, &r, &cf[0]);
        assert_eq!(runs, expect(&scale, &cf));
        let exp = |p: &Policy| engine::exp(&x, p).unwrap();
        let runs = elementwise_runs(Elementwise::Exp, &x, None, &r, &cf[0]);
        assert_eq!(runs, expect(&exp, &cf));
    }
}

//! A probabilistic threshold checked by the engine's own executions of the two declared sides
//! (papers/bounds-reductions.md §4, "The model checked by the executions").
//!
//! A probabilistic threshold rests on the random-rounding model; the guaranteed one does not.
//! Where both sides of a comparison are executions the engine can run — one order each (no
//! family), the op's form and arithmetic declared — running them costs about the op, next to
//! the tens to hundreds of times the op that pricing takes, and their difference D is one draw
//! the model must cover. Under the model ‖D‖ and max |Dᵢ| exceed the model's threshold at
//! δ_s = min(δ, [`MODEL_CHECK_DELTA`]) with probability at most δ_s; where they do, the data
//! carry structure the model does not capture (roundings that move together across elements,
//! or data built against the uniform phase), and the guaranteed threshold is returned instead,
//! marked [`Confidence::Guaranteed`]. Every op's threshold function goes through here, so a
//! probabilistic threshold never falls below the difference of the declared executions.

use crate::bounds::compare::{Confidence, Threshold};
use crate::error::Result;

/// The failure probability at which the engine's executions of the two declared sides test
/// the model behind a probabilistic threshold (`checked_by_executions`).
pub const MODEL_CHECK_DELTA: f64 = 1e-3;

/// The threshold `build` gives at `confidence`, checked first, when it is probabilistic, by
/// `executions` (both sides' outputs, or `None` where they cannot be run): where their
/// difference exceeds the model's threshold at δ_s = min(δ, [`MODEL_CHECK_DELTA`]) (the
/// tensor norm or one element), the guaranteed threshold (module docs). The executions run
/// beside the first pricing (`parallel::join`); `build` runs once
/// when the check passes at δ ≤ [`MODEL_CHECK_DELTA`] (the default δ = 10⁻⁶), at most three
/// times otherwise.
///
/// # Errors
///
/// `build`'s.
pub(crate) fn checked_by_executions(
    confidence: Confidence,
    build: &(dyn Fn(Confidence) -> Result<Threshold> + Sync),
    executions: &(dyn Fn() -> Option<(Vec<f64>, Vec<f64>)> + Sync),
) -> Result<Threshold> {
    let Confidence::Probabilistic { delta } = confidence else {
        return build(confidence);
    };
    // The executions run beside the pricing where a thread is free.
    let (threshold, runs) = crate::parallel::join(|| build(confidence), executions);
    let threshold = threshold?;
    if threshold.identical {
        return Ok(threshold);
    }
    let Some((r, c)) = runs else {
        return Ok(threshold);
    };
    if r.len() != c.len() || !r.iter().chain(&c).all(|v| v.is_finite()) {
        return Ok(threshold);
    }
    let (mut sq, mut max) = (0.0f64, 0.0f64);
    for (x, y) in r.iter().zip(&c) {
        let d = (y - x).abs();
        sq += d * d;
        max = max.max(d);
    }
    let check_delta = delta.min(MODEL_CHECK_DELTA);
    let check = if check_delta == delta {
        threshold.clone()
    } else {
        build(Confidence::Probabilistic { delta: check_delta })?
    };
    if sq.sqrt() > check.abs_frobenius || max > check.per_element {
        build(Confidence::Guaranteed)
    } else {
        Ok(threshold)
    }
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
        let run = |d: Vec<f64>| move || Some((vec![0.0; d.len()], d.clone()));
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
        // A guaranteed request is never checked.
        let t = checked_by_executions(Confidence::Guaranteed, &build, &run(vec![50.0])).unwrap();
        assert_eq!(t.abs_frobenius, 10.0);
    }

    /// Every op's executions run, for both sides, as the engine's public entry points run
    /// them (so that no check is skipped silently), and none for a family of orders.
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
        let family = r
            .clone()
            .with_order(Order::AnyOf(vec![Order::Sequential, Order::pairwise(4)]));
        let vals = |y: Tensor| y.into_values();
        let x = t(&[3, 16], 1);
        let online = AttentionImpl::Online { block: 4 };
        let std_ = AttentionImpl::Standard;
        assert_eq!(
            crate::bounds::softmax::executions(&x, (&r, std_), (&c, online)),
            Some((
                vals(engine::softmax(&x, &r).unwrap()),
                vals(engine::online_softmax(&x, 4, &c).unwrap())
            ))
        );
        // The standard form on both sides (numerators computed once where alike, and apart
        // for an accumulator of its own).
        let bf = Policy::new(Format::BF16, Format::BF16, Format::F32);
        for other in [&c, &bf] {
            assert_eq!(
                crate::bounds::softmax::executions(&x, (&r, std_), (other, std_)),
                Some((
                    vals(engine::softmax(&x, &r).unwrap()),
                    vals(engine::softmax(&x, other).unwrap())
                ))
            );
        }
        assert_eq!(
            crate::bounds::softmax::executions(&x, (&r, std_), (&family, std_)),
            None
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
        assert_eq!(
            crate::bounds::norm::executions(&data, side(two, &r), side(welford, &c)),
            Some((
                vals(
                    engine::layer_norm(&x, &w, &b, 1e-5, Variance::TwoPass, &r)
                        .unwrap()
                        .0
                ),
                vals(
                    engine::layer_norm(&x, &w, &b, 1e-5, Variance::Welford, &c)
                        .unwrap()
                        .0
                )
            ))
        );
        let rms = NormData { bias: None, ..data };
        assert_eq!(
            crate::bounds::norm::executions(
                &rms,
                side(NormOp::RmsNorm, &r),
                side(NormOp::RmsNorm, &c)
            ),
            Some((
                vals(engine::rms_norm(&x, &w, 1e-5, &r).unwrap().0),
                vals(engine::rms_norm(&x, &w, 1e-5, &c).unwrap().0)
            ))
        );
        assert_eq!(
            crate::bounds::norm::executions(&data, side(two, &r), side(two, &family)),
            None
        );
        let targets = [3, 0, 15];
        assert_eq!(
            crate::bounds::cross_entropy::executions(&x, &targets, &r, &c),
            Some((
                vals(engine::cross_entropy(&x, &targets, &r).unwrap()),
                vals(engine::cross_entropy(&x, &targets, &c).unwrap())
            ))
        );
        assert_eq!(
            crate::bounds::cross_entropy::grad::executions(&x, &targets, 0.5, (&r, &c)),
            Some((
                vals(engine::cross_entropy_backward(&x, &targets, 0.5, &r).unwrap()),
                vals(engine::cross_entropy_backward(&x, &targets, 0.5, &c).unwrap())
            ))
        );
        assert_eq!(
            crate::bounds::cross_entropy::executions(&x, &targets, &family, &c),
            None
        );
        // Attention: Q, K, V [6, 4], packed per token as [1, 6, 12] for the engine.
        let (q, k, v) = (t(&[6, 4], 4), t(&[6, 4], 5), t(&[6, 4], 6));
        let mut qkv = vec![];
        for i in 0..6 {
            for m in [&q, &k, &v] {
                qkv.extend_from_slice(&m.values()[i * 4..(i + 1) * 4]);
            }
        }
        let qkv = Tensor::from_vec(&[1, 6, 12], qkv, Format::BF16).unwrap();
        let (sr, mut sc) = (OpSide::new(r.clone()), OpSide::new(c.clone()));
        sc.form = online;
        assert_eq!(
            crate::bounds::attention::executions((&q, &k, &v), true, &sr, &sc),
            Some((
                vals(engine::attention(&qkv, 1, true, std_, &r).unwrap().0),
                vals(engine::attention(&qkv, 1, true, online, &c).unwrap().0)
            ))
        );
        // Cross-attention (other key count) is not what the engine runs.
        let k2 = t(&[5, 4], 5);
        assert_eq!(
            crate::bounds::attention::executions((&q, &k2, &k2), true, &sr, &sc),
            None
        );
        let cf = Policy::new(Format::BF16, Format::BF16, Format::BF16);
        for (op, run) in [
            (
                Elementwise::Gelu,
                engine::gelu as fn(&Tensor, &Policy) -> crate::Result<Tensor>,
            ),
            (Elementwise::Silu, engine::silu),
        ] {
            assert_eq!(
                crate::bounds::elementwise::executions(op, &x, None, &r, &cf),
                Some((vals(run(&x, &r).unwrap()), vals(run(&x, &cf).unwrap())))
            );
        }
        let y = t(&[3, 16], 7);
        assert_eq!(
            crate::bounds::elementwise::executions(Elementwise::Add, &x, Some(&y), &r, &cf),
            Some((
                vals(engine::add(&x, &y, &r).unwrap()),
                vals(engine::add(&x, &y, &cf).unwrap())
            ))
        );
        let s = Elementwise::Scale { c: 0.3 };
        assert_eq!(
            crate::bounds::elementwise::executions(s, &x, None, &r, &cf),
            Some((
                vals(engine::scale(&x, 0.3, &r).unwrap()),
                vals(engine::scale(&x, 0.3, &cf).unwrap())
            ))
        );
        assert_eq!(
            crate::bounds::elementwise::executions(Elementwise::Exp, &x, None, &r, &cf),
            None
        );
    }
}

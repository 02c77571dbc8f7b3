//! Softmax, elementwise ops, FP8 quantization, gains and norms: thresholds hold against the engine.

use super::*;

/// Softmax, standard and online, in different orders and output formats: guaranteed and
/// probabilistic (δ = 1e-6) thresholds hold on random logits of several scales.
#[test]
fn softmax_thresholds_hold() {
    use ttrace::bounds::softmax_threshold;
    use ttrace::engine::{online_softmax, softmax, AttentionImpl};
    let run = |x: &Tensor, p: &Policy, imp: AttentionImpl| match imp {
        AttentionImpl::Standard => softmax(x, p).unwrap(),
        AttentionImpl::Online { block } => online_softmax(x, block, p).unwrap(),
    };
    let mut trials = 0;
    let mut worst_use = 0.0f64;
    for t in 0..40u64 {
        let n = [16, 128, 1024, 4096][(t % 4) as usize];
        let scale = [1.0, 4.0, 12.0][(t % 3) as usize];
        let x: Vec<f64> = data(8 * n, t, (t % 2) as u8, Format::BF16)
            .into_iter()
            .map(|v| Format::BF16.round(v * scale, Overflow::Saturating))
            .collect();
        let x = Tensor::from_vec(&[8, n], x, Format::BF16).unwrap();
        for out in [Format::BF16, Format::F32] {
            let seq = Policy::new(Format::BF16, Format::F32, out);
            let pw = seq.clone().with_order(Order::Pairwise { base: 8 });
            for (rp, ri, cp, ci) in [
                (&seq, AttentionImpl::Standard, &pw, AttentionImpl::Standard),
                (
                    &seq,
                    AttentionImpl::Standard,
                    &seq,
                    AttentionImpl::Online { block: 64 },
                ),
                (
                    &pw,
                    AttentionImpl::Online { block: 32 },
                    &seq,
                    AttentionImpl::Online { block: 128 },
                ),
            ] {
                let d = frob(run(&x, rp, ri).values(), run(&x, cp, ci).values());
                let p = softmax_threshold(&x, rp, ri, cp, ci, Confidence::default_probabilistic())
                    .unwrap();
                let g = softmax_threshold(&x, rp, ri, cp, ci, Confidence::Guaranteed).unwrap();
                assert!(
                    d <= p.abs_frobenius,
                    "trial {t} n={n} {ri:?} vs {ci:?} out {out}: {d:e} > {:e}",
                    p.abs_frobenius
                );
                assert!(
                    d <= g.abs_frobenius,
                    "guaranteed: {d:e} > {:e}",
                    g.abs_frobenius
                );
                worst_use = worst_use.max(d / p.abs_frobenius);
                trials += 1;
            }
        }
    }
    eprintln!("softmax: {trials} trials, largest observed / threshold = {worst_use:.3}");
    let seq = Policy::new(Format::BF16, Format::F32, Format::BF16);
    let x = Tensor::from_vec(&[2, 3], vec![0.0, 1.0, 2.0, 0.5, 0.25, 0.0], Format::BF16).unwrap();
    assert!(
        softmax_threshold(
            &x,
            &seq,
            AttentionImpl::Standard,
            &seq,
            AttentionImpl::Standard,
            Confidence::Guaranteed
        )
        .unwrap()
        .identical
    );
    let other = Policy::new(Format::BF16, Format::BF16, Format::BF16);
    assert!(softmax_threshold(
        &x,
        &seq,
        AttentionImpl::Standard,
        &other,
        AttentionImpl::Standard,
        Confidence::Guaranteed
    )
    .err()
    .is_some_and(|e| matches!(e, ttrace::Error::InvalidParameter { .. })));
}

/// Elementwise ops between policies that differ in accumulator and output formats.
#[test]
fn elementwise_thresholds_hold() {
    use ttrace::bounds::{elementwise_threshold, Elementwise};
    use ttrace::engine::{add, gelu, scale, silu};
    let policies = [
        Policy::new(Format::BF16, Format::F32, Format::BF16),
        Policy::new(Format::BF16, Format::F32, Format::F32),
        Policy::new(Format::BF16, Format::BF16, Format::BF16),
        Policy::new(Format::F32, Format::F32, Format::F16),
    ];
    for t in 0..30u64 {
        let x = Tensor::from_vec(
            &[64, 32],
            data(2048, t, (t % 5) as u8, Format::BF16),
            Format::BF16,
        )
        .unwrap();
        let y =
            Tensor::from_vec(&[64, 32], data(2048, t + 50, 0, Format::BF16), Format::BF16).unwrap();
        for rp in &policies {
            for cp in &policies {
                for op in [
                    Elementwise::Add,
                    Elementwise::Scale { c: 0.125 },
                    Elementwise::Scale { c: 0.1 },
                    Elementwise::Gelu,
                    Elementwise::Silu,
                ] {
                    let run = |p: &Policy| match op {
                        Elementwise::Add => add(&x, &y, p).unwrap(),
                        Elementwise::Scale { c } => scale(&x, c, p).unwrap(),
                        Elementwise::Gelu => gelu(&x, p).unwrap(),
                        Elementwise::Silu => silu(&x, p).unwrap(),
                        Elementwise::Exp => unreachable!(),
                    };
                    let (r, c) = (run(rp), run(cp));
                    let d = frob(r.values(), c.values());
                    let yy = (op == Elementwise::Add).then_some(&y);
                    let p = elementwise_threshold(
                        op,
                        &x,
                        yy,
                        rp,
                        cp,
                        Confidence::default_probabilistic(),
                    )
                    .unwrap();
                    let g =
                        elementwise_threshold(op, &x, yy, rp, cp, Confidence::Guaranteed).unwrap();
                    assert!(
                        d <= p.abs_frobenius,
                        "{op:?} {rp:?} vs {cp:?}: {d:e} > {:e}",
                        p.abs_frobenius
                    );
                    assert!(d <= g.abs_frobenius);
                    let maxd = r
                        .values()
                        .iter()
                        .zip(c.values())
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f64::max);
                    assert!(
                        maxd <= g.per_element,
                        "{op:?}: per element {maxd:e} > {:e}",
                        g.per_element
                    );
                    if rp == cp {
                        assert!(p.identical && d == 0.0);
                    }
                }
            }
        }
    }
}

/// FP8 quantization: the a-priori bound holds against the exact quantization, for per-tensor
/// current scaling and MX blocks, E4M3 and E5M2.
#[test]
fn quantization_error_within_a_priori_bound() {
    use ttrace::bounds::quantization_error;
    for t in 0..50u64 {
        let x = Tensor::from_vec(
            &[16, 64],
            data(1024, t, (t % 5) as u8, Format::BF16),
            Format::BF16,
        )
        .unwrap();
        for fmt in [Format::E4M3, Format::E5M2] {
            for scaling in [
                Scaling::PerTensorCurrent { margin: 0 },
                Scaling::Block { size: 32 },
            ] {
                let q = quantization_error(&x, 1, fmt, scaling).unwrap();
                assert!(
                    q.frobenius <= q.bound_frobenius,
                    "{fmt} {scaling:?}: {} > {}",
                    q.frobenius,
                    q.bound_frobenius
                );
                // Relative to the data, the error is of the order of the FP8 unit roundoff.
                let norm = x.values().iter().map(|v| v * v).sum::<f64>().sqrt();
                assert!(q.frobenius <= 2.0 * fmt.unit_roundoff() * norm + 1e-30);
            }
        }
    }
    assert!(quantization_error(
        &Tensor::zeros(&[4], Format::BF16),
        0,
        Format::E4M3,
        Scaling::None
    )
    .err()
    .is_some_and(|e| matches!(e, ttrace::Error::ShapeMismatch { .. })));
}

/// First-order gains bound how an input difference is carried: checked with small random
/// perturbations in F64.
#[test]
fn gains_bound_propagated_differences() {
    use ttrace::bounds::{elementwise_gain, matmul_gain, norm_gain, softmax_gain, Elementwise};
    use ttrace::engine::{gelu, layer_norm, silu, softmax, Variance};
    let p64 = Policy::uniform(Format::F64);
    for t in 0..20u64 {
        let x = Tensor::from_vec(&[8, 16], data(128, t, 0, Format::F64), Format::F64).unwrap();
        let dx: Vec<f64> = data(128, t + 1, 0, Format::F64)
            .into_iter()
            .map(|v| v * 1e-6)
            .collect();
        let xp = Tensor::from_vec(
            &[8, 16],
            x.values().iter().zip(&dx).map(|(a, b)| a + b).collect(),
            Format::F64,
        )
        .unwrap();
        let ndx = dx.iter().map(|v| v * v).sum::<f64>().sqrt();
        let b = Tensor::from_vec(&[16, 5], data(80, t + 2, 0, Format::F64), Format::F64).unwrap();
        let dmm = frob(
            matmul(&x, &b, &p64).unwrap().values(),
            matmul(&xp, &b, &p64).unwrap().values(),
        );
        assert!(dmm <= matmul_gain(&b).gain * ndx * (1.0 + 1e-9));
        for (op, f) in [
            (
                Elementwise::Gelu,
                gelu as fn(&Tensor, &Policy) -> ttrace::Result<Tensor>,
            ),
            (Elementwise::Silu, silu),
        ] {
            let d = frob(
                f(&x, &p64).unwrap().values(),
                f(&xp, &p64).unwrap().values(),
            );
            assert!(
                d <= elementwise_gain(op, &x, 1e-5).gain * ndx * (1.0 + 1e-6),
                "{op:?}"
            );
        }
        let s = softmax(&x, &p64).unwrap();
        let ds = frob(s.values(), softmax(&xp, &p64).unwrap().values());
        assert!(ds <= softmax_gain(&s).gain * ndx * (1.0 + 1e-4));
        let w = Tensor::from_vec(&[16], data(16, t + 3, 0, Format::F64), Format::F64).unwrap();
        let bias = Tensor::zeros(&[16], Format::F64);
        let (y, saved) = layer_norm(&x, &w, &bias, 1e-5, Variance::TwoPass, &p64).unwrap();
        let (yp, _) = layer_norm(&xp, &w, &bias, 1e-5, Variance::TwoPass, &p64).unwrap();
        assert!(
            frob(y.values(), yp.values()) <= norm_gain(&w, &saved.rstd).gain * ndx * (1.0 + 1e-4)
        );
    }
}

/// LayerNorm (two-pass / one-pass) and RMSNorm between orders, variance algorithms and output
/// formats, on centred and offset data (where one-pass cancels).
#[test]
fn norm_thresholds_hold() {
    use ttrace::bounds::{norm_threshold, NormOp};
    use ttrace::engine::{layer_norm, rms_norm, Variance};
    let mut worst = 0.0f64;
    let mut count = 0;
    for t in 0..30u64 {
        let n = [16, 256, 1024][(t % 3) as usize];
        let kind = (t % 5) as u8;
        let x =
            Tensor::from_vec(&[8, n], data(8 * n, t, kind, Format::BF16), Format::BF16).unwrap();
        let w = Tensor::from_vec(
            &[n],
            data(n, t + 1, 0, Format::BF16)
                .into_iter()
                .map(|v| Format::BF16.round(1.0 + 0.1 * v, Overflow::NonSaturating))
                .collect(),
            Format::BF16,
        )
        .unwrap();
        let b = Tensor::from_vec(
            &[n],
            data(n, t + 2, 0, Format::BF16)
                .into_iter()
                .map(|v| Format::BF16.round(0.1 * v, Overflow::NonSaturating))
                .collect(),
            Format::BF16,
        )
        .unwrap();
        for out in [Format::BF16, Format::F32] {
            let seq = Policy::new(Format::BF16, Format::F32, out);
            let pw = seq.clone().with_order(Order::Pairwise { base: 8 });
            let cases = [
                (
                    NormOp::LayerNorm(Variance::TwoPass),
                    &seq,
                    NormOp::LayerNorm(Variance::TwoPass),
                    &pw,
                ),
                (
                    NormOp::LayerNorm(Variance::TwoPass),
                    &seq,
                    NormOp::LayerNorm(Variance::OnePass),
                    &seq,
                ),
                (
                    NormOp::LayerNorm(Variance::TwoPass),
                    &pw,
                    NormOp::LayerNorm(Variance::OnePass),
                    &seq,
                ),
                (NormOp::RmsNorm, &seq, NormOp::RmsNorm, &pw),
            ];
            for (ro, rp, co, cp) in cases {
                let run = |op: NormOp, p: &Policy| match op {
                    NormOp::LayerNorm(v) => layer_norm(&x, &w, &b, 1e-5, v, p).unwrap().0,
                    NormOp::RmsNorm => rms_norm(&x, &w, 1e-5, p).unwrap().0,
                };
                let bias = if ro == NormOp::RmsNorm {
                    None
                } else {
                    Some(&b)
                };
                let d = frob(run(ro, rp).values(), run(co, cp).values());
                let data = NormData {
                    x: &x,
                    weight: &w,
                    bias,
                    eps: 1e-5,
                };
                let (rs, cs) = (
                    NormSide { op: ro, policy: rp },
                    NormSide { op: co, policy: cp },
                );
                let th =
                    norm_threshold(&data, rs, cs, Confidence::default_probabilistic()).unwrap();
                let g = norm_threshold(&data, rs, cs, Confidence::Guaranteed).unwrap();
                assert!(
                    d <= g.abs_frobenius,
                    "guaranteed t={t} {ro:?}/{co:?}: {d:e} > {:e}",
                    g.abs_frobenius
                );
                // Includes data with a handful of distinct values (kind 4, BF16 near ±100),
                // whose repeated squares make coherent rounding errors (grouped by the model).
                assert!(
                    d <= th.abs_frobenius,
                    "t={t} n={n} kind={kind} {ro:?}/{co:?} out {out}: {d:e} > {:e}",
                    th.abs_frobenius
                );
                worst = worst.max(d / th.abs_frobenius);
                count += 1;
            }
        }
    }
    eprintln!("norm: {count} comparisons, largest observed / threshold = {worst:.3}");
}

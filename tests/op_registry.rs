//! The op registry: every op's threshold through `op_threshold` holds against the reference
//! engine's two executions (an independent implementation: the engine computes the op, the
//! bounds price it), is the threshold of the op's own model (the dispatch loses nothing:
//! `linear` is `matmul` on the transposed weight), and bad operand counts are refused with
//! the variant.

use ttrace::bounds::{
    elementwise_threshold, matmul_threshold, norm_threshold, op_threshold, softmax_threshold,
    sum_threshold, Confidence, Elementwise, NormData, NormOp, NormSide, Op, OpOptions, OpSide,
    OperandRole,
};
use ttrace::engine::{
    add, cross_entropy, cross_entropy_backward, gelu, layer_norm, linear, matmul, normal_values,
    online_softmax, rms_norm, scale, silu, softmax, AttentionImpl, Variance,
};
use ttrace::{sum, Accumulation, Error, Format, Overflow, Policy, Tensor};

fn synthetic(shape: &[usize], role: OperandRole, seed: &str, f: Format) -> Tensor {
    let n = shape.iter().product();
    let (mean, std) = match role {
        OperandRole::Data => (0.3, 1.0),
        OperandRole::NormWeight => (1.0, 0.1),
        OperandRole::NormBias => (0.0, 0.1),
        // Class indices below 5 (every op's operands are drawn with at least 5 columns).
        OperandRole::ClassIndex => {
            let v = (0..n).map(|i| ((i * 7 + 3) % 5) as f64).collect();
            return Tensor::from_vec(shape, v, Format::F64).unwrap();
        }
    };
    let v = normal_values(seed, n, mean, std, 7);
    Tensor::rounded(shape, v, f, Overflow::Saturating).unwrap()
}

fn frobenius(a: &Tensor, b: &Tensor) -> f64 {
    a.values()
        .iter()
        .zip(b.values())
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt()
}

/// Row sums of `x` [rows, n] under `p` (the engine's reduction), divided by n for a mean.
fn row_sums(x: &Tensor, p: &Policy, mean: bool) -> Tensor {
    let n = *x.shape().last().unwrap();
    let rows = x.len() / n;
    let acc: &Accumulation = &p.accumulation;
    let v: Vec<f64> = (0..rows)
        .map(|r| {
            let s = sum(&x.values()[r * n..(r + 1) * n], acc).unwrap();
            let s = if mean {
                p.accumulator().round(s / n as f64, Overflow::NonSaturating)
            } else {
                s
            };
            p.output.round(s, Overflow::NonSaturating)
        })
        .collect();
    Tensor::from_vec(&[rows], v, p.output).unwrap()
}

/// The engine's execution of `op` on `inputs` under one side.
fn execute(op: Op, inputs: &[&Tensor], side: &OpSide, eps: f64) -> Option<Tensor> {
    let p = &side.policy;
    Some(match op {
        Op::Matmul => matmul(inputs[0], inputs[1], p).unwrap(),
        Op::Linear => linear(inputs[0], inputs[1], inputs.get(2).copied(), p).unwrap(),
        Op::Sum | Op::Mean => row_sums(inputs[0], p, op == Op::Mean),
        Op::Softmax => match side.form {
            AttentionImpl::Standard => softmax(inputs[0], p).unwrap(),
            AttentionImpl::Online { block } => online_softmax(inputs[0], block, p).unwrap(),
        },
        Op::LayerNorm => {
            layer_norm(inputs[0], inputs[1], inputs[2], eps, side.variance, p)
                .unwrap()
                .0
        }
        Op::RmsNorm => rms_norm(inputs[0], inputs[1], eps, p).unwrap().0,
        Op::Elementwise(Elementwise::Add) => add(inputs[0], inputs[1], p).unwrap(),
        Op::Elementwise(Elementwise::Scale { c }) => scale(inputs[0], c, p).unwrap(),
        Op::Elementwise(Elementwise::Gelu) => gelu(inputs[0], p).unwrap(),
        Op::Elementwise(Elementwise::Silu) => silu(inputs[0], p).unwrap(),
        Op::CrossEntropy => {
            let t: Vec<usize> = inputs[1].values().iter().map(|&v| v as usize).collect();
            cross_entropy(inputs[0], &t, p).unwrap()
        }
        Op::CrossEntropyGrad => {
            let t: Vec<usize> = inputs[1].values().iter().map(|&v| v as usize).collect();
            cross_entropy_backward(inputs[0], &t, 1.0, p).unwrap()
        }
        Op::Attention { causal } => {
            // One head: qkv [1, n, 3d] from q, k, v [n, d].
            let (n, d) = (inputs[0].shape()[0], inputs[0].shape()[1]);
            let mut qkv = Vec::with_capacity(n * 3 * d);
            for i in 0..n {
                for t in &inputs[..3] {
                    qkv.extend_from_slice(&t.values()[i * d..(i + 1) * d]);
                }
            }
            let qkv = Tensor::from_vec(&[1, n, 3 * d], qkv, inputs[0].format()).unwrap();
            let (o, _) = ttrace::engine::attention(&qkv, 1, causal, side.form, p).unwrap();
            Tensor::from_vec(&[n, d], o.into_values(), p.output).unwrap()
        }
        _ => return None,
    })
}

/// Every op the engine executes: the registry's guaranteed threshold holds for the engine's
/// two executions, and its probabilistic one is the op model's own, bit for bit.
#[test]
fn every_op_through_the_registry_holds_against_the_engine() {
    let reference: OpSide = "in=bf16,acc=f32,out=bf16,order=sequential".parse().unwrap();
    let mut candidate: OpSide = "in=bf16,acc=f32,out=bf16,order=pairwise:4,form=online:8,\
                                 variance=welford"
        .parse()
        .unwrap();
    let options = OpOptions::default();
    let mut executed = 0;
    for name in Op::NAMES {
        let op: Op = name.replace("scale:C", "scale:0.37").parse().unwrap();
        // Elementwise ops share the accumulator order; pairwise only matters to reductions.
        candidate.policy.accumulation.order = match op {
            Op::Elementwise(_) => reference.policy.accumulation.order.clone(),
            _ => "pairwise:4".parse().unwrap(),
        };
        let operands = op.operands(6, 32, 5);
        let tensors: Vec<Tensor> = operands
            .iter()
            .map(|o| synthetic(&o.shape, o.role, &format!("{op}.{}", o.name), Format::BF16))
            .collect();
        let inputs: Vec<&Tensor> = tensors.iter().collect();
        let g = op_threshold(
            op,
            &inputs,
            &reference,
            &candidate,
            &options,
            Confidence::Guaranteed,
        )
        .unwrap();
        let conf = Confidence::probabilistic(1e-6).unwrap();
        let t = op_threshold(op, &inputs, &reference, &candidate, &options, conf).unwrap();
        assert!(t.abs_frobenius <= g.abs_frobenius * (1.0 + 1e-12), "{op}");
        // The op's own model, called directly.
        let (rp, cp) = (&reference.policy, &candidate.policy);
        let direct = match op {
            Op::Matmul => Some(matmul_threshold(inputs[0], inputs[1], None, rp, cp, conf)),
            Op::Linear => {
                let w = ttrace::engine::transpose(inputs[1], "w").unwrap();
                Some(matmul_threshold(inputs[0], &w, None, rp, cp, conf))
            }
            Op::Sum | Op::Mean => Some(sum_threshold(inputs[0], rp, cp, op == Op::Mean, conf)),
            Op::Softmax => Some(softmax_threshold(
                inputs[0],
                rp,
                reference.form,
                cp,
                candidate.form,
                conf,
            )),
            Op::LayerNorm => Some(norm_threshold(
                &NormData {
                    x: inputs[0],
                    weight: inputs[1],
                    bias: Some(inputs[2]),
                    eps: options.norm_eps,
                },
                NormSide {
                    op: NormOp::LayerNorm(Variance::TwoPass),
                    policy: rp,
                },
                NormSide {
                    op: NormOp::LayerNorm(Variance::Welford),
                    policy: cp,
                },
                conf,
            )),
            Op::Elementwise(e) => Some(elementwise_threshold(
                e,
                inputs[0],
                inputs.get(1).copied(),
                rp,
                cp,
                conf,
            )),
            _ => None,
        };
        if let Some(d) = direct {
            assert_eq!(
                d.unwrap(),
                t,
                "{op}: the registry's threshold is the model's"
            );
        }
        if let (Some(r), Some(c)) = (
            execute(op, &inputs, &reference, options.norm_eps),
            execute(op, &inputs, &candidate, options.norm_eps),
        ) {
            let d = frobenius(&r, &c);
            assert!(
                d <= g.abs_frobenius,
                "{op}: {d:e} > guaranteed {:e}",
                g.abs_frobenius
            );
            // The threshold counts the elements of the result the engine makes, so that
            // `check` can refuse tensors of other data.
            assert_eq!(t.elements, r.len(), "{op}");
            executed += 1;
        }
    }
    assert_eq!(executed, 15, "every op but exp and allreduce executed");
}

/// `linear` hands nn.Linear's weight [n, k] to the fast paths as it lies (B's columns) and to
/// the walk transposed: the thresholds are those of `matmul` on the transposed weight on every
/// path (the pass bit for bit; the guaranteed GEMMs up to the order of their f64 column sums),
/// and they hold for the engine's executions.
#[test]
fn linear_reads_the_weight_as_it_lies() {
    use ttrace::bounds::{matmul_threshold_priced, Pricing};
    let reference: OpSide = "in=bf16,acc=f32,out=bf16".parse().unwrap();
    let candidate: OpSide = "in=bf16,acc=f32,out=bf16,order=splitk:4:f32:tree"
        .parse()
        .unwrap();
    // 4,096 outputs: the pass follows grids only (fewer: exact values and parities too).
    let (m, k, n) = (64, 128, 64);
    let role = OperandRole::Data;
    let x = synthetic(&[m, k], role, "linear.x", Format::BF16);
    let w = synthetic(&[n, k], role, "linear.w", Format::BF16);
    let bias = synthetic(&[n], role, "linear.bias", Format::BF16);
    let wt = ttrace::engine::transpose(&w, "w").unwrap();
    let (rp, cp) = (&reference.policy, &candidate.policy);
    let run = |p: &Policy| linear(&x, &w, Some(&bias), p).unwrap();
    let (r, c) = (run(rp), run(cp));
    for pricing in [Pricing::Auto, Pricing::Fast, Pricing::Walk] {
        let options = OpOptions {
            pricing,
            ..OpOptions::default()
        };
        for conf in [Confidence::Guaranteed, Confidence::default_probabilistic()] {
            let inputs = [&x, &w, &bias];
            let got =
                op_threshold(Op::Linear, &inputs, &reference, &candidate, &options, conf).unwrap();
            let want =
                matmul_threshold_priced(&x, &wt, Some(&bias), rp, cp, conf, pricing).unwrap();
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs();
            assert!(
                close(got.abs_frobenius, want.abs_frobenius)
                    && close(got.per_element, want.per_element),
                "{pricing:?} {conf:?}: {got:?} vs {want:?}"
            );
            if matches!(conf, Confidence::Probabilistic { .. }) {
                assert_eq!(got, want, "{pricing:?}: the model's threshold bit for bit");
            }
            assert!(got.check(&r, &c).passed, "{pricing:?} {conf:?}");
        }
    }
}

/// A threshold judges only results of the data it priced: tensors of another element count,
/// or of none (a vacuous pass), fail with the reason, whatever their difference.
#[test]
fn check_refuses_tensors_the_threshold_was_not_priced_for() {
    let side: OpSide = "in=f32,acc=f32,out=f32".parse().unwrap();
    let cand: OpSide = "in=f32,acc=f32,out=f32,order=pairwise:2".parse().unwrap();
    let x = synthetic(&[4, 8], OperandRole::Data, "check.x", Format::F32);
    let t = op_threshold(
        Op::Sum,
        &[&x],
        &side,
        &cand,
        &OpOptions::default(),
        Confidence::Guaranteed,
    )
    .unwrap();
    assert_eq!(t.elements, 4);
    let sums = row_sums(&x, &side.policy, false);
    assert!(t.check(&sums, &sums).passed);
    // Equal tensors of another size: not what was priced.
    let other = Tensor::from_vec(&[2], vec![1.0, 2.0], Format::F32).unwrap();
    let v = t.check(&other, &other);
    assert!(!v.passed);
    assert!(
        v.problem
            .as_deref()
            .is_some_and(|p| p.contains("priced for 4")),
        "{v:?}"
    );
    let empty = Tensor::from_vec(&[0], vec![], Format::F32).unwrap();
    let v = t.check(&empty, &empty);
    assert!(!v.passed);
    assert!(
        v.problem
            .as_deref()
            .is_some_and(|p| p.contains("no element")),
        "{v:?}"
    );
}

/// Operand counts outside an op's arity are refused with the variant, naming the operands.
#[test]
fn bad_operand_counts_are_refused() {
    let side: OpSide = "in=f32,acc=f32,out=f32".parse().unwrap();
    let x = Tensor::from_vec(&[2, 2], vec![1.0, 2.0, 3.0, 4.0], Format::F32).unwrap();
    let o = OpOptions::default();
    for (op, n) in [
        (Op::Matmul, 1),
        (Op::Matmul, 4),
        (Op::RmsNorm, 3),
        (Op::Softmax, 2),
        (Op::AllReduce, 0),
    ] {
        let inputs = vec![&x; n];
        match op_threshold(op, &inputs, &side, &side, &o, Confidence::Guaranteed) {
            Err(Error::InvalidParameter {
                name: "inputs",
                reason,
            }) => {
                assert!(reason.contains(op.operand_names()[0]), "{reason}")
            }
            other => panic!("{op} with {n}: {other:?}"),
        }
    }
    assert!(matches!(
        "form=flash".parse::<OpSide>(),
        Err(Error::UnknownName { .. })
    ));
    assert!(matches!(
        "in=bf16,colour=red".parse::<OpSide>(),
        Err(Error::UnknownName { .. } | Error::InvalidParameter { .. })
    ));
}

/// Every op's gain (`OpModel::gain`) bounds how a small difference of its first operand moves
/// its output, against the engine's execution in FP64 (an independent implementation: the
/// model states a Lipschitz constant, the engine computes the op): ‖Δout‖_F ≤ gain·‖Δx‖_F to
/// first order. For the sum and mean the gain is reached (a difference constant along each
/// row), so it is the constant, not a loose bound.
#[test]
fn every_op_gain_bounds_how_a_difference_travels_through_it() {
    let side: OpSide = "in=f64,acc=f64,out=f64".parse().unwrap();
    let options = OpOptions::default();
    let run = |op: Op, inputs: &[&Tensor]| -> Tensor {
        match op {
            Op::AllReduce => {
                let n = inputs[0].len();
                let v = (0..n)
                    .map(|i| inputs.iter().map(|t| t.values()[i]).sum())
                    .collect();
                Tensor::from_vec(inputs[0].shape(), v, Format::F64).unwrap()
            }
            Op::Elementwise(Elementwise::Exp) => {
                let v = inputs[0].values().iter().map(|x| x.exp()).collect();
                Tensor::from_vec(inputs[0].shape(), v, Format::F64).unwrap()
            }
            _ => execute(op, inputs, &side, options.norm_eps).unwrap(),
        }
    };
    for name in Op::NAMES {
        let op: Op = name.replace("scale:C", "scale:-1.7").parse().unwrap();
        let tensors: Vec<Tensor> = op
            .operands(6, 32, 5)
            .iter()
            .map(|o| {
                synthetic(
                    &o.shape,
                    o.role,
                    &format!("gain.{op}.{}", o.name),
                    Format::F64,
                )
            })
            .collect();
        let inputs: Vec<&Tensor> = tensors.iter().collect();
        let gain = op.model().gain(&inputs, &options).unwrap().gain;
        assert!(gain.is_finite() && gain > 0.0, "{op}: gain {gain}");
        let base = run(op, &inputs);
        for (k, constant_rows) in [(0, false), (1, true)] {
            let x = inputs[0];
            let row = *x.shape().last().unwrap();
            let d = normal_values(&format!("gain.{op}.d{k}"), x.len(), 0.0, 1e-7, 7);
            let v: Vec<f64> = x
                .values()
                .iter()
                .enumerate()
                .map(|(i, v)| v + if constant_rows { d[i / row] } else { d[i] })
                .collect();
            let moved = Tensor::from_vec(x.shape(), v, Format::F64).unwrap();
            let mut shifted = inputs.clone();
            shifted[0] = &moved;
            let out = run(op, &shifted);
            let (dout, dx) = (frobenius(&out, &base), frobenius(&moved, x));
            let norm_out = base.values().iter().map(|v| v * v).sum::<f64>().sqrt();
            let allowed = gain * dx * (1.0 + 1e-4) + 1e3 * dx * dx + 1e-13 * norm_out;
            assert!(
                dout <= allowed,
                "{op}: ‖Δout‖ {dout:e} > {allowed:e} (gain {gain})"
            );
            if constant_rows && matches!(op, Op::Sum | Op::Mean) {
                assert!(
                    (dout - gain * dx).abs() <= 1e-6 * gain * dx,
                    "{op}: not reached"
                );
            }
        }
    }
}

/// The module kinds each op prices: the registry answers which op models a traced module.
#[test]
fn ops_name_the_module_kinds_they_price() {
    use ttrace::trace::ModuleKind;
    let names =
        |kind| -> Vec<String> { Op::for_module(kind).iter().map(|o| o.to_string()).collect() };
    assert_eq!(names(ModuleKind::Linear), ["linear"]);
    assert_eq!(names(ModuleKind::Norm), ["layernorm", "rmsnorm"]);
    assert_eq!(names(ModuleKind::Residual), ["add"]);
    assert_eq!(names(ModuleKind::Activation), ["gelu", "silu"]);
    assert_eq!(names(ModuleKind::Loss), ["cross_entropy"]);
    assert_eq!(
        names(ModuleKind::Attention),
        ["attention", "attention:causal"]
    );
    assert!(names(ModuleKind::Embedding).is_empty());
}

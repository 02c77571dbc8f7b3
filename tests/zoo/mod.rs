//! The data zoo: structured inputs that real training produces (non-zero means, sorted and
//! repeated values, constants, integers, outliers, heavy tails, partial sums on powers of two
//! and on rounding residues, subnormal and near-overflow magnitudes, masked and degenerate
//! softmax rows), run through every op family with a threshold and a set of policy pairs.
//!
//! Each trial executes both sides with the engine, measures ‖cand − ref‖_F and compares it
//! with the guaranteed and the probabilistic (δ = 1e-6) thresholds. For sums and dot products
//! the reference's error against the exact result is also checked against the guaranteed
//! bound of `reduction_error`, with the exact result from the big-integer oracle in
//! `tests/common` (never from the code under test).
//!
//! Used by `tests/zoo.rs` (a quick slice in `cargo test`) and by
//! `cargo run --release --example zoo` (the full sweep, writing `docs/zoo.md`).
#![allow(dead_code)]

use ttrace::bounds::{
    allreduce_threshold, attention_threshold, cross_entropy_grad_threshold,
    cross_entropy_threshold, elementwise_threshold, matmul_threshold, matmul_threshold_priced,
    norm_threshold_priced, reduction_error, softmax_threshold, sum_threshold, sum_threshold_priced,
    Confidence, Elementwise, NormData, NormOp, NormSide, Pricing, Threshold,
};
use ttrace::engine::{
    add, attention, cross_entropy, cross_entropy_backward, gelu, layer_norm, matmul,
    online_softmax, rms_norm, scale, silu, softmax, AttentionImpl, SplitMix64, Variance,
};
use ttrace::{sum, BlockSum, Combine, Error, Format, Order, Overflow, Products};
use ttrace::{Policy, Scaling, Tensor};

#[path = "../common/mod.rs"]
pub mod common;
use common::frob;

pub mod adversary;
mod family;
mod sweep;
pub use family::*;
pub use sweep::*;

/// The op families with thresholds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    Sum,
    Mean,
    /// A sum over k ranks' partials of `rows` elements (`allreduce_threshold`).
    AllReduce,
    /// An elementwise op on the [rows, k] data (the second operand of `add` Gaussian).
    Elementwise(Elementwise),
    /// A·B with A [m, k] from the family and B [k, n] Gaussian (or the family for `square`).
    Matmul,
    /// The same products priced with `Pricing::Fast` (the vectorized all-random model, the
    /// walk where its structure test fails).
    MatmulFast,
    /// Sums and means priced with `Pricing::Fast` (as ones(1 × k)·xᵀ).
    SumFast,
    MeanFast,
    Softmax(AttentionImpl),
    LayerNorm(Variance),
    RmsNorm,
    /// LayerNorm and RMSNorm priced with `Pricing::Fast` (each side's sums by the compiled
    /// all-random model, the walk where the executions do not fit it).
    LayerNormFast(Variance),
    RmsNormFast,
    /// The mean cross-entropy of the [rows, k] logits against targets drawn from the seed
    /// (within each row's unmasked classes).
    CrossEntropy,
    /// Its gradient in the logits (upstream gradient 1).
    CrossEntropyGrad,
    /// One head's attention of `rows` tokens, head dimension k: Q and K from the family, V
    /// Gaussian; every other trial causal (each side's form in the pair's ops).
    Attention(AttentionImpl),
}

impl Op {
    pub fn name(self) -> String {
        match self {
            Op::Sum => "sum".into(),
            Op::Mean => "mean".into(),
            Op::AllReduce => "all-reduce".into(),
            Op::Elementwise(Elementwise::Scale { .. }) => "scale".into(),
            Op::Elementwise(e) => format!("{e:?}").to_lowercase(),
            Op::Matmul => "matmul".into(),
            Op::MatmulFast => "matmul fast".into(),
            Op::SumFast => "sum fast".into(),
            Op::MeanFast => "mean fast".into(),
            Op::Softmax(AttentionImpl::Standard) => "softmax".into(),
            Op::Softmax(AttentionImpl::Online { block }) => format!("online softmax({block})"),
            Op::LayerNorm(v) => format!("layernorm {v:?}"),
            Op::RmsNorm => "rmsnorm".into(),
            Op::LayerNormFast(v) => format!("layernorm fast {v:?}"),
            Op::RmsNormFast => "rmsnorm fast".into(),
            Op::CrossEntropy => "cross-entropy".into(),
            Op::CrossEntropyGrad => "cross-entropy grad".into(),
            Op::Attention(AttentionImpl::Standard) => "attention".into(),
            Op::Attention(AttentionImpl::Online { block }) => format!("online attention({block})"),
        }
    }
}

/// A pair of policies with a name.
#[derive(Debug, Clone)]
pub struct Pair {
    pub name: String,
    pub reference: Policy,
    pub candidate: Policy,
    /// Softmax / norm forms of the two sides.
    pub ref_op: Op,
    pub cand_op: Op,
}

fn split(p: usize, partial: Format, combine: Combine) -> Order {
    Order::SplitK {
        parts: p,
        inner: Box::new(Order::Sequential),
        partial,
        combine,
    }
}

/// Candidate orders against a sequential reference.
pub fn orders() -> Vec<(&'static str, Order)> {
    vec![
        ("pairwise(8)", Order::Pairwise { base: 8 }),
        (
            "blocked(16)",
            Order::Blocked {
                block: 16,
                inner: BlockSum::Sequential,
            },
        ),
        (
            "block-FMA(32)",
            Order::Blocked {
                block: 32,
                inner: BlockSum::Fused,
            },
        ),
        ("splitK4 tree f32", split(4, Format::F32, Combine::Tree)),
        ("splitK8 tree f32", split(8, Format::F32, Combine::Tree)),
        (
            "TP4 ring bf16",
            split(4, Format::BF16, Combine::Ring { start: 1 }),
        ),
        (
            "splitK2 f16 partials",
            split(2, Format::F16, Combine::Sequential),
        ),
        ("kahan", Order::Kahan),
    ]
}

/// The policy pairs for an op.
pub fn pairs(op: Op) -> Vec<Pair> {
    let mut out = vec![];
    let mk = |name: String, r: Policy, c: Policy| Pair {
        name,
        reference: r,
        candidate: c,
        ref_op: op,
        cand_op: op,
    };
    match op {
        Op::Elementwise(_) => {
            let policies = [
                (
                    "bf16->bf16",
                    Policy::new(Format::BF16, Format::F32, Format::BF16),
                ),
                (
                    "bf16->f32",
                    Policy::new(Format::BF16, Format::F32, Format::F32),
                ),
                (
                    "bf16 acc",
                    Policy::new(Format::BF16, Format::BF16, Format::BF16),
                ),
            ];
            for (i, (rn, r)) in policies.iter().enumerate() {
                for (cn, c) in &policies[i + 1..] {
                    out.push(mk(format!("{rn} vs {cn}"), r.clone(), c.clone()));
                }
            }
        }
        Op::Sum
        | Op::Mean
        | Op::SumFast
        | Op::MeanFast
        | Op::Matmul
        | Op::MatmulFast
        | Op::AllReduce => {
            for (input, out_f) in [
                (Format::BF16, Format::F32),
                (Format::BF16, Format::BF16),
                (Format::F32, Format::F32),
            ] {
                let base = Policy::new(input, Format::F32, out_f);
                for (name, order) in orders() {
                    out.push(mk(
                        format!("{input}->{out_f} seq vs {name}"),
                        base.clone(),
                        base.clone().with_order(order),
                    ));
                }
            }
            if op == Op::Matmul || op == Op::MatmulFast {
                // FP8 operands with current per-tensor and block scaling, in two orders.
                for (name, scaling) in [
                    ("e4m3 per-tensor", Scaling::PerTensorCurrent { margin: 0 }),
                    ("e4m3 block(32)", Scaling::Block { size: 32 }),
                ] {
                    let base =
                        Policy::new(Format::E4M3, Format::F32, Format::BF16).with_scaling(scaling);
                    out.push(mk(
                        format!("{name} seq vs splitK4 tree f32"),
                        base.clone(),
                        base.clone()
                            .with_order(split(4, Format::F32, Combine::Tree)),
                    ));
                }
            }
            // Rounded products, FP16 accumulation, different output formats.
            let base = Policy::new(Format::BF16, Format::F32, Format::F32);
            out.push(mk(
                "bf16 products rounded to bf16 vs exact".into(),
                base.clone().with_products(Products::Rounded(Format::BF16)),
                base.clone(),
            ));
            out.push(mk(
                "f16 in, f16 acc vs f32 acc".into(),
                Policy::new(Format::F16, Format::F16, Format::F16),
                Policy::new(Format::F16, Format::F32, Format::F16),
            ));
            let f16 = Policy::new(Format::F16, Format::F16, Format::F16);
            out.push(mk(
                "f16 in, f16 acc: seq vs pairwise(8)".into(),
                f16.clone(),
                f16.with_order(Order::Pairwise { base: 8 }),
            ));
        }
        Op::Attention(_) => {
            let (std, online) = (AttentionImpl::Standard, |block| AttentionImpl::Online {
                block,
            });
            for (input, out_f) in [
                (Format::BF16, Format::BF16),
                (Format::BF16, Format::F32),
                (Format::F32, Format::F32),
            ] {
                let base = Policy::new(input, Format::F32, out_f);
                let pw = |b| base.clone().with_order(Order::Pairwise { base: b });
                for (name, rf, r, cf, c) in [
                    ("standard seq vs pairwise(8)", std, base.clone(), std, pw(8)),
                    (
                        "standard vs online(16)",
                        std,
                        base.clone(),
                        online(16),
                        base.clone(),
                    ),
                    (
                        "online(8) pairwise(4) vs online(32)",
                        online(8),
                        pw(4),
                        online(32),
                        base.clone(),
                    ),
                ] {
                    out.push(Pair {
                        name: format!("{input}->{out_f} {name}"),
                        reference: r,
                        candidate: c,
                        ref_op: Op::Attention(rf),
                        cand_op: Op::Attention(cf),
                    });
                }
            }
            // FP16 accumulation: the dot products before the scale reach the format's range
            // (refused where they may overflow).
            let f16 = Policy::new(Format::F16, Format::F16, Format::F16);
            out.push(Pair {
                name: "f16 in, f16 acc: standard seq vs pairwise(8)".into(),
                reference: f16.clone(),
                candidate: f16.with_order(Order::Pairwise { base: 8 }),
                ref_op: Op::Attention(std),
                cand_op: Op::Attention(std),
            });
        }
        Op::Softmax(_) => {
            for out_f in [Format::F32, Format::BF16] {
                let base = Policy::new(Format::BF16, Format::F32, out_f);
                out.push(Pair {
                    name: format!("->{out_f} standard seq vs online(16)"),
                    reference: base.clone(),
                    candidate: base.clone(),
                    ref_op: Op::Softmax(AttentionImpl::Standard),
                    cand_op: Op::Softmax(AttentionImpl::Online { block: 16 }),
                });
                out.push(Pair {
                    name: format!("->{out_f} seq vs pairwise(8)"),
                    reference: base.clone(),
                    candidate: base.clone().with_order(Order::Pairwise { base: 8 }),
                    ref_op: Op::Softmax(AttentionImpl::Standard),
                    cand_op: Op::Softmax(AttentionImpl::Standard),
                });
                // FP32 logits (their differences from the maximum round in FP32).
                let f32 = Policy::new(Format::F32, Format::F32, out_f);
                out.push(Pair {
                    name: format!("f32->{out_f} seq vs pairwise(8)"),
                    reference: f32.clone(),
                    candidate: f32.with_order(Order::Pairwise { base: 8 }),
                    ref_op: Op::Softmax(AttentionImpl::Standard),
                    cand_op: Op::Softmax(AttentionImpl::Standard),
                });
                // A vocabulary-parallel softmax whose partial sums are all-reduced in BF16.
                out.push(Pair {
                    name: format!("->{out_f} seq vs vocab-parallel 8 bf16"),
                    reference: base.clone(),
                    candidate: base.clone().with_order(split(
                        8,
                        Format::BF16,
                        Combine::Ring { start: 1 },
                    )),
                    ref_op: Op::Softmax(AttentionImpl::Standard),
                    cand_op: Op::Softmax(AttentionImpl::Standard),
                });
            }
            // FP16 throughout: the denominators sum in FP16.
            let f16 = Policy::new(Format::F16, Format::F16, Format::F16);
            out.push(Pair {
                name: "f16 in, f16 acc: seq vs pairwise(8)".into(),
                reference: f16.clone(),
                candidate: f16.with_order(Order::Pairwise { base: 8 }),
                ref_op: Op::Softmax(AttentionImpl::Standard),
                cand_op: Op::Softmax(AttentionImpl::Standard),
            });
        }
        Op::CrossEntropy | Op::CrossEntropyGrad => {
            // Logits in BF16 and FP32, the loss in FP32 and BF16; the denominators and the
            // loss's sum in other orders, vocabulary-parallel among them (the shards' partial
            // sums all-reduced in FP32 or BF16).
            for (input, out_f) in [
                (Format::BF16, Format::F32),
                (Format::F32, Format::F32),
                (Format::BF16, Format::BF16),
            ] {
                let base = Policy::new(input, Format::F32, out_f);
                for (name, order) in [
                    ("pairwise(8)", Order::Pairwise { base: 8 }),
                    ("vocab-parallel 4 f32", split(4, Format::F32, Combine::Tree)),
                    (
                        "vocab-parallel 8 bf16",
                        split(8, Format::BF16, Combine::Ring { start: 1 }),
                    ),
                ] {
                    out.push(mk(
                        format!("{input}->{out_f} seq vs {name}"),
                        base.clone(),
                        base.clone().with_order(order),
                    ));
                }
            }
            out.push(mk(
                "bf16 loss vs f32 loss, seq vs pairwise(8)".into(),
                Policy::new(Format::BF16, Format::F32, Format::BF16),
                Policy::new(Format::BF16, Format::F32, Format::F32)
                    .with_order(Order::Pairwise { base: 8 }),
            ));
            let f16 = Policy::new(Format::F16, Format::F16, Format::F16);
            out.push(mk(
                "f16 in, f16 acc: seq vs pairwise(8)".into(),
                f16.clone(),
                f16.with_order(Order::Pairwise { base: 8 }),
            ));
            // A reference kernel of unknown order (the engine runs its first member,
            // sequential) against a pairwise candidate.
            let bf16 = Policy::new(Format::BF16, Format::F32, Format::F32);
            out.push(mk(
                "bf16->f32 any vs pairwise(8)".into(),
                bf16.clone().with_order(Order::unknown_kernel(Format::F32)),
                bf16.with_order(Order::Pairwise { base: 8 }),
            ));
        }
        Op::LayerNormFast(v) => {
            out = pairs(Op::LayerNorm(v));
            for p in &mut out {
                (p.ref_op, p.cand_op) = (fast_form(p.ref_op), fast_form(p.cand_op));
            }
        }
        Op::RmsNormFast => {
            out = pairs(Op::RmsNorm);
            for p in &mut out {
                (p.ref_op, p.cand_op) = (fast_form(p.ref_op), fast_form(p.cand_op));
            }
        }
        Op::LayerNorm(_) | Op::RmsNorm => {
            let base = Policy::new(Format::F32, Format::F32, Format::F32);
            let variants: Vec<(Op, Op, &str)> = if op == Op::RmsNorm {
                vec![(Op::RmsNorm, Op::RmsNorm, "rms")]
            } else {
                vec![
                    (
                        Op::LayerNorm(Variance::TwoPass),
                        Op::LayerNorm(Variance::TwoPass),
                        "two-pass",
                    ),
                    (
                        Op::LayerNorm(Variance::TwoPass),
                        Op::LayerNorm(Variance::OnePass),
                        "two-pass vs one-pass",
                    ),
                    (
                        Op::LayerNorm(Variance::TwoPass),
                        Op::LayerNorm(Variance::Welford),
                        "two-pass vs welford",
                    ),
                ]
            };
            for (r, c, name) in variants {
                out.push(Pair {
                    name: format!("{name}: seq vs pairwise(8)"),
                    reference: base.clone(),
                    candidate: base.clone().with_order(Order::Pairwise { base: 8 }),
                    ref_op: r,
                    cand_op: c,
                });
                // The same order on both sides (the variance algorithms alone differ), with
                // FP32 and BF16 inputs.
                if r != c {
                    for input in [Format::F32, Format::BF16] {
                        let p = Policy::new(input, Format::F32, Format::F32);
                        out.push(Pair {
                            name: format!("{name}: {input} seq"),
                            reference: p.clone(),
                            candidate: p,
                            ref_op: r,
                            cand_op: c,
                        });
                    }
                }
            }
            if op != Op::RmsNorm {
                // Compensated summation on the candidate's side.
                out.push(Pair {
                    name: "two-pass: seq vs kahan".into(),
                    reference: base.clone(),
                    candidate: base.clone().with_order(Order::Kahan),
                    ref_op: Op::LayerNorm(Variance::TwoPass),
                    cand_op: Op::LayerNorm(Variance::TwoPass),
                });
                out.push(Pair {
                    name: "welford: seq vs pairwise(8)".into(),
                    reference: base.clone(),
                    candidate: base.clone().with_order(Order::Pairwise { base: 8 }),
                    ref_op: Op::LayerNorm(Variance::Welford),
                    cand_op: Op::LayerNorm(Variance::Welford),
                });
            }
        }
    }
    out
}

/// The forms the two sides of `pair` run for `op`: the pair's own for ops with forms
/// (softmax, norms, attention), the op itself otherwise.
pub fn forms(op: Op, pair: &Pair) -> (Op, Op) {
    match op {
        Op::Softmax(_)
        | Op::LayerNorm(_)
        | Op::RmsNorm
        | Op::LayerNormFast(_)
        | Op::RmsNormFast
        | Op::Attention(_) => (pair.ref_op, pair.cand_op),
        _ => (op, op),
    }
}

/// A norm's form priced with `Pricing::Fast`.
fn fast_form(o: Op) -> Op {
    match o {
        Op::LayerNorm(v) => Op::LayerNormFast(v),
        Op::RmsNorm => Op::RmsNormFast,
        o => o,
    }
}

/// The outcome of one trial.
#[derive(Debug, Clone, Copy)]
pub enum Outcome {
    /// Observed ‖D‖_F, guaranteed and probabilistic thresholds (∞ ratio when D = 0).
    Priced {
        observed: f64,
        guaranteed: f64,
        probabilistic: f64,
        oracle_ok: bool,
        /// max |cand − ref| and the guaranteed and probabilistic per-element bounds.
        per_element: (f64, f64, f64),
        /// The engine's executions contradicted the model at δ = 10⁻³, and the probabilistic
        /// request was answered with the guaranteed threshold.
        model_fallback: bool,
    },
    /// The threshold function refused with an overflow (or non-finite) error: allowed only when
    /// the computation could really leave the finite range.
    Refused { results_finite: bool },
    /// Either side produced a non-finite result but the threshold did not refuse.
    UnflaggedNonFinite,
}

pub fn threshold(
    op_r: Op,
    op_c: Op,
    x: &Tensor,
    b: &Tensor,
    pair: &Pair,
    conf: Confidence,
) -> ttrace::Result<Threshold> {
    let (r, c) = (&pair.reference, &pair.candidate);
    match op_r {
        Op::Sum | Op::Mean => sum_threshold(x, r, c, op_r == Op::Mean, conf),
        Op::SumFast | Op::MeanFast => {
            sum_threshold_priced(x, r, c, op_r == Op::MeanFast, conf, Pricing::Fast)
        }
        Op::AllReduce => allreduce_threshold(&partials(x)?, r, c, conf),
        Op::Elementwise(e) => {
            let y = (e == Elementwise::Add).then_some(b);
            elementwise_threshold(e, x, y, r, c, conf)
        }
        Op::Matmul => matmul_threshold(x, b, None, r, c, conf),
        Op::MatmulFast => matmul_threshold_priced(x, b, None, r, c, conf, Pricing::Fast),
        Op::Softmax(ri) => {
            let Op::Softmax(ci) = op_c else {
                unreachable!()
            };
            softmax_threshold(x, r, ri, c, ci, conf)
        }
        Op::CrossEntropy => cross_entropy_threshold(x, &targets(x)?, r, c, conf),
        Op::CrossEntropyGrad => cross_entropy_grad_threshold(x, &targets(x)?, 1.0, r, c, conf),
        Op::Attention(rf) => {
            let Op::Attention(cf) = op_c else {
                unreachable!()
            };
            let (k, v) = attention_kv(b)?;
            let side = |p: &Policy, form| {
                let mut s = ttrace::bounds::OpSide::new(p.clone());
                s.form = form;
                s
            };
            attention_threshold(x, &k, &v, causal(x), &side(r, rf), &side(c, cf), conf)
        }
        Op::LayerNorm(_) | Op::RmsNorm | Op::LayerNormFast(_) | Op::RmsNormFast => {
            let n = *x.shape().last().unwrap();
            let w = Tensor::from_vec(&[n], vec![1.0; n], Format::F32)?;
            let bias = Tensor::from_vec(&[n], vec![0.0; n], Format::F32)?;
            let to = |o: Op| match o {
                Op::LayerNorm(v) | Op::LayerNormFast(v) => NormOp::LayerNorm(v),
                _ => NormOp::RmsNorm,
            };
            let bias = if matches!(op_r, Op::RmsNorm | Op::RmsNormFast) {
                None
            } else {
                Some(&bias)
            };
            let pricing = if matches!(op_r, Op::LayerNormFast(_) | Op::RmsNormFast) {
                Pricing::Fast
            } else {
                Pricing::Walk
            };
            norm_threshold_priced(
                &NormData {
                    x,
                    weight: &w,
                    bias,
                    eps: 1e-5,
                },
                NormSide {
                    op: to(op_r),
                    policy: r,
                },
                NormSide {
                    op: to(op_c),
                    policy: c,
                },
                conf,
                pricing,
            )
        }
    }
}

/// The k partials of an all-reduce over a [rows, k] block: partial r is column r.
fn partials(x: &Tensor) -> ttrace::Result<Vec<Tensor>> {
    let k = *x.shape().last().unwrap();
    let rows = x.len() / k;
    (0..k)
        .map(|r| {
            let col: Vec<f64> = (0..rows).map(|i| x.values()[i * k + r]).collect();
            Tensor::from_vec(&[rows], col, x.format())
        })
        .collect()
}

pub fn execute(op: Op, x: &Tensor, b: &Tensor, p: &Policy) -> ttrace::Result<Vec<f64>> {
    let n = *x.shape().last().unwrap();
    Ok(match op {
        Op::Elementwise(e) => match e {
            Elementwise::Add => add(x, b, p)?,
            Elementwise::Scale { c } => scale(x, c, p)?,
            Elementwise::Gelu => gelu(x, p)?,
            Elementwise::Silu => silu(x, p)?,
            Elementwise::Exp => unreachable!("not in the zoo's ops"),
        }
        .into_values(),
        Op::Sum | Op::Mean | Op::SumFast | Op::MeanFast | Op::AllReduce => {
            let rows = x.len() / n;
            let mut acc = p.accumulation.clone();
            acc.input = p.input();
            let xi = x.cast(p.input(), Overflow::Saturating);
            let mut out = vec![];
            for row in 0..rows {
                let s = sum(&xi.values()[row * n..(row + 1) * n], &acc)?;
                let v = if op == Op::Mean || op == Op::MeanFast {
                    p.accumulator().round(s / n as f64, p.accumulation.overflow)
                } else {
                    s
                };
                out.push(p.output.round(v, p.accumulation.overflow));
            }
            out
        }
        Op::Matmul | Op::MatmulFast => matmul(x, b, p)?.into_values(),
        Op::Softmax(AttentionImpl::Standard) => softmax(x, p)?.into_values(),
        Op::Softmax(AttentionImpl::Online { block }) => online_softmax(x, block, p)?.into_values(),
        Op::LayerNorm(v) | Op::LayerNormFast(v) => {
            let w = Tensor::from_vec(&[n], vec![1.0; n], Format::F32)?;
            let bias = Tensor::from_vec(&[n], vec![0.0; n], Format::F32)?;
            layer_norm(x, &w, &bias, 1e-5, v, p)?.0.into_values()
        }
        Op::RmsNorm | Op::RmsNormFast => {
            let w = Tensor::from_vec(&[n], vec![1.0; n], Format::F32)?;
            rms_norm(x, &w, 1e-5, p)?.0.into_values()
        }
        Op::CrossEntropy => cross_entropy(x, &targets(x)?, p)?.into_values(),
        Op::CrossEntropyGrad => cross_entropy_backward(x, &targets(x)?, 1.0, p)?.into_values(),
        Op::Attention(form) => {
            // The engine's attention of one head: qkv [1, rows, 3k].
            let (k, v) = attention_kv(b)?;
            let rows = x.len() / n;
            let mut qkv = Vec::with_capacity(rows * 3 * n);
            for i in 0..rows {
                for t in [x, &k, &v] {
                    qkv.extend_from_slice(&t.values()[i * n..(i + 1) * n]);
                }
            }
            let qkv = Tensor::from_vec(&[1, rows, 3 * n], qkv, x.format())?;
            attention(&qkv, 1, causal(x), form, p)?.0.into_values()
        }
    })
}

/// Attention's K and V, stored side by side in the trial's second operand [rows, 2k].
fn attention_kv(b: &Tensor) -> ttrace::Result<(Tensor, Tensor)> {
    let (rows, two_k) = (b.shape()[0], b.shape()[1]);
    let k = two_k / 2;
    let half = |h: usize| -> ttrace::Result<Tensor> {
        let v = (0..rows)
            .flat_map(|i| b.values()[i * two_k + h * k..i * two_k + (h + 1) * k].to_vec())
            .collect();
        Tensor::from_vec(&[rows, k], v, b.format())
    };
    Ok((half(0)?, half(1)?))
}

/// Whether a trial's attention is causal: by a hash of its queries (every other trial).
fn causal(q: &Tensor) -> bool {
    q.values()
        .iter()
        .fold(0u64, |h, v| h.wrapping_mul(31) ^ v.to_bits())
        % 2
        == 1
}

/// The cross-entropy's targets: per row a class among its finite logits, drawn from a hash of
/// the row's values.
pub fn targets(x: &Tensor) -> ttrace::Result<Vec<usize>> {
    let k = *x.shape().last().unwrap();
    Ok(x.values()
        .chunks(k)
        .map(|row| {
            let h = row.iter().fold(0xcbf29ce484222325u64, |h, v| {
                (h ^ v.to_bits()).wrapping_mul(0x100000001b3)
            });
            let finite: Vec<usize> = (0..k).filter(|&j| row[j].is_finite()).collect();
            finite[(h % finite.len().max(1) as u64) as usize % finite.len().max(1)]
        })
        .collect())
}

/// Attention's operands for one trial: Q [rows, k] and K from `family`, V Gaussian; K and V
/// side by side per row in the second operand [rows, 2k] (what [`execute`] reads).
pub fn attention_operands(
    family: Family,
    rows: usize,
    k: usize,
    seed: u64,
    input: Format,
    acc: Format,
) -> ttrace::Result<(Tensor, Tensor)> {
    let q = generate(family, rows, k, seed, input, acc);
    let kk = generate(family, rows, k, seed ^ 0x4b, input, acc);
    let v = generate(Family::Gaussian, rows, k, seed ^ 0x56, input, acc);
    let mut kv = Vec::with_capacity(rows * 2 * k);
    for i in 0..rows {
        kv.extend_from_slice(&kk[i * k..(i + 1) * k]);
        kv.extend_from_slice(&v[i * k..(i + 1) * k]);
    }
    Ok((
        Tensor::from_vec(&[rows, k], q, input)?,
        Tensor::from_vec(&[rows, 2 * k], kv, input)?,
    ))
}

/// One trial of `op` on `family` with reduction length `k` and `rows` outputs.
pub fn trial(
    op: Op,
    family: Family,
    pair: &Pair,
    k: usize,
    rows: usize,
    seed: u64,
) -> ttrace::Result<Outcome> {
    let input = pair.reference.input();
    let acc = pair.reference.accumulator();
    let (x, b) = match op {
        Op::Softmax(_) | Op::CrossEntropy | Op::CrossEntropyGrad => {
            let mut v = generate(family, rows, k, seed, input, acc);
            softmax_rows(&mut v, k, seed, input);
            (
                Tensor::from_vec(&[rows, k], v, input)?,
                Tensor::zeros(&[1], input),
            )
        }
        Op::Matmul | Op::MatmulFast => {
            let m = rows.clamp(1, 4);
            let n = rows.div_ceil(m);
            let a = generate(family, m, k, seed, input, acc);
            let b_family = if family == Family::Stall {
                Family::Stall
            } else {
                Family::Gaussian
            };
            let bt = generate(b_family, n, k, seed ^ 0x5eed, input, acc);
            // B [k, n] from the transposed rows.
            let mut bv = vec![0.0; k * n];
            for j in 0..n {
                for p in 0..k {
                    bv[p * n + j] = bt[j * k + p];
                }
            }
            (
                Tensor::from_vec(&[m, k], a, input)?,
                Tensor::from_vec(&[k, n], bv, input)?,
            )
        }
        Op::Attention(_) => attention_operands(family, rows, k, seed, input, acc)?,
        Op::Elementwise(_) => {
            let v = generate(family, rows, k, seed, input, acc);
            let y = generate(Family::Gaussian, rows, k, seed ^ 0x5eed, input, acc);
            (
                Tensor::from_vec(&[rows, k], v, input)?,
                Tensor::from_vec(&[rows, k], y, input)?,
            )
        }
        _ => {
            let v = generate(family, rows, k, seed, input, acc);
            (
                Tensor::from_vec(&[rows, k], v, input)?,
                Tensor::zeros(&[1], input),
            )
        }
    };
    let (op_r, op_c) = forms(op, pair);
    let r = execute(op_r, &x, &b, &pair.reference)?;
    let c = execute(op_c, &x, &b, &pair.candidate)?;
    let finite = r.iter().chain(&c).all(|v| v.is_finite());
    let g = threshold(op_r, op_c, &x, &b, pair, Confidence::Guaranteed);
    let p = threshold(
        op_r,
        op_c,
        &x,
        &b,
        pair,
        Confidence::Probabilistic { delta: 1e-6 },
    );
    match (g, p) {
        (Ok(g), Ok(p)) => {
            if !finite {
                return Ok(Outcome::UnflaggedNonFinite);
            }
            let oracle_ok = if matches!(op, Op::Sum | Op::SumFast | Op::AllReduce) {
                sum_oracle(&x, pair)?
            } else {
                true
            };
            let max_diff = r
                .iter()
                .zip(&c)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            Ok(Outcome::Priced {
                observed: frob(&r, &c),
                guaranteed: g.abs_frobenius,
                probabilistic: p.abs_frobenius,
                oracle_ok,
                per_element: (max_diff, g.per_element, p.per_element),
                model_fallback: p.confidence == Confidence::Guaranteed,
            })
        }
        (Err(Error::Overflow { .. } | Error::NoFiniteBound { .. }), _)
        | (_, Err(Error::Overflow { .. } | Error::NoFiniteBound { .. })) => Ok(Outcome::Refused {
            results_finite: finite,
        }),
        (Err(e), _) | (_, Err(e)) => Err(e),
    }
}

/// Masked and degenerate softmax rows: every third trial masks a causal tail with −∞ or with
/// a large negative additive mask; the families "constant" give all-equal logits.
fn softmax_rows(v: &mut [f64], k: usize, seed: u64, input: Format) {
    for (ri, row) in v.chunks_mut(k).enumerate() {
        match (seed + ri as u64) % 4 {
            1 => {
                for x in row.iter_mut().skip(ri % k + 1) {
                    *x = f64::NEG_INFINITY;
                }
            }
            2 => {
                for x in row.iter_mut().skip(ri % k + 1) {
                    *x = input.round(*x - 1e4, Overflow::Saturating);
                }
            }
            3 => dominant_logit(row, ri % k, 30.0, input),
            _ => {}
        }
    }
}

/// Raise `row[j]` by `by` (rounded to `input`): one dominant logit.
pub fn dominant_logit(row: &mut [f64], j: usize, by: f64, input: Format) {
    row[j] = input.round(row[j] + by, Overflow::Saturating);
}

/// Each row's sum on both sides against the exact sum from the big-integer oracle: within the
/// guaranteed bound of `reduction_error` (the error rounded up to f64, so never understated).
fn sum_oracle(x: &Tensor, pair: &Pair) -> ttrace::Result<bool> {
    let n = *x.shape().last().unwrap();
    for p in [&pair.reference, &pair.candidate] {
        let mut acc = p.accumulation.clone();
        acc.input = p.input();
        let xi = x.cast(p.input(), Overflow::Saturating);
        for row in xi.values().chunks(n) {
            let computed = sum(row, &acc)?;
            let exact = common::exact(row);
            let err = common::Dy::from_f64(computed)
                .add(&exact.neg())
                .round(common::spec("f64"), false)
                .abs();
            let bound = reduction_error(row, &acc, false)?.guaranteed;
            if err > bound {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

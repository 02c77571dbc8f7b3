//! Tightness of the probabilistic comparison thresholds (δ = 1e-6) against the engine, and the
//! baselines' false alarms on the same correct executions.
//!
//! `cargo run --release --example tightness -- [trials]` (default 10000 per case, 2000 at
//! K = 16384; about 20 minutes on one core; pass e.g. 500 for a quick look). Softmax rows use
//! logits 3·N(0, 1) in BF16, 16 rows of length K.
//!
//! For each op family and pair of orders, over `trials` random inputs (Gaussian entries, BF16):
//! * tightness = median threshold / largest observed ‖cand − ref‖_F over all trials;
//! * per-trial median = median over trials (with a non-zero difference) of threshold / observed;
//! * closest call = min over trials of threshold / observed (≥ 1: never violated);
//! * exact = share of trials where candidate and reference agree bit for bit;
//! * the baselines' false-alarm rates (PyTorch assert_close, Megatron 4·1.03·ε) and their
//!   nominal relative tolerance divided by the median relative threshold.

#[path = "../tests/common/mod.rs"]
mod common;

use common::frob;
use ttrace::bounds::baselines_for;
use ttrace::bounds::{
    matmul_threshold, norm_threshold, softmax_threshold, sum_threshold, Confidence, NormData,
    NormOp, NormSide,
};
use ttrace::engine::{
    layer_norm, matmul, online_softmax, softmax, AttentionImpl, SplitMix64, Variance,
};
use ttrace::{sum, BlockSum, Combine, Format, Order, Overflow};
use ttrace::{Policy, Tensor};

fn data(n: usize, seed: u64) -> Vec<f64> {
    let mut g = SplitMix64::for_name("tightness", seed);
    (0..n)
        .map(|_| Format::BF16.round(g.normal(), Overflow::Saturating))
        .collect()
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Matmul,
    Sum,
    /// Softmax: reference standard, candidate online with this block (0: standard).
    Softmax(usize),
    /// LayerNorm, reference two-pass, candidate with this variance algorithm.
    LayerNorm(Variance),
}

struct Case {
    family: &'static str,
    name: &'static str,
    reference: Policy,
    candidate: Policy,
    kind: Kind,
}

fn main() {
    let trials: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let conf = Confidence::Probabilistic { delta: 1e-6 };
    let f32out = Policy::new(Format::BF16, Format::F32, Format::F32);
    let bf16out = Policy::new(Format::BF16, Format::F32, Format::BF16);
    let split = |p: usize, partial: Format, combine: Combine| Order::SplitK {
        parts: p,
        inner: Box::new(Order::Sequential),
        partial,
        combine,
    };
    let cases = vec![
        Case {
            family: "matmul f32-out",
            name: "pairwise(8)",
            reference: f32out.clone(),
            candidate: f32out.clone().with_order(Order::Pairwise { base: 8 }),
            kind: Kind::Matmul,
        },
        Case {
            family: "matmul f32-out",
            name: "block-FMA(32)",
            reference: f32out.clone(),
            candidate: f32out.clone().with_order(Order::Blocked {
                block: 32,
                inner: BlockSum::Fused,
            }),
            kind: Kind::Matmul,
        },
        Case {
            family: "matmul f32-out",
            name: "TP4 tree f32",
            reference: f32out.clone(),
            candidate: f32out
                .clone()
                .with_order(split(4, Format::F32, Combine::Tree)),
            kind: Kind::Matmul,
        },
        Case {
            family: "matmul f32-out",
            name: "TP8 ring bf16",
            reference: f32out.clone(),
            candidate: f32out.clone().with_order(split(
                8,
                Format::BF16,
                Combine::Ring { start: 1 },
            )),
            kind: Kind::Matmul,
        },
        Case {
            family: "matmul bf16-out",
            name: "TP8 ring bf16",
            reference: bf16out.clone(),
            candidate: bf16out.clone().with_order(split(
                8,
                Format::BF16,
                Combine::Ring { start: 1 },
            )),
            kind: Kind::Matmul,
        },
        Case {
            family: "matmul bf16-out",
            name: "pairwise(8)",
            reference: bf16out.clone(),
            candidate: bf16out.clone().with_order(Order::Pairwise { base: 8 }),
            kind: Kind::Matmul,
        },
        Case {
            family: "sum f32",
            name: "TP4 ring f32",
            reference: f32out.clone(),
            candidate: f32out
                .clone()
                .with_order(split(4, Format::F32, Combine::Ring { start: 2 })),
            kind: Kind::Sum,
        },
        Case {
            family: "softmax f32-out",
            name: "pairwise(8) sum",
            reference: f32out.clone(),
            candidate: f32out.clone().with_order(Order::Pairwise { base: 8 }),
            kind: Kind::Softmax(0),
        },
        Case {
            family: "softmax f32-out",
            name: "online, blocks of 64",
            reference: f32out.clone(),
            candidate: f32out.clone(),
            kind: Kind::Softmax(64),
        },
        Case {
            family: "softmax bf16-out",
            name: "online, blocks of 64",
            reference: bf16out.clone(),
            candidate: bf16out.clone(),
            kind: Kind::Softmax(64),
        },
        Case {
            family: "layernorm f32-out",
            name: "two-pass, pairwise(8) sums",
            reference: f32out.clone(),
            candidate: f32out.clone().with_order(Order::Pairwise { base: 8 }),
            kind: Kind::LayerNorm(Variance::TwoPass),
        },
        Case {
            family: "layernorm f32-out",
            name: "one-pass variance",
            reference: f32out.clone(),
            candidate: f32out.clone(),
            kind: Kind::LayerNorm(Variance::OnePass),
        },
    ];
    println!("{trials} trials per row, delta = 1e-6, Gaussian BF16 inputs, 4x4 outputs (matmul) or 16 sums");
    println!("| family | candidate vs sequential | K | med(τ)/max(d) | median τ/d | closest call min(τ/d) | violations | exact | torch FA | Megatron FA | torch tol / τ | Megatron tol / τ |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for case in &cases {
        for k in [64usize, 1024, 16384] {
            let trials = if k == 16384 { trials / 5 } else { trials };
            let mut taus = vec![];
            let mut rels = vec![];
            let mut max_d = 0.0f64;
            let mut closest = f64::INFINITY;
            let mut per_trial = vec![];
            let (mut violations, mut exact, mut fa_t, mut fa_m) = (0, 0, 0, 0);
            let bases = baselines_for(case.reference.output, 1);
            for t in 0..trials {
                let seed = (t as u64) << 8 | k.trailing_zeros() as u64;
                let (r, c, th) = if let Kind::LayerNorm(var) = case.kind {
                    let x = Tensor::from_vec(&[16, k], data(16 * k, seed), Format::BF16).unwrap();
                    let w = Tensor::from_vec(
                        &[k],
                        data(k, seed ^ 3)
                            .into_iter()
                            .map(|v| Format::BF16.round(1.0 + 0.1 * v, Overflow::NonSaturating))
                            .collect(),
                        Format::BF16,
                    )
                    .unwrap();
                    let b = Tensor::from_vec(
                        &[k],
                        data(k, seed ^ 5)
                            .into_iter()
                            .map(|v| Format::BF16.round(0.1 * v, Overflow::NonSaturating))
                            .collect(),
                        Format::BF16,
                    )
                    .unwrap();
                    let r = layer_norm(&x, &w, &b, 1e-5, Variance::TwoPass, &case.reference)
                        .unwrap()
                        .0
                        .values()
                        .to_vec();
                    let c = layer_norm(&x, &w, &b, 1e-5, var, &case.candidate)
                        .unwrap()
                        .0
                        .values()
                        .to_vec();
                    let th = norm_threshold(
                        &NormData {
                            x: &x,
                            weight: &w,
                            bias: Some(&b),
                            eps: 1e-5,
                        },
                        NormSide {
                            op: NormOp::LayerNorm(Variance::TwoPass),
                            policy: &case.reference,
                        },
                        NormSide {
                            op: NormOp::LayerNorm(var),
                            policy: &case.candidate,
                        },
                        conf,
                    )
                    .unwrap();
                    (r, c, th)
                } else if let Kind::Softmax(block) = case.kind {
                    let x: Vec<f64> = data(16 * k, seed)
                        .into_iter()
                        .map(|v| Format::BF16.round(3.0 * v, Overflow::Saturating))
                        .collect();
                    let x = Tensor::from_vec(&[16, k], x, Format::BF16).unwrap();
                    let cand_impl = if block == 0 {
                        AttentionImpl::Standard
                    } else {
                        AttentionImpl::Online { block }
                    };
                    let r = softmax(&x, &case.reference).unwrap().values().to_vec();
                    let c = match cand_impl {
                        AttentionImpl::Standard => softmax(&x, &case.candidate).unwrap(),
                        AttentionImpl::Online { block } => {
                            online_softmax(&x, block, &case.candidate).unwrap()
                        }
                    }
                    .values()
                    .to_vec();
                    (
                        r,
                        c,
                        softmax_threshold(
                            &x,
                            &case.reference,
                            AttentionImpl::Standard,
                            &case.candidate,
                            cand_impl,
                            conf,
                        )
                        .unwrap(),
                    )
                } else if case.kind == Kind::Sum {
                    let x = Tensor::from_vec(&[16, k], data(16 * k, seed), Format::BF16).unwrap();
                    let run = |p: &Policy| -> Vec<f64> {
                        x.values()
                            .chunks(k)
                            .map(|row| {
                                p.output.round(
                                    sum(row, &p.accumulation).unwrap(),
                                    Overflow::NonSaturating,
                                )
                            })
                            .collect()
                    };
                    (
                        run(&case.reference),
                        run(&case.candidate),
                        sum_threshold(&x, &case.reference, &case.candidate, false, conf).unwrap(),
                    )
                } else {
                    let a = Tensor::from_vec(&[4, k], data(4 * k, seed), Format::BF16).unwrap();
                    let b = Tensor::from_vec(&[k, 4], data(4 * k, seed ^ 1), Format::BF16).unwrap();
                    let r = matmul(&a, &b, &case.reference).unwrap().values().to_vec();
                    let c = matmul(&a, &b, &case.candidate).unwrap().values().to_vec();
                    (
                        r,
                        c,
                        matmul_threshold(&a, &b, None, &case.reference, &case.candidate, conf)
                            .unwrap(),
                    )
                };
                let d = frob(&r, &c);
                max_d = max_d.max(d);
                taus.push(th.abs_frobenius);
                rels.push(th.relative);
                if d > th.abs_frobenius {
                    violations += 1;
                }
                if d == 0.0 {
                    exact += 1;
                } else {
                    closest = closest.min(th.abs_frobenius / d);
                    per_trial.push(th.abs_frobenius / d);
                }
                fa_t += usize::from(!bases[0].accepts(&r, &c));
                fa_m += usize::from(!bases[bases.len() - 1].accepts(&r, &c));
            }
            taus.sort_by(|a, b| a.total_cmp(b));
            rels.sort_by(|a, b| a.total_cmp(b));
            let med_tau = taus[taus.len() / 2];
            let med_rel = rels[rels.len() / 2];
            per_trial.sort_by(|a, b| a.total_cmp(b));
            let med_trial = per_trial
                .get(per_trial.len() / 2)
                .map_or("n/a".to_string(), |v| format!("{v:.2}"));
            let tight = if max_d > 0.0 {
                format!("{:.2}", med_tau / max_d)
            } else {
                "n/a (all exact)".into()
            };
            println!(
                "| {} | {} | {} | {} | {} | {:.2} | {} | {:.1}% | {:.1}% | {:.1}% | {:.1} | {:.1} |",
                case.family,
                case.name,
                k,
                tight,
                med_trial,
                closest,
                violations,
                100.0 * exact as f64 / trials as f64,
                100.0 * fa_t as f64 / trials as f64,
                100.0 * fa_m as f64 / trials as f64,
                bases[0].nominal_relative() / med_rel,
                bases[bases.len() - 1].nominal_relative() / med_rel,
            );
        }
    }
}

//! `ttrace threshold`: price an op's comparison threshold between two policies.

use std::io::{self, Write};

use serde::Serialize;
use ttrace::bounds::{baselines_for, Baseline, MatmulPlan, Op, OpOptions, OpSide, OperandRole};
use ttrace::bounds::{op_threshold, plan_matmul, plan_sum, Confidence, TermStats, Threshold};
use ttrace::{Format, Overflow, Policy, Scaling, Tensor};

use crate::out::stdout_error;
use crate::Outcome;

/// The options of `ttrace threshold`.
#[derive(clap::Args)]
pub struct Args {
    /// The op: matmul, linear, sum, mean, allreduce, softmax, layernorm, rmsnorm, add,
    /// scale:C, gelu, silu, exp. Matmul and sum are priced by a closed-form plan (matmul on
    /// synthetic data when a side uses FP8 scaling, a tensor core or an order of unknown
    /// kernel); every other op on synthetic data.
    #[arg(value_parser = parse_op)]
    pub op: Op,
    /// Rows of the output (matmul: m; sum: number of sums; attention: the tokens).
    #[arg(long, default_value_t = 1024)]
    pub m: usize,
    /// Reduction or row length (matmul: k; sum: n; softmax and norms: the row; attention:
    /// the head dimension, 64 to 256 in practice — the defaults price a 4,096-wide head of
    /// 1,024 tokens, about a minute).
    #[arg(long, default_value_t = 4096)]
    pub k: usize,
    /// Columns of the output (matmul and linear); ranks (allreduce).
    #[arg(long, default_value_t = 1024)]
    pub n: usize,
    /// Reference policy.
    #[arg(
        long = "ref",
        default_value = "in=bf16,acc=f32,out=bf16,order=sequential"
    )]
    pub reference: String,
    /// Candidate policy.
    #[arg(
        long = "cand",
        default_value = "in=bf16,acc=f32,out=bf16,order=splitk:8:bf16:ring"
    )]
    pub candidate: String,
    /// Mean of the input entries.
    #[arg(long, default_value_t = 0.0)]
    pub mean: f64,
    /// Standard deviation of the input entries.
    #[arg(long, default_value_t = 1.0)]
    pub std: f64,
    /// Failure probability of the probabilistic threshold.
    #[arg(long, default_value_t = 1e-6)]
    pub delta: f64,
    /// Price the guaranteed (worst-case) threshold instead.
    #[arg(long)]
    pub guaranteed: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The op's text, read by the library's registry ([`Op`]'s `FromStr`).
fn parse_op(s: &str) -> Result<Op, String> {
    s.parse().map_err(|e: ttrace::Error| e.to_string())
}

/// A synthetic tensor with entries mean + std·N(0, 1), rounded to `format`.
fn synthetic(
    shape: &[usize],
    mean: f64,
    std: f64,
    seed: &str,
    format: Format,
) -> Result<Tensor, String> {
    let n = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .unwrap_or(usize::MAX);
    if n > 1 << 24 {
        return Err(format!(
            "synthetic pricing is limited to 2^24 elements (asked {n}); use smaller --m/--k/--n"
        ));
    }
    let values = ttrace::engine::normal_values(seed, n, mean, std, 7);
    Tensor::rounded(shape, values, format, Overflow::Saturating).map_err(|e| e.to_string())
}

#[derive(Serialize)]
struct ThresholdReport {
    op: Op,
    shape: [usize; 3],
    reference: Policy,
    candidate: Policy,
    input_mean: f64,
    input_std: f64,
    threshold: Threshold,
    baselines: Vec<BaselineReport>,
}

#[derive(Serialize)]
struct BaselineReport {
    baseline: Baseline,
    nominal_relative: f64,
}

/// Price the threshold and print it.
pub fn run(a: Args) -> Result<Outcome, String> {
    let Args {
        op,
        m,
        k,
        n,
        reference,
        candidate,
        mean,
        std,
        delta,
        guaranteed,
        json,
    } = a;
    let (reference, candidate) = (reference.as_str(), candidate.as_str());
    let side = |t: &str| t.parse::<OpSide>().map_err(|e| e.to_string());
    let (rs, cs) = (side(reference)?, side(candidate)?);
    let (rp, cp) = (rs.policy.clone(), cs.policy.clone());
    if !(std >= 0.0 && std.is_finite() && mean.is_finite()) {
        return Err(format!(
            "--mean and --std must be finite and --std non-negative (got {mean}, {std})"
        ));
    }
    let confidence = if guaranteed {
        Confidence::Guaranteed
    } else {
        Confidence::probabilistic(delta).map_err(|e| e.to_string())?
    };
    let stats = TermStats::normal(mean, std);
    let e = |r: ttrace::Result<Threshold>| r.map_err(|e| e.to_string());
    // FP8 scaling, tensor cores and orders of unknown kernel are priced from data: on
    // synthetic operands.
    let data_only = |p: &Policy| {
        let o = &p.accumulation.order;
        p.scaling != Scaling::None || o.has_tensor_core() || o.has_family()
    };
    let fp8 = data_only(&rp) || data_only(&cp);
    let planned = matches!(op, Op::Sum) || (matches!(op, Op::Matmul) && !fp8);
    let th = match op {
        Op::Matmul if !fp8 => e(plan_matmul(
            &MatmulPlan {
                m,
                k,
                n,
                a: stats,
                b: stats,
            },
            &rp,
            &cp,
            confidence,
        ))?,
        Op::Sum => e(plan_sum(m, k, stats, &rp, &cp, confidence))?,
        _ => {
            // Every other op on synthetic operands, through the library's op registry. A
            // matmul's operands are drawn in FP32 (FP8 scaling quantizes them itself).
            let fmt = if matches!(op, Op::Matmul) {
                Format::F32
            } else {
                rp.input()
            };
            let operands = op.operands(m, k, n);
            let total = operands.iter().try_fold(0usize, |t, o| {
                o.shape
                    .iter()
                    .try_fold(1usize, |a, &d| a.checked_mul(d))
                    .and_then(|x| t.checked_add(x))
            });
            if total.is_none_or(|t| t > 1 << 26) {
                return Err(format!(
                    "synthetic pricing of {op} is limited to 2^26 elements in all; use smaller \
                     --m/--k/--n"
                ));
            }
            let tensors = operands
                .iter()
                .map(|o| {
                    let (mu, sd, seed) = match o.role {
                        OperandRole::Data => (mean, std, format!("cli.{}", o.name)),
                        OperandRole::NormWeight => (1.0, 0.1, "cli.w".to_string()),
                        OperandRole::NormBias => (0.0, 0.1, "cli.b".to_string()),
                        // Targets spread over the k classes (a hash of the row).
                        OperandRole::ClassIndex => {
                            let rows = o.shape.iter().product::<usize>();
                            let t = (0..rows).map(|i| ((i * 7919 + 3) % k.max(1)) as f64);
                            return Tensor::from_vec(&o.shape, t.collect(), Format::F64)
                                .map_err(|e| e.to_string());
                        }
                    };
                    synthetic(&o.shape, mu, sd, &seed, fmt)
                })
                .collect::<Result<Vec<_>, String>>()?;
            let inputs: Vec<&Tensor> = tensors.iter().collect();
            e(op_threshold(
                op,
                &inputs,
                &rs,
                &cs,
                &OpOptions::default(),
                confidence,
            ))?
        }
    };
    let out_format = rp.output;
    let baselines: Vec<BaselineReport> = baselines_for(out_format, 1)
        .into_iter()
        .map(|b| BaselineReport {
            nominal_relative: b.nominal_relative(),
            baseline: b,
        })
        .collect();
    let shape = match op {
        Op::Matmul | Op::Linear | Op::AllReduce => [m, k, n],
        _ => [m, k, 1],
    };
    if json {
        let report = ThresholdReport {
            op,
            shape,
            reference: rp,
            candidate: cp,
            input_mean: mean,
            input_std: std,
            threshold: th,
            baselines,
        };
        outln!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
        );
        return Ok(Outcome::Pass);
    }
    let kind = match th.confidence {
        Confidence::Guaranteed => "guaranteed (every input, every rounding)".to_string(),
        Confidence::Probabilistic { delta } => {
            format!("probabilistic, fails with probability <= {delta:e}")
        }
    };
    let name = op.to_string();
    let how = if planned {
        "closed-form plan"
    } else {
        "priced on a synthetic tensor"
    };
    outln!("op: {name}  shape: {shape:?}  inputs ~ N({mean}, {std}^2)  ({how})");
    outln!("reference: {reference}\ncandidate: {candidate}");
    if th.identical {
        outln!("identical arithmetic: the outputs agree bit for bit; threshold 0");
        return Ok(Outcome::Pass);
    }
    outln!("kind: {kind}");
    outln!(
        "  ||cand - ref||_F / ||ref||_F <= {:.3e}   (expected {:.3e}; worst case {:.3e})",
        th.relative,
        th.expected_relative,
        th.guaranteed_relative
    );
    outln!("  max |cand - ref| per element <= {:.3e}", th.per_element);
    outln!(
        "baselines for {} outputs (nominal relative tolerance):",
        out_format.name()
    );
    for b in &baselines {
        outln!("  {:<62} {:.3e}", b.baseline.name, b.nominal_relative);
    }
    Ok(Outcome::Pass)
}

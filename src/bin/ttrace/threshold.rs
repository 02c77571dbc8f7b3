//! `ttrace threshold`: price an op's comparison threshold between two policies.

use std::io::{self, Write};

use clap::ValueEnum;
use serde::Serialize;
use ttrace::bounds::{baselines_for, Baseline, MatmulPlan, NormData, NormSide};
use ttrace::bounds::{
    elementwise_threshold, matmul_threshold, norm_threshold, plan_matmul, plan_sum,
    softmax_threshold, Confidence, Elementwise, NormOp, TermStats, Threshold,
};
use ttrace::engine::{AttentionImpl, Variance};
use ttrace::{Format, Overflow, Policy, Scaling, Tensor};

use crate::out::stdout_error;
use crate::Outcome;

/// The options of `ttrace threshold`.
#[derive(clap::Args)]
pub struct Args {
    /// The op.
    #[arg(value_enum)]
    pub op: Op,
    /// Rows of the output (matmul: m; sum: number of sums).
    #[arg(long, default_value_t = 1024)]
    pub m: usize,
    /// Reduction length (matmul: k; sum: n).
    #[arg(long, default_value_t = 4096)]
    pub k: usize,
    /// Columns of the output (matmul only).
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

#[derive(Clone, Copy, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// C = A·B (closed-form plan; priced on synthetic data when a side uses FP8 scaling, a
    /// tensor core or an order of unknown kernel).
    Matmul,
    /// Row sums (closed-form plan).
    Sum,
    /// Softmax along rows of length k (synthetic data).
    Softmax,
    /// LayerNorm over rows of length k (synthetic data).
    Layernorm,
    /// RMSNorm over rows of length k (synthetic data).
    Rmsnorm,
    /// GELU, elementwise on an m×k tensor (synthetic data).
    Gelu,
    /// SiLU, elementwise (synthetic data).
    Silu,
}

/// Options of a policy spec that are not part of `Policy`: the softmax form and the LayerNorm
/// variance algorithm.
#[derive(Clone, Copy)]
struct SpecExtras {
    form: AttentionImpl,
    variance: Variance,
}

/// A policy spec: the library's policy text (`Policy`'s `FromStr`, which refuses unknown
/// keys) plus the keys `form=standard|online:B` and `variance=twopass|onepass|welford` that
/// only the softmax and norm thresholds read — one parser, every key accounted for.
fn parse_spec(s: &str) -> Result<(Policy, SpecExtras), String> {
    let mut extras = SpecExtras {
        form: AttentionImpl::Standard,
        variance: Variance::TwoPass,
    };
    let mut policy = vec![];
    for item in s.split(',').filter(|x| !x.trim().is_empty()) {
        match item.split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
            Some(("form", v)) => {
                extras.form = v.parse().map_err(|e: ttrace::Error| e.to_string())?
            }
            Some(("variance", v)) => {
                extras.variance = v.parse().map_err(|e: ttrace::Error| e.to_string())?
            }
            _ => policy.push(item),
        }
    }
    let policy = policy
        .join(",")
        .parse::<Policy>()
        .map_err(|e| e.to_string())?;
    Ok((policy, extras))
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

#[allow(clippy::too_many_arguments)]
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
    let (rp, er) = parse_spec(reference)?;
    let (cp, ec) = parse_spec(candidate)?;
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
    let fmt = rp.input();
    let e = |r: ttrace::Result<Threshold>| r.map_err(|e| e.to_string());
    // FP8 scaling, tensor cores and orders of unknown kernel are priced from data: on
    // synthetic operands.
    let data_only = |p: &Policy| {
        let o = &p.accumulation.order;
        p.scaling != Scaling::None || o.has_tensor_core() || o.has_family()
    };
    let fp8 = data_only(&rp) || data_only(&cp);
    let th = match op {
        Op::Matmul if fp8 => {
            let a = synthetic(&[m, k], mean, std, "cli.a", Format::F32)?;
            let b = synthetic(&[k, n], mean, std, "cli.b", Format::F32)?;
            e(matmul_threshold(&a, &b, None, &rp, &cp, confidence))?
        }
        Op::Matmul => e(plan_matmul(
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
        Op::Softmax => {
            let x = synthetic(&[m, k], mean, std, "cli.x", fmt)?;
            e(softmax_threshold(
                &x, &rp, er.form, &cp, ec.form, confidence,
            ))?
        }
        Op::Layernorm | Op::Rmsnorm => {
            let x = synthetic(&[m, k], mean, std, "cli.x", fmt)?;
            let w = synthetic(&[k], 1.0, 0.1, "cli.w", fmt)?;
            let b = synthetic(&[k], 0.0, 0.1, "cli.b", fmt)?;
            let (ro, co, bias) = if matches!(op, Op::Rmsnorm) {
                (NormOp::RmsNorm, NormOp::RmsNorm, None)
            } else {
                (
                    NormOp::LayerNorm(er.variance),
                    NormOp::LayerNorm(ec.variance),
                    Some(&b),
                )
            };
            e(norm_threshold(
                &NormData {
                    x: &x,
                    weight: &w,
                    bias,
                    eps: 1e-5,
                },
                NormSide {
                    op: ro,
                    policy: &rp,
                },
                NormSide {
                    op: co,
                    policy: &cp,
                },
                confidence,
            ))?
        }
        Op::Gelu | Op::Silu => {
            let x = synthetic(&[m, k], mean, std, "cli.x", fmt)?;
            let f = if matches!(op, Op::Gelu) {
                Elementwise::Gelu
            } else {
                Elementwise::Silu
            };
            e(elementwise_threshold(f, &x, None, &rp, &cp, confidence))?
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
        Op::Matmul => [m, k, n],
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
    let name = serde_json::to_value(op)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let how = match op {
        Op::Matmul if !fp8 => "closed-form plan",
        Op::Sum => "closed-form plan",
        _ => "priced on a synthetic tensor",
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

//! The op registry: the one list of ops whose comparison threshold ttrace prices, their text,
//! their operands and one entry point ([`op_threshold`]) that dispatches to each op's model.
//! The command line (`ttrace threshold OP`), the Python bindings
//! (`ttrace.thresholds.threshold`) and `ttrace.testing.assert_close` all go through it, so a
//! new op is a variant here, its model in its own file, its tests and its derivation
//! (`docs/architecture.md`).

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::bounds::compare::{Confidence, Threshold};
use crate::bounds::elementwise::{elementwise_threshold, Elementwise};
use crate::bounds::norm::{norm_threshold, NormData, NormOp, NormSide};
use crate::bounds::ops::allreduce_threshold_of;
use crate::bounds::ops::{matmul_threshold_priced, sum_threshold_priced, Pricing};
use crate::bounds::softmax::softmax_threshold;
use crate::error::{Error, Result};
use crate::policy::{AttentionImpl, Policy, Variance};
use crate::tensor::Tensor;

/// An op whose comparison threshold ttrace prices.
///
/// Its text ([`FromStr`], [`Display`](fmt::Display)) is what the command line and Python
/// take: `matmul`, `linear`, `sum`, `mean`, `allreduce`, `softmax`, `layernorm`, `rmsnorm`,
/// `add`, `scale:C`, `gelu`, `silu`, `exp`.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::Op;
/// let op: Op = "scale:0.5".parse()?;
/// assert_eq!(op.to_string(), "scale:0.5");
/// assert_eq!("linear".parse::<Op>()?.operand_names(), vec!["x", "weight", "bias"]);
/// assert!("conv2d".parse::<Op>().is_err());
/// # Ok::<(), ttrace::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Op {
    /// C = A·B (+ bias): operands `a` (m × k), `b` (k × n), optional `bias` (n).
    Matmul,
    /// `torch.nn.functional.linear`, y = x·weightᵀ + bias: `x` (m × k), `weight` (n × k) as
    /// PyTorch stores it, optional `bias` (n).
    Linear,
    /// Sums along the last dimension of `x`.
    Sum,
    /// Means along the last dimension of `x`.
    Mean,
    /// The element-wise sum of every rank's partial tensor (one operand per rank).
    AllReduce,
    /// Softmax along the last dimension of `x`.
    Softmax,
    /// LayerNorm over the last dimension: `x`, `weight`, optional `bias`.
    LayerNorm,
    /// RMSNorm over the last dimension: `x`, `weight`.
    RmsNorm,
    /// An elementwise op ([`Elementwise`]): `x` (and `y` for `add`).
    Elementwise(Elementwise),
}

/// What an operand of an op holds, for synthetic pricing: data, or a normalization's weight
/// (near 1) or bias (near 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OperandRole {
    /// Activations or weights of the op's data.
    Data,
    /// A normalization's weight (γ): near 1.
    NormWeight,
    /// A normalization's bias (β): near 0.
    NormBias,
}

/// One operand of an op at a given size ([`Op::operands`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Operand {
    /// Its name (`a`, `weight`, `bias`, `partial.3`, …).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// What it holds.
    pub role: OperandRole,
}

impl Op {
    /// Every op's text (`scale:C` for the scale family).
    pub const NAMES: [&'static str; 13] = [
        "matmul",
        "linear",
        "sum",
        "mean",
        "allreduce",
        "softmax",
        "layernorm",
        "rmsnorm",
        "add",
        "scale:C",
        "gelu",
        "silu",
        "exp",
    ];

    /// The names of the operands, in order (optional ones included; `allreduce` takes one
    /// `partial` per rank).
    pub fn operand_names(&self) -> Vec<&'static str> {
        match self {
            Op::Matmul => vec!["a", "b", "bias"],
            Op::Linear | Op::LayerNorm => vec!["x", "weight", "bias"],
            Op::RmsNorm => vec!["x", "weight"],
            Op::AllReduce => vec!["partial"],
            Op::Elementwise(Elementwise::Add) => vec!["x", "y"],
            Op::Sum | Op::Mean | Op::Softmax | Op::Elementwise(_) => vec!["x"],
        }
    }

    /// How many operands the op takes: (fewest, most); `None` for no upper limit.
    pub fn arity(&self) -> (usize, Option<usize>) {
        match self {
            Op::Matmul | Op::Linear | Op::LayerNorm => (2, Some(3)),
            Op::RmsNorm | Op::Elementwise(Elementwise::Add) => (2, Some(2)),
            Op::AllReduce => (1, None),
            Op::Sum | Op::Mean | Op::Softmax | Op::Elementwise(_) => (1, Some(1)),
        }
    }

    /// The operands of the op for an output of `m` rows and a reduction (or row) length `k`;
    /// `n` is the output's columns for `matmul`/`linear` and the number of ranks for
    /// `allreduce`. Optional operands are included (a bias for `matmul`, `linear` and
    /// `layernorm` is not).
    pub fn operands(&self, m: usize, k: usize, n: usize) -> Vec<Operand> {
        let op = |name: &str, shape: &[usize], role| Operand {
            name: name.to_string(),
            shape: shape.to_vec(),
            role,
        };
        use OperandRole::*;
        match self {
            Op::Matmul => vec![op("a", &[m, k], Data), op("b", &[k, n], Data)],
            Op::Linear => vec![op("x", &[m, k], Data), op("weight", &[n, k], Data)],
            Op::LayerNorm => vec![
                op("x", &[m, k], Data),
                op("weight", &[k], NormWeight),
                op("bias", &[k], NormBias),
            ],
            Op::RmsNorm => vec![op("x", &[m, k], Data), op("weight", &[k], NormWeight)],
            Op::AllReduce => (0..n)
                .map(|r| op(&format!("partial.{r}"), &[m, k], Data))
                .collect(),
            Op::Elementwise(Elementwise::Add) => {
                vec![op("x", &[m, k], Data), op("y", &[m, k], Data)]
            }
            Op::Sum | Op::Mean | Op::Softmax | Op::Elementwise(_) => {
                vec![op("x", &[m, k], Data)]
            }
        }
    }
}

impl fmt::Display for Op {
    /// The op's text, which [`FromStr`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Matmul => f.write_str("matmul"),
            Op::Linear => f.write_str("linear"),
            Op::Sum => f.write_str("sum"),
            Op::Mean => f.write_str("mean"),
            Op::AllReduce => f.write_str("allreduce"),
            Op::Softmax => f.write_str("softmax"),
            Op::LayerNorm => f.write_str("layernorm"),
            Op::RmsNorm => f.write_str("rmsnorm"),
            Op::Elementwise(Elementwise::Add) => f.write_str("add"),
            Op::Elementwise(Elementwise::Scale { c }) => write!(f, "scale:{c}"),
            Op::Elementwise(Elementwise::Gelu) => f.write_str("gelu"),
            Op::Elementwise(Elementwise::Silu) => f.write_str("silu"),
            Op::Elementwise(Elementwise::Exp) => f.write_str("exp"),
        }
    }
}

impl FromStr for Op {
    type Err = Error;

    /// One of [`Op::NAMES`], with a finite number for `C` in `scale:C`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidParameter`] for `scale:` without a finite number;
    /// [`Error::UnknownName`] for any other text.
    fn from_str(s: &str) -> Result<Op> {
        let s = s.trim();
        if let Some(c) = s.strip_prefix("scale:") {
            return match c.trim().parse::<f64>() {
                Ok(c) if c.is_finite() => Ok(Op::Elementwise(Elementwise::Scale { c })),
                _ => Err(Error::InvalidParameter {
                    name: "op",
                    reason: format!("'{s}': scale:C needs a finite number C"),
                }),
            };
        }
        Ok(match s {
            "matmul" => Op::Matmul,
            "linear" => Op::Linear,
            "sum" => Op::Sum,
            "mean" => Op::Mean,
            "allreduce" => Op::AllReduce,
            "softmax" => Op::Softmax,
            "layernorm" => Op::LayerNorm,
            "rmsnorm" => Op::RmsNorm,
            "add" => Op::Elementwise(Elementwise::Add),
            "gelu" => Op::Elementwise(Elementwise::Gelu),
            "silu" => Op::Elementwise(Elementwise::Silu),
            "exp" => Op::Elementwise(Elementwise::Exp),
            other => {
                // The ops are listed in `Op::NAMES` (the command line's help, the Python
                // docstrings).
                return Err(Error::UnknownName {
                    kind: "op",
                    name: other.to_string(),
                });
            }
        })
    }
}

impl Serialize for Op {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// One side of an op: its arithmetic ([`Policy`]) and the op's algorithm choices that the
/// policy does not hold — the softmax form and the LayerNorm variance, read by those ops and
/// ignored by the others.
///
/// Its text is the policy's with two more keys, `form=standard|online:B` and
/// `variance=twopass|welford|onepass` (defaults `standard` and `twopass`, written only when
/// they differ).
///
/// # Examples
///
/// ```
/// use ttrace::bounds::OpSide;
/// use ttrace::engine::AttentionImpl;
/// let s: OpSide = "in=bf16,acc=f32,out=bf16,form=online:64".parse()?;
/// assert_eq!(s.form, AttentionImpl::Online { block: 64 });
/// assert_eq!(s.to_string(), "in=bf16,acc=f32,out=bf16,order=sequential,form=online:64");
/// assert!("in=bf16,form=flash".parse::<OpSide>().is_err());
/// # Ok::<(), ttrace::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct OpSide {
    /// The arithmetic.
    pub policy: Policy,
    /// The softmax form (softmax only).
    pub form: AttentionImpl,
    /// The variance algorithm (LayerNorm only).
    pub variance: Variance,
}

impl OpSide {
    /// A side with the default algorithm choices.
    pub fn new(policy: Policy) -> OpSide {
        OpSide {
            policy,
            form: AttentionImpl::Standard,
            variance: Variance::TwoPass,
        }
    }
}

impl From<Policy> for OpSide {
    fn from(policy: Policy) -> OpSide {
        OpSide::new(policy)
    }
}

impl fmt::Display for OpSide {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.policy)?;
        if self.form != AttentionImpl::Standard {
            write!(f, ",form={}", self.form)?;
        }
        if self.variance != Variance::TwoPass {
            write!(f, ",variance={}", self.variance)?;
        }
        Ok(())
    }
}

impl FromStr for OpSide {
    type Err = Error;

    /// A policy's text ([`Policy`]'s [`FromStr`], which refuses unknown keys) with the keys
    /// `form=` and `variance=` taken out first.
    ///
    /// # Errors
    ///
    /// The policy's errors; [`AttentionImpl`]'s and [`Variance`]'s for their keys.
    fn from_str(s: &str) -> Result<OpSide> {
        let (mut form, mut variance) = (AttentionImpl::Standard, Variance::TwoPass);
        let mut policy = vec![];
        for item in s.split(',').filter(|x| !x.trim().is_empty()) {
            match item.split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
                Some(("form", v)) => form = v.parse()?,
                Some(("variance", v)) => variance = v.parse()?,
                _ => policy.push(item),
            }
        }
        Ok(OpSide {
            policy: policy.join(",").parse()?,
            form,
            variance,
        })
    }
}

/// Settings of a threshold beyond its two sides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpOptions {
    /// The normalizations' ε (added to the variance): 1e-5 by default.
    pub norm_eps: f64,
    /// How `matmul`, `linear`, `sum` and `mean` are priced ([`Pricing::Auto`] by default).
    pub pricing: Pricing,
}

impl Default for OpOptions {
    fn default() -> OpOptions {
        OpOptions {
            norm_eps: 1e-5,
            pricing: Pricing::Auto,
        }
    }
}

/// The threshold of `op` on `inputs` (its operands in [`Op::operand_names`] order), the
/// reference's arithmetic against the candidate's: dispatched to the op's model
/// ([`matmul_threshold_priced`], [`sum_threshold_priced`], [`allreduce_threshold`](crate::bounds::allreduce_threshold),
/// [`softmax_threshold`], [`norm_threshold`], [`elementwise_threshold`]), whose
/// documentation states its assumptions and sources.
///
/// # Errors
///
/// [`Error::InvalidParameter`] for a number of operands outside [`Op::arity`]; every error
/// of the op's model (shapes, policies, overflow).
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{op_threshold, Confidence, Op, OpOptions, OpSide};
/// use ttrace::{Format, Tensor};
/// let x = Tensor::from_vec(&[2, 4], vec![1.0, 2.0, 3.0, 4.0, 0.5, 0.25, 0.125, 1.0], Format::BF16)?;
/// let r: OpSide = "in=bf16,acc=f32,out=bf16".parse()?;
/// let c: OpSide = "in=bf16,acc=f32,out=bf16,order=pairwise:2".parse()?;
/// let t = op_threshold(Op::Sum, &[&x], &r, &c, &OpOptions::default(), Confidence::Guaranteed)?;
/// assert!(t.abs_frobenius > 0.0);
/// assert!(op_threshold(Op::Sum, &[&x, &x], &r, &c, &OpOptions::default(), Confidence::Guaranteed).is_err());
/// # Ok::<(), ttrace::Error>(())
/// ```
pub fn op_threshold(
    op: Op,
    inputs: &[&Tensor],
    reference: &OpSide,
    candidate: &OpSide,
    options: &OpOptions,
    confidence: Confidence,
) -> Result<Threshold> {
    let (fewest, most) = op.arity();
    if inputs.len() < fewest || most.is_some_and(|m| inputs.len() > m) {
        let names = op.operand_names().join(", ");
        return Err(Error::InvalidParameter {
            name: "inputs",
            reason: format!(
                "{op} takes {} operand{} ({names}); got {}",
                match most {
                    Some(m) if m == fewest => format!("{m}"),
                    Some(m) => format!("{fewest} to {m}"),
                    None => format!("at least {fewest}"),
                },
                if most == Some(1) { "" } else { "s" },
                inputs.len()
            ),
        });
    }
    let (rp, cp) = (&reference.policy, &candidate.policy);
    let third = inputs.get(2).copied();
    match op {
        Op::Matmul => matmul_threshold_priced(
            inputs[0],
            inputs[1],
            third,
            rp,
            cp,
            confidence,
            options.pricing,
        ),
        Op::Linear => {
            let w = crate::engine::transpose(inputs[1], "weight")?;
            matmul_threshold_priced(inputs[0], &w, third, rp, cp, confidence, options.pricing)
        }
        Op::Sum | Op::Mean => sum_threshold_priced(
            inputs[0],
            rp,
            cp,
            op == Op::Mean,
            confidence,
            options.pricing,
        ),
        // The operands as they are: the all-reduce stacks them once, without a copy first.
        Op::AllReduce => allreduce_threshold_of(inputs, rp, cp, confidence),
        Op::Softmax => softmax_threshold(
            inputs[0],
            rp,
            reference.form,
            cp,
            candidate.form,
            confidence,
        ),
        Op::LayerNorm | Op::RmsNorm => {
            let side = |s: &OpSide| {
                if op == Op::RmsNorm {
                    NormOp::RmsNorm
                } else {
                    NormOp::LayerNorm(s.variance)
                }
            };
            norm_threshold(
                &NormData {
                    x: inputs[0],
                    weight: inputs[1],
                    bias: third,
                    eps: options.norm_eps,
                },
                NormSide {
                    op: side(reference),
                    policy: rp,
                },
                NormSide {
                    op: side(candidate),
                    policy: cp,
                },
                confidence,
            )
        }
        Op::Elementwise(e) => {
            elementwise_threshold(e, inputs[0], inputs.get(1).copied(), rp, cp, confidence)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every name reads back to an op whose text is the name, and the operand lists agree
    /// with the arity.
    #[test]
    fn names_read_back() {
        for name in Op::NAMES {
            let text = name.replace("scale:C", "scale:0.125");
            let op: Op = text.parse().unwrap();
            assert_eq!(op.to_string(), text);
            let (fewest, most) = op.arity();
            let names = op.operand_names().len();
            assert!(fewest <= names && most.is_none_or(|m| m == names), "{op}");
            let operands = op.operands(3, 5, 2);
            assert!(operands.len() >= fewest, "{op}");
        }
        assert!(matches!(
            "scale:x".parse::<Op>(),
            Err(Error::InvalidParameter { name: "op", .. })
        ));
        assert!(matches!(
            "scale:inf".parse::<Op>(),
            Err(Error::InvalidParameter { name: "op", .. })
        ));
        assert!(matches!(
            "conv".parse::<Op>(),
            Err(Error::UnknownName { .. })
        ));
    }
}

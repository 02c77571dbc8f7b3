//! The op registry: the one list of ops whose comparison threshold ttrace prices, their text,
//! the one trait every op's model implements ([`OpModel`]: operands, threshold, gain, the
//! module kinds it prices) and one entry point ([`op_threshold`]) that dispatches to it. The
//! command line (`ttrace threshold OP`), the Python bindings (`ttrace.thresholds.threshold`)
//! and `ttrace.testing.assert_close` all go through it, so a new op is a variant here, its
//! model (implementing [`OpModel`]) in its own file, its tests and its derivation
//! (`docs/architecture.md`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::bounds::attention::AttentionModel;
use crate::bounds::compare::{Confidence, Threshold};
use crate::bounds::cross_entropy::CrossEntropyModel;
use crate::bounds::elementwise::{Elementwise, ElementwiseModel};
use crate::bounds::norm::NormModel;
use crate::bounds::ops::{AllReduceModel, MatmulModel, SumModel};
use crate::bounds::softmax::SoftmaxModel;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::trace::ModuleKind;

pub(crate) mod model;

pub use model::{OpModel, OpOptions, OpSide, Operand, OperandRole};

/// An op whose comparison threshold ttrace prices.
///
/// Its text ([`FromStr`], [`Display`](fmt::Display)) is what the command line and Python
/// take: `matmul`, `linear`, `sum`, `mean`, `allreduce`, `softmax`, `layernorm`, `rmsnorm`,
/// `add`, `scale:C`, `gelu`, `silu`, `exp`, `cross_entropy`, `cross_entropy_grad`, `attention`,
/// `attention:causal`.
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
    /// The mean cross-entropy of `logits` (rows × vocab) against `target` (rows class
    /// indices): a scalar.
    CrossEntropy,
    /// The gradient of that loss in the logits (rows × vocab), the upstream gradient 1:
    /// operands `logits`, `target`.
    CrossEntropyGrad,
    /// One head's scaled dot-product attention softmax(QKᵀ/√d + mask)·V: operands `q`
    /// (m × d), `k` (n × d), `v` (n × dv); `causal`: key j masked for query i when j > i.
    Attention {
        /// torch's `is_causal`.
        causal: bool,
    },
}

impl Op {
    /// Every op's text (`scale:C` for the scale family).
    pub const NAMES: [&'static str; 17] = [
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
        "cross_entropy",
        "cross_entropy_grad",
        "attention",
        "attention:causal",
    ];

    /// The op's model, through which everything below dispatches.
    pub fn model(&self) -> Box<dyn OpModel> {
        match *self {
            Op::Matmul => Box::new(MatmulModel { weight_rows: false }),
            Op::Linear => Box::new(MatmulModel { weight_rows: true }),
            Op::Sum => Box::new(SumModel { mean: false }),
            Op::Mean => Box::new(SumModel { mean: true }),
            Op::AllReduce => Box::new(AllReduceModel),
            Op::Softmax => Box::new(SoftmaxModel),
            Op::LayerNorm => Box::new(NormModel { rms: false }),
            Op::RmsNorm => Box::new(NormModel { rms: true }),
            Op::Elementwise(e) => Box::new(ElementwiseModel(e)),
            Op::CrossEntropy => Box::new(CrossEntropyModel { gradient: false }),
            Op::CrossEntropyGrad => Box::new(CrossEntropyModel { gradient: true }),
            Op::Attention { causal } => Box::new(AttentionModel { causal }),
        }
    }

    /// The names of the operands, in order (optional ones included; `allreduce` takes one
    /// `partial` per rank).
    pub fn operand_names(&self) -> Vec<&'static str> {
        self.model().operand_names().to_vec()
    }

    /// How many operands the op takes: (fewest, most); `None` for no upper limit.
    pub fn arity(&self) -> (usize, Option<usize>) {
        self.model().arity()
    }

    /// The operands of the op for an output of `m` rows and a reduction (or row) length `k`;
    /// `n` is the output's columns for `matmul`/`linear` and the number of ranks for
    /// `allreduce`. Optional operands are included (a bias for `matmul`, `linear` and
    /// `layernorm` is not).
    pub fn operands(&self, m: usize, k: usize, n: usize) -> Vec<Operand> {
        self.model().operands(m, k, n)
    }

    /// The ops whose model prices what a traced module of `kind` computes (its
    /// [`OpModel::module_kinds`]), in [`Op::NAMES`] order: `norm` → `layernorm`, `rmsnorm`;
    /// `loss` → `cross_entropy`; `attention` → `attention`, `attention:causal`; `embedding`
    /// has none yet.
    pub fn for_module(kind: ModuleKind) -> Vec<Op> {
        Op::NAMES
            .iter()
            .filter_map(|name| name.parse::<Op>().ok())
            .filter(|op| op.model().module_kinds().contains(&kind))
            .collect()
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
            Op::CrossEntropy => f.write_str("cross_entropy"),
            Op::CrossEntropyGrad => f.write_str("cross_entropy_grad"),
            Op::Attention { causal: false } => f.write_str("attention"),
            Op::Attention { causal: true } => f.write_str("attention:causal"),
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
            "cross_entropy" => Op::CrossEntropy,
            "cross_entropy_grad" => Op::CrossEntropyGrad,
            "attention" => Op::Attention { causal: false },
            "attention:causal" => Op::Attention { causal: true },
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

/// Read from its text (a manifest's `"op"`): an op the registry does not know is an error
/// naming it.
impl<'de> Deserialize<'de> for Op {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Op, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The threshold of `op` on `inputs` (its operands in [`Op::operand_names`] order), the
/// reference's arithmetic against the candidate's: dispatched to the op's model
/// ([`OpModel::threshold`]: [`matmul_threshold_priced`](crate::bounds::matmul_threshold_priced),
/// [`sum_threshold_priced`](crate::bounds::sum_threshold_priced),
/// [`allreduce_threshold`](crate::bounds::allreduce_threshold),
/// [`softmax_threshold`](crate::bounds::softmax_threshold),
/// [`norm_threshold`](crate::bounds::norm_threshold),
/// [`elementwise_threshold`](crate::bounds::elementwise_threshold),
/// [`cross_entropy_threshold`](crate::bounds::cross_entropy_threshold),
/// [`cross_entropy_grad_threshold`](crate::bounds::cross_entropy_grad_threshold),
/// [`attention_threshold`](crate::bounds::attention_threshold)), whose
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
    let model = op.model();
    let (fewest, most) = model.arity();
    if inputs.len() < fewest || most.is_some_and(|m| inputs.len() > m) {
        let names = model.operand_names().join(", ");
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
    model.threshold(inputs, reference, candidate, options, confidence)
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

//! What every op's model is asked (the [`OpModel`] trait) and the vocabulary of the question:
//! an op's two sides ([`OpSide`]), its options ([`OpOptions`], [`Pricing`]), its operands
//! ([`Operand`]) and the gain it answers ([`Gain`]). Below the models and the registry: each
//! model (`bounds/ops/matmul.rs`, …) implements the trait from here, and the registry
//! (`bounds/op/mod.rs`) dispatches to the models, so no file imports back up.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::bounds::compare::{Confidence, Threshold};
use crate::error::{Error, Result};
use crate::policy::{AttentionImpl, Policy, Variance};
use crate::tensor::Tensor;
use crate::trace::ModuleKind;

/// An op's model: what the registry asks of every op. Each op implements it in the file of
/// its model (as each of statrs' distributions implements its traits in its own file):
/// `matmul` and `linear` in `bounds/ops/matmul.rs`, `sum`, `mean` and `allreduce` in
/// `bounds/ops/sum.rs`, `softmax` in `bounds/softmax.rs`, the norms in `bounds/norm/mod.rs`,
/// the elementwise ops in `bounds/elementwise.rs`, `cross_entropy` in
/// `bounds/cross_entropy/mod.rs` (the gradient's threshold in `bounds/cross_entropy/grad.rs`).
pub trait OpModel {
    /// The names of the operands, in order (optional ones included). Default: one, `x`.
    fn operand_names(&self) -> &'static [&'static str] {
        &["x"]
    }

    /// How many operands it takes: (fewest, most); `None` for no upper limit. Default: exactly
    /// the named ones.
    fn arity(&self) -> (usize, Option<usize>) {
        let n = self.operand_names().len();
        (n, Some(n))
    }

    /// Its operands for an output of `m` rows and a reduction (or row) length `k`; `n` is the
    /// output's columns (`matmul`, `linear`) or the number of ranks (`allreduce`). Default:
    /// every named operand an `m × k` tensor of data.
    fn operands(&self, m: usize, k: usize, _n: usize) -> Vec<Operand> {
        self.operand_names()
            .iter()
            .map(|name| Operand::new(name, &[m, k], OperandRole::Data))
            .collect()
    }

    /// The threshold on ‖candidate − reference‖ of its output on `inputs` (as many as
    /// [`OpModel::arity`] allows: [`op_threshold`](crate::bounds::op_threshold) checks), the
    /// reference's arithmetic against the candidate's.
    fn threshold(
        &self,
        inputs: &[&Tensor],
        reference: &OpSide,
        candidate: &OpSide,
        options: &OpOptions,
        confidence: Confidence,
    ) -> Result<Threshold>;

    /// Its first-order gain in its first operand on `inputs`: ‖Δout‖_F ≤ gain·‖Δx‖_F for a
    /// small difference Δx of the first operand (exact for the linear ops) — how a difference
    /// arriving at the op travels through it.
    fn gain(&self, inputs: &[&Tensor], options: &OpOptions) -> Result<Gain>;

    /// The traced module kinds whose output it computes (a `linear` module is `linear`; an
    /// `activation` module `gelu` or `silu`); empty when it is a part of a module (softmax
    /// inside attention) or no module of its own (a sum, an all-reduce) — the default.
    fn module_kinds(&self) -> &'static [ModuleKind] {
        &[]
    }
}

impl Operand {
    /// An operand.
    pub fn new(name: &str, shape: &[usize], role: OperandRole) -> Operand {
        Operand {
            name: name.to_string(),
            shape: shape.to_vec(),
            role,
        }
    }
}

/// What an operand of an op holds, for synthetic pricing: data, a normalization's weight
/// (near 1) or bias (near 0), or class indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OperandRole {
    /// Activations or weights of the op's data.
    Data,
    /// A normalization's weight (γ): near 1.
    NormWeight,
    /// A normalization's bias (β): near 0.
    NormBias,
    /// Class indices (integers from 0 to the last dimension of the first operand, less one),
    /// held as numbers: a cross-entropy's targets.
    ClassIndex,
}

/// One operand of an op at a given size ([`Op::operands`](crate::bounds::Op::operands)).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Operand {
    /// Its name (`a`, `weight`, `bias`, `partial.3`, …).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// What it holds.
    pub role: OperandRole,
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
    /// How `matmul`, `linear`, `sum`, `mean`, `layernorm` and `rmsnorm` are priced
    /// ([`Pricing::Auto`] by default).
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

/// A first-order gain: ‖Δout‖_F ≤ `gain`·‖Δin‖_F for a small input difference Δin.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Gain {
    /// The factor.
    pub gain: f64,
}

/// How [`matmul_threshold_priced`](crate::bounds::matmul_threshold_priced) prices a matmul from its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pricing {
    /// [`Pricing::Fast`] for products of at least 2²² multiply-adds, or 2²⁰ with at least
    /// 4,096 outputs (for sums: summed values, rows); [`Pricing::Walk`] below, where the walk
    /// takes at most a second or two. A guaranteed threshold takes the fast path at every
    /// size: it is two GEMMs there (within 10⁻⁴ of the walk's bound, never below it).
    #[default]
    Auto,
    /// Every rounding visited by the determined-rounding walk (papers/bounds-reductions.md
    /// §2): the tightest threshold, at about 250 ns per multiply-add and side.
    Walk,
    /// The model's statistics gathered while a vectorized pass executes both declared orders
    /// (papers/bounds-reductions.md §5.1), tens of times the cost of one GEMM (a hundred with
    /// fewer than 4,096 outputs, and for sums): the roundings the walk determines carried
    /// exactly as it carries them — with fewer than 4,096 outputs, and for sums, following
    /// exact values and parities too (about 1.0× the walk's threshold on plain data; from
    /// 4,096 outputs the grid rule alone, about 1.1×) — and the rest as random. Data whose
    /// executions differ systematically from the model, products that could round below
    /// FP32's normal range, and what the pass does not cover (FP8 rescales, rounded products,
    /// narrow accumulators, tensor-core orders, families, Kahan), are priced by the walk —
    /// structured data within [`WALK_BUDGET`](crate::bounds::WALK_BUDGET), and by the pass's guaranteed threshold beyond.
    Fast,
}

impl Pricing {
    /// Whether the fast pass prices an op of `work` multiply-adds (summed values) into
    /// `outputs` elements at `confidence`.
    pub(crate) fn takes_fast(self, work: u128, outputs: usize, confidence: Confidence) -> bool {
        match self {
            Pricing::Auto => {
                confidence == Confidence::Guaranteed
                    || work >= 1 << 22
                    || (work >= 1 << 20 && outputs >= 4096)
            }
            Pricing::Walk => false,
            Pricing::Fast => true,
        }
    }
}

//! Error bounds and comparison thresholds: how far a candidate execution of an op may differ
//! from the reference execution on the same logical inputs because of rounding alone.
//!
//! * Reductions ([`reduction_error`], [`planned_reduction_error`]): the introduced error of one
//!   execution of a sum / dot product under an [`Accumulation`](crate::Accumulation),
//!   guaranteed (Higham) and probabilistic (random rounding model, with the spacing at the
//!   actual partial sums).
//! * Comparisons ([`Threshold`], [`tensor_threshold`]): the difference of two executions, the
//!   rounding of nearly equal values to the same output format, and the tensor-level threshold
//!   on ‖cand − ref‖_F by Bernstein's inequality.
//! * Whole ops ([`matmul_threshold`], [`sum_threshold`], [`allreduce_threshold`],
//!   [`plan_matmul`], [`plan_sum`]): matmul / linear with FP8 quantization, sum, mean,
//!   all-reduce — from the data (checking) or from summary statistics (planning).
//! * [`softmax_threshold`]: softmax, standard and online (blockwise), in any pair of orders.
//! * [`cross_entropy_threshold`], [`cross_entropy_grad_threshold`]: the mean cross-entropy
//!   loss and its gradient in the logits, vocabulary-parallel or not.
//! * [`norm_threshold`]: LayerNorm (two-pass, Welford and one-pass variance) and RMSNorm.
//! * [`elementwise_threshold`]: add, scale, GELU, SiLU, exp; [`quantization_error`] of FP8;
//!   first-order [`Gain`]s that carry an input difference to the output (composition along a
//!   network).
//! * [`baselines_for`]: PyTorch, TransformerEngine and Megatron tolerances for side-by-side
//!   reports.
//!
//! * The op registry ([`Op`], [`OpSide`], [`op_threshold`]): the one list of ops, their text
//!   and operands, and one entry point that dispatches to each op's model — what the command
//!   line, the Python bindings and `assert_close` call.
//!
//! Conventions: u = 2^-p is the unit roundoff everywhere; δ is the failure probability of a
//! probabilistic threshold. Derivations and sources: `papers/bounds-reductions.md`.

pub(crate) mod attention;
pub(crate) mod baselines;
pub(crate) mod checked;
pub(crate) mod compare;
pub(crate) mod cross_entropy;
pub(crate) mod elementwise;
pub(crate) mod fast;
pub(crate) mod keyed;
pub(crate) mod norm;
pub(crate) mod op;
pub(crate) mod ops;
pub(crate) mod reduction;
pub(crate) mod softmax;

pub use attention::attention_threshold;
pub use baselines::{
    baselines_for, megatron_ttrace, torch_assert_close, transformer_engine_fp8, Baseline,
    BaselineRule,
};
pub use compare::{tensor_threshold, Confidence, ElementDiff, Threshold};
pub use cross_entropy::{cross_entropy_grad_threshold, cross_entropy_threshold};
pub use elementwise::{
    elementwise_gain, elementwise_threshold, matmul_gain, norm_gain, quantization_error,
    softmax_gain, Elementwise, QuantizationError,
};
pub use norm::{
    norm_threshold, norm_threshold_priced, NormData, NormOp, NormSide, NORM_FAST_ELEMENTS,
    NORM_FAST_ROW,
};
pub use op::model::Gain;
pub use op::{op_threshold, Op, OpModel, OpOptions, OpSide, Operand, OperandRole};
pub use ops::{
    allreduce_threshold, matmul_threshold, matmul_threshold_priced, plan_matmul, plan_sum,
    sum_threshold, sum_threshold_priced, MatmulPlan, Pricing, MODEL_CHECK_DELTA, WALK_BUDGET,
};
pub use reduction::{
    planned_reduction_error, reduction_error, ReductionError, TermStats, MAX_PLANNED_TERMS,
};
pub use softmax::softmax_threshold;

//! The reference tensor engine: tensors of exact emulated values, ops that execute forward and
//! backward under an arithmetic [`Policy`](crate::Policy), a tiny GPT-style model, and traces of named
//! intermediate tensors.
//!
//! Every op states its arithmetic precisely in its doc comment (which roundings, in which
//! format, in which order), so that the same computation can be composed by hand from
//! [`Format::round`](crate::Format::round), [`sum`](crate::sum) and [`dot`](crate::dot) — the
//! tests do exactly that and require bit-identical results.

pub(crate) mod attention;
pub(crate) mod gemm;
mod lanes32;
pub(crate) mod matmul;
pub(crate) mod model;
pub(crate) mod nn;

pub use crate::random::{fnv1a64, normal_values, uniform_ints, SplitMix64};
pub use attention::{attention, attention_backward, AttentionSaved};
pub use matmul::{
    column_sums, linear, linear_backward, linear_scaled, matmul, matmul_scaled, transpose,
};
pub use model::{Activation, Gpt, GptConfig, Module, ModuleGrads, NormKind, StepHook, StepResult};
pub use nn::{
    add, cross_entropy, cross_entropy_backward, embedding, embedding_backward, exp, gelu,
    gelu_backward, layer_norm, norm_backward, online_softmax, rms_norm, scale, silu, silu_backward,
    softmax, softmax_backward, NormSaved,
};
// The arithmetic vocabulary lives beside `format` and `order` (the bounds price it without the
// engine); its op-level parts are published here, with the ops that use them.
pub use crate::policy::{
    delayed_scale, per_tensor_scale, quantize, AttentionImpl, OpClass, Pass, Quantized, Variance,
};
